"""How an in-process CPU engine's speed depends on its threads and on what else runs.

The suite and the benchmarks run several engines on a 2-core machine; which layout is fastest
depends on the numbers this script measures. Each arm is a fresh process with stock vLLM
(``VLLM_PLUGINS=``), the suite's engine settings (``tests/support/engine.py``) and one workload:
six 700-token prompts of seeded random token ids, 8 tokens each (prefill-bound), then one of
them with 300 new tokens (decode-bound). Arms:

* ``two``: torch's default, a thread per core (the suite's shared engine);
* ``two-passive``: the same with ``OMP_WAIT_POLICY=PASSIVE`` (idle OpenMP threads sleep);
* ``two-busy`` / ``two-passive-busy``: the same with a busy-looping process beside it;
* ``one``: ``OMP_NUM_THREADS=1``;
* ``one-core0`` / ``one-core0-yield``: one thread under ``taskset -c 0``, alone or with a
  process on the same core that calls ``sched_yield`` in a loop (what vLLM's EngineCore does
  while its worker computes, ``SpinCondition.wait`` in
  ``vllm/distributed/device_communicators/shm_broadcast.py``).

Usage: ``.venv/bin/python scripts/engine_threads.py [--arms a,b,...] [--out FILE]``; one JSON
line per arm on stdout, all of them in ``--out``. About a minute per arm here; run it on an
otherwise idle machine (it measures contention, so anything else running skews it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# arm -> (environment, taskset cores or None, competitor: None | "busy" | "yield")
ARMS: dict[str, tuple[dict[str, str], str | None, str | None]] = {
    "two": ({}, None, None),
    "two-passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, None, None),
    "two-busy": ({}, None, "busy"),
    "two-passive-busy": ({"OMP_WAIT_POLICY": "PASSIVE"}, None, "busy"),
    "one": ({"OMP_NUM_THREADS": "1"}, None, None),
    "one-core0": ({"OMP_NUM_THREADS": "1"}, "0", None),
    "one-core0-yield": ({"OMP_NUM_THREADS": "1"}, "0", "yield"),
}
COMPETITORS = {
    "busy": "while True: pass",
    "yield": "import os\nwhile True: os.sched_yield()",
}


def measure() -> dict:
    """The workload, in this process (the child of one arm)."""
    import random

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    sys.path.insert(0, str(ROOT / "tests"))
    from support.engine import ENGINE_KWARGS
    from vllm import LLM, SamplingParams

    from obcache_vllm import model

    llm = LLM(model=str(model.pull()), **ENGINE_KWARGS)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(700)]}
               for _ in range(6)]  # fmt: skip
    t0 = time.monotonic()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    t1 = time.monotonic()
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    t2 = time.monotonic()
    return {"prefill_s": round(t1 - t0, 2), "decode300_s": round(t2 - t1, 2)}


def run_arm(name: str) -> dict:
    env_extra, cores, competitor = ARMS[name]
    env = {**os.environ, "VLLM_PLUGINS": "", **env_extra}
    cmd = [sys.executable, __file__, "--child"]
    if cores is not None:
        cmd = ["taskset", "-c", cores, *cmd]
    rival = None
    if competitor:
        rival_cmd = [sys.executable, "-c", COMPETITORS[competitor]]
        if cores is not None:
            rival_cmd = ["taskset", "-c", cores, *rival_cmd]
        rival = subprocess.Popen(rival_cmd)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    finally:
        if rival is not None:
            rival.kill()
            rival.wait()
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"arm": name, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure()), flush=True)
        return
    rows = []
    for name in args.arms.split(","):
        rows.append(run_arm(name))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({
            "what": "in-process stock engine, suite settings: six 700-token prompts x 8 tokens "
                    "(prefill_s), then one prompt x 300 tokens (decode300_s)",
            "command": f"python scripts/engine_threads.py --arms {args.arms}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpus": os.cpu_count(),
            "arms": rows,
        }, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
