"""The two-lane runner's own logic (tests/support/lanes.py, scripts/test_lanes.py) on stand-ins;
scripts/test_lanes.py on real files is checked at the end (two pytest sessions, one file each)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

from support import lanes

REPO = Path(__file__).resolve().parents[2]


def _items(path: str, *fixtures: str) -> list:
    return [SimpleNamespace(path=Path(path), fixturenames=["request", *fixtures])]


GROUPS = {Path(p): _items(p, *f) for p, f in [
    ("tests/engine/test_admission.py", ("llm", "engine")),
    ("tests/engine/test_stress.py", ("llm",)),
    ("tests/engine/test_hf_reference.py", ("llm", "tokenizer")),
    ("tests/engine/test_small_pool.py", ("model_path",)),
    ("tests/engine/test_smoke.py", ("server",)),
    ("tests/server/test_parity.py", ("server", "stock_server")),
    ("tests/server/test_soak.py", ("model_path",)),
    ("tests/unit/test_options_planning.py", ()),
    ("tests/vllm/test_cpu_view.py", ()),
]}  # fmt: skip


def test_lane_0_takes_the_shared_engine_lane_1_the_servers_and_both_the_rest():
    zero, one = lanes.preference(GROUPS, 0), lanes.preference(GROUPS, 1)
    shared = {"test_admission.py", "test_stress.py", "test_hf_reference.py"}
    server = {"test_smoke.py", "test_parity.py", "test_soak.py"}
    # lane 0 keeps off the server files; lane 1 takes every kind, the shared engine's last
    assert {p.name for p in zero} == set(p.name for p in GROUPS) - server
    assert {p.name for p in one} == set(p.name for p in GROUPS)
    middle = [p for p in one if p.name not in server | shared]
    assert zero[len(shared):] == middle[::-1]
    names0 = [p.name for p in zero]
    # lane 0: the longest shared-engine files first, then the rest of the shared engine's
    assert names0[:3] == ["test_hf_reference.py", "test_stress.py", "test_admission.py"]
    # lane 1: the soak first (a long server file), every server file before any unit file,
    # then the middle, then the shared engine's files from the short end of lane 0's list
    names1 = [p.name for p in one]
    assert names1[:3] == ["test_soak.py", "test_smoke.py", "test_parity.py"]
    assert names1.index("test_options_planning.py") > names1.index("test_smoke.py")
    assert names1[-3:] == names0[:3][::-1]
    assert names1[-4] == "test_small_pool.py" and names0[3] == "test_small_pool.py"


def test_a_shared_engine_file_that_uses_a_server_comes_early_in_lane_0():
    both = "tests/engine/test_smoke.py"  # in GROUPS a server file; here it uses `llm` too
    groups = {**GROUPS, Path(both): _items(both, "llm", "server")}
    names0 = [p.name for p in lanes.preference(groups, 0)]
    names1 = [p.name for p in lanes.preference(groups, 1)]
    assert names0[:4] == [
        "test_hf_reference.py", "test_stress.py", "test_smoke.py", "test_admission.py"
    ]  # fmt: skip
    assert names1[-3] == "test_smoke.py"


class _Def:
    """A stand-in for pytest's FixtureDef: finish() runs its teardown once."""

    def __init__(self, name: str, torn: list[str]):
        self.argname, self.scope, self.cached_result, self.torn = name, "session", ("v",), torn

    def finish(self, request) -> None:
        self.torn.append(self.argname)
        self.cached_result = None


def test_release_tears_down_the_named_session_fixtures_last_set_up_first(monkeypatch):
    torn: list[str] = []
    monkeypatch.setattr(lanes, "_session_fixtures", [])
    defs = {n: _Def(n, torn) for n in ("model_path", "server", "early_server", "stock_server")}
    for d in defs.values():
        lanes.record_fixture(d, request=None)
    lanes.record_fixture(SimpleNamespace(scope="module", argname="server"), request=None)
    assert lanes.release() == ["stock_server", "early_server", "server"]
    assert torn == ["stock_server", "early_server", "server"]
    assert defs["model_path"].cached_result
    # a server set up again is released again; what was not named stays
    defs["server"].cached_result = ("again",)
    lanes.record_fixture(defs["server"], request=None)
    assert lanes.release() == ["server"]
    assert [d.argname for d, _ in lanes._session_fixtures] == ["model_path"]


def test_a_file_is_claimed_by_exactly_one_lane(tmp_path: Path):
    files = [Path(f"x/test_{i}.py") for i in range(200)]
    won: list[list[Path]] = [[], []]

    def lane(which: int) -> None:
        for f in files if which else files[::-1]:
            if lanes._claim(tmp_path, f):
                won[which].append(f)

    threads = [threading.Thread(target=lane, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(won[0] + won[1]) == sorted(files) and not set(won[0]) & set(won[1])


def test_two_lanes_run_each_file_once(tmp_path: Path):
    """scripts/test_lanes.py on two small real files: each runs once, in one lane or the
    other, and the exit status is pytest's."""
    files = ["tests/unit/test_cpu_binding.py", "tests/unit/test_options_planning.py"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OBCACHE_TEST_LANE")}
    # both cores, also when this test itself runs in a lane pinned to one of them
    env["OBCACHE_TEST_CORES"] = "0,1"
    proc = subprocess.run([sys.executable, "scripts/test_lanes.py", *files, "-q", "-p",
                           "no:cacheprovider", "-rA"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    passed = [line.split()[1].split("::")[0] for line in out.splitlines()
              if line.startswith("PASSED ")]  # fmt: skip
    assert set(passed) == set(files), out[-3000:]
    runs = {f: passed.count(f) for f in files}
    one_each = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", *files], cwd=REPO,
                              capture_output=True, text=True, timeout=120).stdout  # fmt: skip
    for f in files:
        assert runs[f] == sum(line.startswith(f + "::") for line in one_each.splitlines())
    assert "lanes: exit [0, 0]" in out


def test_a_whole_run_past_its_time_limit_fails_and_says_so(monkeypatch, capsys):
    """The suite's time target and limit (scripts/test_lanes.py): over 37 minutes in two lanes
    (60 in one) a warning, over 60 (75 in one) a failure; a run that selects tests is held to
    neither; the variable overrides the limit (0: none)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lanes_script", REPO / "scripts/test_lanes.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.delenv("OBCACHE_SUITE_LIMIT_MINUTES", raising=False)
    assert script.over_target(36 * 60, 2, []) is None
    assert "over the 37-minute target: WARNING" in script.over_target(38 * 60, 2, ["-q"])
    assert script.over_limit(38 * 60, 2, ["-q", "-rA"]) is None
    assert script._held_to_limit(0, 38 * 60, 2, []) == 0  # a warning only
    assert "WARNING" in capsys.readouterr().out
    late = script.over_limit(61 * 60, 2, ["-q", "-rA"])
    assert late is not None and "over the 60-minute limit: FAILED" in late
    assert script._held_to_limit(0, 61 * 60, 2, []) == 1
    assert script.over_limit(61 * 60, 1, []) is None
    assert "75-minute" in script.over_limit(76 * 60, 1, [])
    assert script.over_limit(99 * 60, 2, ["tests/unit"]) is None  # a part of the suite
    assert script.over_target(99 * 60, 2, ["tests/unit"]) is None
    monkeypatch.setenv("OBCACHE_SUITE_LIMIT_MINUTES", "0")
    assert script.over_limit(99 * 60, 2, []) is None
    monkeypatch.setenv("OBCACHE_SUITE_LIMIT_MINUTES", "1")
    assert script.over_limit(61, 2, []) is not None


def test_the_merged_record_keeps_each_lanes_files_and_names_the_longest():
    """Each lane's record lists its files' seconds, longest first (tests/conftest.py); the
    merged record keeps them per lane and the run prints each lane's longest."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lanes_script", REPO / "scripts/test_lanes.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    records = [
        {"commit": "c", "cpu": "x", "exit_status": 0, "tests": 2, "passed": 2, "seconds": 90.0,
         "tiers": {"engine": {"tests": 2, "seconds": 80.0}},
         "files": {"stand-in/test_a.py": 60.0, "stand-in/test_b.py": 20.0}},
        {"commit": "c", "cpu": "x", "exit_status": 0, "tests": 1, "passed": 1, "seconds": 30.0,
         "tiers": {"unit": {"tests": 1, "seconds": 25.0}},
         "files": {"stand-in/test_c.py": 25.0}},
    ]  # fmt: skip
    merged = script._merge(records, 95.0)
    assert merged["lanes"][0]["files"] == records[0]["files"]
    assert merged["tests"] == 3 and merged["tiers"]["engine"]["seconds"] == 80.0
    assert script.longest_files(merged, count=1) == [
        "lane 0: 90 s; longest files (s): test_a.py 60",
        "lane 1: 30 s; longest files (s): test_c.py 25",
    ]
