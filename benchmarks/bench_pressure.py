"""Compress under pressure (``kv_when: pressure``) vs stock vLLM vs always compressing, one run.

Each arm is a fresh engine in a child process on one core (stock: ``VLLM_PLUGINS=``), the same
requests (greedy, ``ignore_eos``, exactly ``max_tokens`` long), driven step by step so the
scheduler can be read after every step:

* ``ample``: a pool that holds every request at once. The pressure arm must give stock vLLM's
  tokens for every request (reported: how many are identical) at stock's throughput.
* ``limited``: the same requests all at t = 0 in a pool that holds a few of them: preemptions,
  request throughput, the share of requests compressed.
* ``rise-fall``: requests arrive over time, few, then many, then few again, in the limited
  pool; the timeline (pool use, compressions, preemptions per step) is plotted.

Arms: ``stock``; ``pressure`` (``kv_budget`` 0.25, ``kv_when: pressure``); ``always``
(``kv_budget`` 0.25); all with tova + obcache_key (the server's defaults).

Usage::

    .venv/bin/python benchmarks/bench_pressure.py               # ~11 min on one core
    .venv/bin/python benchmarks/bench_pressure.py --quick

Outputs (``--out``, default results/bench-pressure): ``pressure.json``, ``pressure.md``,
``pressure_timeline.png``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import common

KV = {"kv_budget": 0.25, "kv_pipeline": "tova", "kv_scorer": "obcache_key"}
ARMS = {"stock": None, "pressure": {**KV, "kv_when": "pressure"}, "always": KV}


def _schedule(kind: str, requests: int) -> list[int]:
    """The step at which each request arrives."""
    if kind != "rise-fall":
        return [0] * requests
    steps, t = [], 0
    for gap in [24] * 4 + [4] * (requests - 8) + [24] * 4:  # few, many, few
        steps.append(t)
        t += gap
    return steps[:requests]


def worker(args) -> dict:
    """Child: one arm of one workload, stepped by hand."""
    from vllm import SamplingParams

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    spec = json.loads(args.spec)
    llm = common.engine(args.model, spec["pool"], spec["prompt"] + spec["output"] + 64,
                        max_num_seqs=64, max_num_batched_tokens=512)  # fmt: skip
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    prompts = common.prompts(llm.get_tokenizer(), spec["requests"], spec["prompt"], seed=11)
    kv = spec["kv"]
    params = SamplingParams(temperature=0, max_tokens=spec["output"], ignore_eos=True,
                            extra_args=dict(kv) if kv else None)  # fmt: skip
    preempted = [0]
    preempt = scheduler._preempt_request

    def counted(*a, **k):
        preempted[0] += 1
        return preempt(*a, **k)

    scheduler._preempt_request = counted
    pressure = getattr(scheduler, "obcache_pressure", None)
    arrivals = _schedule(spec["kind"], spec["requests"])
    tokens, usage, timeline = {}, {}, []
    start, step, added = time.perf_counter(), 0, 0
    while added < len(prompts) or engine.has_unfinished_requests():
        while added < len(prompts) and arrivals[added] <= step:
            engine.add_request(f"r{added}", {"prompt_token_ids": prompts[added]}, params)
            added += 1
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
                usage[out.request_id] = (out.kv_transfer_params or {}).get("obcache")
        counts = pressure.counts if pressure is not None else None
        timeline.append([round(time.perf_counter() - start, 3),
                         round(scheduler.kv_cache_manager.usage, 4), len(scheduler.running),
                         len(scheduler.waiting), preempted[0],
                         counts.compressions if counts else 0])  # fmt: skip
        step += 1
    wall = time.perf_counter() - start
    compressed = sum(1 for u in usage.values() if u and u.get("evictions"))
    return {"wall_s": wall, "requests_per_s": len(tokens) / wall, "preemptions": preempted[0],
            "compressed_share": compressed / max(1, len(tokens)),
            "pressure_compressions": counts.compressions if counts else 0,
            "preemptions_avoided": counts.preemptions_avoided if counts else 0,
            "tokens": {k: tokens[k] for k in sorted(tokens)}, "timeline": timeline}  # fmt: skip


WORKLOADS = {
    # kind: (requests, prompt tokens, output tokens, pool blocks)
    "ample": (16, 600, 128, 400),
    "limited": (16, 600, 128, 96),
    "rise-fall": (20, 600, 128, 96),
}


def main() -> int:
    ap = common.parser(__doc__, "pressure")
    ap.add_argument("--spec", help=argparse_suppress())
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("results/bench-pressure"))
    ap.add_argument("--replot", action="store_true",
                    help="redraw pressure_timeline.png from --out's pressure.json, run nothing")
    args = common.parse(ap, worker)
    if args is None:
        return 0
    if args.replot:
        results = json.loads((args.out / "pressure.json").read_text())
        plot(results, args.out / "pressure_timeline.png")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for kind in args.workloads:
        requests, prompt, output, pool = WORKLOADS[kind]
        if args.quick:
            requests, output = max(8, requests // 2), output // 2
        results[kind] = {}
        for arm, kv in ARMS.items():
            spec = {"kind": kind, "requests": requests, "prompt": prompt, "output": output,
                    "pool": pool, "kv": kv}  # fmt: skip
            extra = ["--model", args.model, "--spec", json.dumps(spec)]
            results[kind][arm] = common.run_child(__file__, "pressure", kv is None, extra)
            print(f"{kind}/{arm}: {results[kind][arm]['wall_s']:.0f} s", flush=True)
    (args.out / "pressure.json").write_text(json.dumps(results) + "\n")
    md = markdown(results)
    (args.out / "pressure.md").write_text(md)
    plot(results, args.out / "pressure_timeline.png")
    print(md)
    return 0


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def markdown(results: dict) -> str:
    lines = ["| workload | arm | req/s | vs stock | vs always | preemptions | compressed share | "
             "pressure compressions | tokens = stock |", "|---|---|---|---|---|---|---|---|---|"]
    for kind, arms in results.items():
        stock, always = arms["stock"], arms["always"]
        for arm, r in arms.items():
            same = sum(r["tokens"].get(k) == v for k, v in stock["tokens"].items())
            lines.append(
                f"| {kind} | {arm} | {r['requests_per_s']:.3f} | "
                f"{r['requests_per_s'] / stock['requests_per_s']:.2f}x | "
                f"{r['requests_per_s'] / always['requests_per_s']:.2f}x | {r['preemptions']} | "
                f"{r['compressed_share']:.2f} | {r['pressure_compressions']} | "
                f"{same}/{len(stock['tokens'])} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """The rise-fall workload over time: the KV pool used, then each cumulative count that is
    not zero in every arm (a count that never moved is named in the title instead)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = results.get("rise-fall")
    if not arms:
        return
    # (timeline column, what it counts, the axis label)
    counts = [
        (4, "preemptions", "preemptions (cumulative)"),
        (5, "compressions under pressure", "compressions under\npressure (cumulative)"),
    ]
    moved = {i for i, _, _ in counts if any(s[i] for r in arms.values() for s in r["timeline"])}
    shown = [(i, label) for i, _, label in counts if i in moved]
    zero = [name for i, name, _ in counts if i not in moved]
    fig, axes = plt.subplots(1 + len(shown), 1, figsize=(9, 3.2 + 2.4 * len(shown)), sharex=True,
                             squeeze=False, height_ratios=[1.4] + [1] * len(shown))  # fmt: skip
    axes = axes[:, 0]
    for arm, r in arms.items():
        t = [s[0] for s in r["timeline"]]
        axes[0].plot(t, [s[1] for s in r["timeline"]], label=arm)
        for ax, (i, _) in zip(axes[1:], shown, strict=True):
            ax.plot(t, [s[i] for s in r["timeline"]], label=arm)
    axes[0].set_ylabel("KV pool used")
    for ax, (_, label) in zip(axes[1:], shown, strict=True):
        ax.set_ylabel(label)
    axes[-1].set_xlabel("seconds")
    axes[0].legend()
    title = "A load that rises then falls (96-block pool)"
    if zero:
        title += f"; no {' and no '.join(zero)} in any arm"
    axes[0].set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
