"""The whole suite as two pytest sessions, one per core (tests/support/lanes.py says why).

``python scripts/test_lanes.py [pytest arguments]``: starts lane 0 and lane 1, each pinned to
one core (its affinity; the first two of ``OBCACHE_TEST_CORES``, e.g. ``0,1``, or of this
process's cores), ``OMP_NUM_THREADS=1``, its servers bound to its core, its own
temporary directory; they share one directory of claims, so each test file runs once. Both
lanes' output is printed line by line as it comes (a file's progress line appears when the
file is done). The exit status is the worse of the two; under ``CI=true`` the two lanes'
records (``lane-0.json``, ``lane-1.json`` in .ci/last-run/) are merged into the run's
``suite.json`` there, whose ``seconds`` is this command's wall time. With fewer than two
cores it runs one plain session.

The suite has a time target and a time limit. The project's target for setup and suite on CI's
2 cores is 35 minutes: a whole run (no test selection in the arguments) over 37 minutes of
pytest in two lanes, or 60 as one session on one core, ends with a WARNING line saying so. CI
itself stops at 90 minutes, setup included, and its machines differ in speed (one without
AVX-512 ran this suite about three times slower): a whole run over 60 minutes in two lanes, or
75 in one, fails with a line saying so, even when every test passed, so a slow suite is caught
before CI cuts it off unreported. ``OBCACHE_SUITE_LIMIT_MINUTES`` overrides the limit (0: none).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAST_RUN = ROOT / ".ci" / "last-run"
sys.path.insert(0, str(ROOT / "tests"))
from support.lanes import CLAIMS_ENV, LANE_ENV, suite_cores  # noqa: E402

TARGET_MINUTES = {2: 37.0, 1: 60.0}  # by lanes: over it, a warning
LIMIT_MINUTES = {2: 60.0, 1: 75.0}  # by lanes: over it, the run fails


def _whole(argv: list[str]) -> bool:
    """Only a whole run is timed against the suite's target and limit: arguments that select
    tests (paths, ``-k``, ``-m``) run a part."""
    return not any(not a.startswith("-") or a in ("-k", "-m") for a in argv)


def over_target(seconds: float, lanes: int, argv: list[str]) -> str | None:
    """The warning for a whole run over the suite's time target, or None."""
    target = TARGET_MINUTES[lanes]
    if _whole(argv) and seconds > target * 60:
        return (f"suite: {seconds / 60:.1f} min of pytest in {lanes} lane(s), over the "
                f"{target:.0f}-minute target: WARNING (the project's target: setup + suite 35 "
                "minutes on CI)")  # fmt: skip
    return None


def over_limit(seconds: float, lanes: int, argv: list[str]) -> str | None:
    """Why a run of ``seconds`` broke the suite's time limit, or None (a whole run only)."""
    if not _whole(argv):
        return None
    limit = float(os.environ.get("OBCACHE_SUITE_LIMIT_MINUTES", LIMIT_MINUTES[lanes]))
    if limit and seconds > limit * 60:
        return (f"suite: {seconds / 60:.1f} min of pytest in {lanes} lane(s), over the "
                f"{limit:.0f}-minute limit: FAILED (CI stops at 90 minutes, setup "
                "included)")  # fmt: skip
    return None


def _held_to_limit(code: int, seconds: float, lanes: int, argv: list[str]) -> int:
    """The run's exit status, made a failure (and said why) when it broke the time limit;
    a run over the target only says so."""
    late = over_limit(seconds, lanes, argv)
    for line in (over_target(seconds, lanes, argv), late):
        if line:
            print(line)
    return code or (1 if late else 0)


def _merge(records: list[dict], seconds: float) -> dict:
    tiers: dict[str, dict[str, float]] = {}
    for rec in records:
        for name, tier in rec.get("tiers", {}).items():
            into = tiers.setdefault(name, {"tests": 0, "seconds": 0.0})
            into["tests"] += tier["tests"]
            into["seconds"] = round(into["seconds"] + tier["seconds"], 1)
    total = {k: sum(r.get(k, 0) for r in records)
             for k in ("tests", "passed", "failed", "skipped", "hardware_skips")}  # fmt: skip
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": records[0].get("commit"),
        "cpus": os.cpu_count(),
        "cpu": records[0].get("cpu"),
        "exit_status": max(r.get("exit_status", 1) for r in records),
        **total,
        "seconds": round(seconds, 1),
        "minutes": round(seconds / 60, 1),
        # each lane's files, longest first: where a slow suite's time went
        "lanes": [{"tests": r.get("tests"), "seconds": r.get("seconds"),
                   "files": r.get("files", {})} for r in records],  # fmt: skip
        # per-tier sums of test durations in both lanes (they overlap in time)
        "tiers": tiers,
    }


def longest_files(merged: dict, count: int = 8) -> list[str]:
    """A line per lane: its seconds and its ``count`` longest test files (seconds each)."""
    lines = []
    for i, lane in enumerate(merged["lanes"]):
        top = list(lane.get("files", {}).items())[:count]
        text = ", ".join(f"{Path(f).name} {s:.0f}" for f, s in top)
        lines.append(f"lane {i}: {lane['seconds']:.0f} s; longest files (s): {text}")
    return lines


def _selected(line: str) -> int:
    """The tests a lane will choose from: pytest's "collected N items[ / D deselected / S
    selected]" line."""
    parts = [p.split() for p in line.split("/")]
    return int(parts[-1][0]) if len(parts) > 1 else int(parts[0][1])


def main(argv: list[str]) -> int:
    cores = suite_cores()
    pytest = [sys.executable, "-m", "pytest", *argv]
    if len(cores) < 2:
        started = time.monotonic()
        code = subprocess.call(pytest, cwd=ROOT)
        seconds = time.monotonic() - started
        print(f"suite: {seconds:.0f} s ({seconds / 60:.1f} min) of pytest in one session")
        return _held_to_limit(code, seconds, 1, argv)
    claims = Path(tempfile.mkdtemp(prefix="obcache-lanes-"))
    for old in LAST_RUN.glob("lane-*.json"):
        old.unlink()
    started = time.monotonic()
    lock = threading.Lock()
    procs, readers = [], []
    collected: list[int] = []
    for lane, core in enumerate(cores[:2]):
        env = {**os.environ, LANE_ENV: str(lane), CLAIMS_ENV: str(claims),
               "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
               "OBCACHE_TEST_CORES": ",".join(map(str, cores[:2]))}  # fmt: skip
        cmd = [*pytest, f"--basetemp={claims / f'lane-{lane}'}"]
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1, preexec_fn=lambda core=core: os.sched_setaffinity(0, {core}),
        )  # fmt: skip
        procs.append(proc)

        def pump(stream=proc.stdout):
            for line in stream:  # whole lines, so the two lanes' lines never mix
                with lock:
                    if line.startswith("collected "):
                        collected.append(_selected(line))
                    sys.stdout.write(line)
                    sys.stdout.flush()

        readers.append(threading.Thread(target=pump, daemon=True))
        readers[-1].start()
    codes = [p.wait() for p in procs]
    for r in readers:
        r.join()
    seconds = time.monotonic() - started
    records = [json.loads(p.read_text()) for p in sorted(LAST_RUN.glob("lane-*.json"))]
    print(f"lanes: exit {codes}, {seconds:.0f} s ({seconds / 60:.1f} min) of pytest in two lanes")
    if len(records) == 2:
        merged = _merge(records, seconds)
        print(f"suite: {merged['tests']} tests, {merged['passed']} passed, {merged['failed']} "
              f"failed, {merged['skipped']} skipped, {merged['seconds']:.0f} s "
              f"({merged['minutes']} min) of pytest on {merged['cpu']}")  # fmt: skip
        for line in longest_files(merged):
            print(line)
        if collected and merged["tests"] != collected[0]:
            # a lane that died would leave files unclaimed: their tests ran nowhere
            print(f"lanes: {merged['tests']} tests ran, {collected[0]} were selected: FAILED")
            return max(codes) or 1
        (LAST_RUN / "suite.json").write_text(json.dumps(merged, indent=1) + "\n")
        print(f"suite record: {LAST_RUN / 'suite.json'}")
    return _held_to_limit(max(codes), seconds, 2, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
