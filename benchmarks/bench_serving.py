"""Serving at the KV pool's limit: stock vLLM (small pool, and a pool big enough for all) vs
obcache-vllm (small pool), the same requests, in one run; ratios to both.

Every workload sends all its requests at t = 0 (enough of them that the KV pool, not the request
count, limits concurrency) to three configurations, each in a fresh child on one core:

* ``stock, small pool``  - stock vLLM (``VLLM_PLUGINS=``), the workload's small pool;
* ``stock, unlimited``   - stock vLLM, a pool that holds every request at once (the memory
  limit removed: the throughput the small pool would have with enough memory);
* ``obcache, small pool``- the plugin, the small pool, each request with the workload's kv_*.

``--same-pool`` workloads (long-context decode, equal-batch overhead) instead run stock and the
plugin in the SAME pool big enough for all: any difference is the cost or gain of eviction at an
equal batch.

Reported per configuration: completed requests/s and output tokens/s over the run, max and mean
running requests, preemptions, TTFT and TPOT p50/p99 (vLLM's definitions: TPOT excludes the
first token), decode-only tokens/s (steps that scheduled no prompt token), mean step time split
into model and eviction (the worker's own scoring + compaction time), and the KV pool usage over
time (plot). Ratios: vs stock in the same pool, and vs the memory-unlimited stock.

Usage (the default model from ``obcache-vllm model pull``)::

    .venv/bin/python benchmarks/bench_serving.py --workloads decode-bound prefill-bound
    .venv/bin/python benchmarks/bench_serving.py --workloads long-7k-b8 --repeats 1
    .venv/bin/python benchmarks/bench_serving.py --quick          # make bench (minutes)

Outputs: a Markdown table per workload on stdout and in ``--out`` (default results/bench):
``serving.json``, ``serving.md``, ``serving_kv_usage.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import common


@dataclass(frozen=True)
class Workload:
    requests: int
    prompt_tokens: int
    max_tokens: int
    kv: dict
    small_pool: int | None  # blocks; None: same-pool workload
    big_pool: int
    max_num_seqs: int = 64
    batched_tokens: int = 2048
    note: str = ""
    same_pool: bool = False
    extra: dict = field(default_factory=dict)
    # Dense and redundant documents in turn (common.mixed_prompts) instead of haystacks only.
    mixed: bool = False
    # A second plugin configuration on the same pool, with these kv_* fields instead (e.g. a
    # fixed budget against an error target), reported beside the first.
    compare_kv: dict | None = None
    # Engine settings beside the project's (e.g. {"kv_cache_dtype": "fp8"}: bench_kv_dtype.py).
    engine: dict = field(default_factory=dict)


TOVA_KEY = {"kv_pipeline": "tova", "kv_scorer": "obcache_key", "kv_per_head": False}
# An error target against the fixed budget of the same fidelity: tova + obcache_key, per head,
# as scripts/error_target_eval.py measured them (results/error-target: max_error 0.01 kept
# 0.269 of the prompt on average, at the mean KL a fixed budget reaches keeping 0.284).
TOVA_KEY_HEAD = {"kv_pipeline": "tova", "kv_scorer": "obcache_key"}
TARGET = {"kv_budget": {"max_error": 0.01}, **TOVA_KEY_HEAD}
TARGET_FIXED = {"kv_budget": 0.284, **TOVA_KEY_HEAD}
# AdaKV with per-head memory against uniform snapkv at the same fidelity: with obcache_joint
# (query-aware, 1K prompts) adakv keeping 20 % is at least as close to the full cache as snapkv
# keeping 30 % (results/fidelity-adakv: KL 0.128 against 0.142).
ADAKV = {"kv_budget": 0.2, "kv_pipeline": "adakv", "kv_scorer": "obcache_joint"}
ADAKV_SNAP = {"kv_budget": 0.3, "kv_pipeline": "snapkv", "kv_scorer": "obcache_joint"}
WORKLOADS: dict[str, Workload] = {
    "decode-bound": Workload(32, 256, 256, {"kv_budget": 64, "kv_decode": True, **TOVA_KEY},
                             64, 520, note="decode eviction keeps 32 long generations small"),
    "prefill-bound": Workload(24, 1024, 64, {"kv_budget": 0.1, **TOVA_KEY}, 100, 830,
                              note="prompts compressed to 10 % at prefill end"),
    "long-4k-b1": Workload(1, 4000, 128, {"kv_budget": 0.1, "kv_decode": True, **TOVA_KEY},
                           None, 140, same_pool=True, note="long-context decode speed"),
    "long-4k-b8": Workload(8, 4000, 128, {"kv_budget": 0.1, "kv_decode": True, **TOVA_KEY},
                           None, 1050, same_pool=True, note="long-context decode speed"),
    "long-7k-b1": Workload(1, 7000, 128, {"kv_budget": 0.1, "kv_decode": True, **TOVA_KEY},
                           None, 230, same_pool=True, note="long-context decode speed"),
    "long-7k-b8": Workload(8, 7000, 128, {"kv_budget": 0.1, "kv_decode": True, **TOVA_KEY},
                           None, 1800, same_pool=True, note="long-context decode speed"),
    "long-7k-c4": Workload(4, 7000, 256, {"kv_budget": 0.1, "kv_decode": True, **TOVA_KEY},
                           None, 920, same_pool=True,
                           note="4 concurrent long requests, prefill and decode"),
    "long-7k-c4-pe": Workload(4, 7000, 256, {"kv_budget": 0.1, "kv_decode": True,
                                             "kv_prefill_evict": True, **TOVA_KEY},
                              None, 920, same_pool=True,
                              note="the same, evicting after every prefill chunk"),
    "mixed-target": Workload(24, 1024, 64, TARGET, 100, 830, mixed=True, compare_kv=TARGET_FIXED,
                             note="dense and redundant documents: an error target against the "
                             "fixed budget of the same fidelity"),
    "adakv": Workload(24, 1024, 64, ADAKV, 100, 830, compare_kv=ADAKV_SNAP,
                      note="adakv at 20 % against snapkv at 30 %, the same fidelity"),
    "adakv-same-kept": Workload(24, 1024, 64, {**ADAKV, "kv_budget": 0.3}, 100, 830,
                                compare_kv=ADAKV_SNAP,
                                note="adakv and snapkv both at 30 %: what the per-head reads cost"),
    # Gemma 3 270M (--model "$(obcache-vllm model path --model gemma-3-270m)"): a hybrid model,
    # budgets evict in its 3 global layers of 18; at 8K tokens those hold 260 blocks of a
    # request's ~350 (five sliding-window groups hold ~18 each). A pool where stock runs
    # about two such requests at once.
    "gemma3-8k": Workload(8, 8192, 128, {"kv_budget": 0.25, **TOVA_KEY}, None, 900,
                          same_pool=True, note="Gemma 3 270M, long prompts, the global layers "
                          "compressed (run with --model of gemma-3-270m)"),
    "gemma3-8k-pe": Workload(8, 8192, 128, {"kv_budget": 0.25, "kv_prefill_evict": True,
                                            **TOVA_KEY}, None, 900, same_pool=True,
                             note="the same, evicting after every prefill chunk: admitted by "
                             "a bounded peak"),
    "gemma3-8k-large": Workload(8, 8192, 128, {"kv_budget": 0.25, **TOVA_KEY}, None, 1400,
                                same_pool=True, note="the same with a larger pool: stock holds "
                                "a prefill beside a decode"),
    "equal-32": Workload(32, 256, 256, {"kv_budget": 64, "kv_decode": True, **TOVA_KEY},
                         None, 520, same_pool=True, note="overhead at an equal batch of 32"),
    "equal-64": Workload(64, 256, 256, {"kv_budget": 64, "kv_decode": True, **TOVA_KEY},
                         None, 1040, max_num_seqs=64, same_pool=True,
                         note="overhead at an equal batch of 64"),
}  # fmt: skip
QUICK = {
    "decode-bound": Workload(16, 256, 128, WORKLOADS["decode-bound"].kv, 32, 200),
    "prefill-bound": Workload(8, 1024, 16, WORKLOADS["prefill-bound"].kv, 40, 300),
}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def worker(args) -> dict:
    """Child: one configuration of one workload; per-step timeline and per-request latency."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # to read the scheduler each step
    w = Workload(**json.loads(args.workload_json))
    llm = common.engine(args.model, args.pool, w.prompt_tokens + w.max_tokens + 64,
                        max_num_seqs=w.max_num_seqs, max_num_batched_tokens=w.batched_tokens,
                        **w.engine)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    make = common.mixed_prompts if w.mixed else common.prompts
    prompts = make(llm.get_tokenizer(), w.requests + 1, w.prompt_tokens, seed=7)
    kv = None if args.stock else w.kv
    params = SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True,
                            extra_args=kv, output_kind=RequestOutputKind.DELTA)
    # Warm-up; LLM.generate sets output_kind=FINAL_ONLY on the params it is given: a copy.
    warm = params.clone()
    warm.max_tokens = 2
    llm.generate([{"prompt_token_ids": prompts[0]}], warm, use_tqdm=False)

    preemptions = [0]
    preempt = scheduler._preempt_request

    def counted(*a, **k):
        preemptions[0] += 1
        return preempt(*a, **k)

    scheduler._preempt_request = counted
    scheduled = {}
    schedule = scheduler.schedule

    def recorded(*a, **k):
        out = schedule(*a, **k)
        scheduled["tokens"] = out.total_num_scheduled_tokens
        scheduled["reqs"] = len(out.num_scheduled_tokens)
        return out

    scheduler.schedule = recorded
    totals = getattr(scheduler, "obcache_totals", None)
    start = time.perf_counter()
    for i in range(w.requests):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i + 1]}, params)
    first, done, n_out = {}, {}, {}
    timeline = []  # (t, kv usage, running, waiting, step s, eviction s, decode-only, new tokens)
    while engine.has_unfinished_requests():
        evict0 = totals.scoring_seconds if totals else 0.0
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        new_tokens = 0
        for o in outs:
            rid = o.request_id
            count = len(o.outputs[0].token_ids)  # new tokens of this step (DELTA outputs)
            new_tokens += count
            n_out[rid] = n_out.get(rid, 0) + count
            if count and rid not in first:
                first[rid] = t1 - start
            if o.finished:
                done[rid] = t1 - start
        decode_only = scheduled.get("tokens") == scheduled.get("reqs")
        timeline.append((round(t1 - start, 3), round(scheduler.kv_cache_manager.usage, 4),
                         len(scheduler.running), len(scheduler.waiting), t1 - t0,
                         (totals.scoring_seconds - evict0) if totals else 0.0,
                         decode_only, new_tokens))  # fmt: skip
    wall = max(done.values())
    # Memory per request: the prompt tokens each kept (its whole prompt when stock).
    records = [r for r in getattr(scheduler, "obcache_finished", ()) if r.req_id.startswith("r")]
    kept = [r.kept_prompt for r in records] or [w.prompt_tokens]
    ttft = [first[r] for r in done]
    tpot = [(done[r] - first[r]) / (n_out[r] - 1) for r in done if n_out[r] > 1]
    decode_steps = [s for s in timeline if s[6]]
    step_s = [s[4] for s in timeline]
    return {
        "requests_per_s": len(done) / wall,
        "kept_prompt_tokens_mean": statistics.fmean(kept),
        "output_tokens_per_s": sum(n_out.values()) / wall,
        "max_running": max(s[2] for s in timeline),
        "mean_running": statistics.fmean(s[2] for s in timeline),
        "preemptions": preemptions[0],
        "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
        "tpot_p50_s": _pct(tpot, 0.5), "tpot_p99_s": _pct(tpot, 0.99),
        "decode_tokens_per_s": (sum(s[7] for s in decode_steps)
                                / max(1e-9, sum(s[4] for s in decode_steps))),
        "decode_steps": len(decode_steps),
        # Where the time goes: steps that scheduled prompt tokens (prefill, possibly with
        # decodes beside them) and decode-only steps, each with the eviction work inside.
        "prefill_steps_s": sum(s[4] for s in timeline if not s[6]),
        "decode_steps_s": sum(s[4] for s in decode_steps),
        "prefill_eviction_s": sum(s[5] for s in timeline if not s[6]),
        "decode_eviction_s": sum(s[5] for s in decode_steps),
        "step_ms_mean": 1e3 * statistics.fmean(step_s),
        "step_ms_median": 1e3 * statistics.median(step_s),
        "eviction_ms_per_step": 1e3 * statistics.fmean(s[5] for s in timeline),
        "model_ms_per_step": 1e3 * statistics.fmean(s[4] - s[5] for s in timeline),
        "wall_s": wall,
        "timeline": [s[:4] for s in timeline],
    }  # fmt: skip


def run_workload(name: str, w: Workload, model: str, repeats: int) -> dict[str, dict]:
    """The configurations of one workload (medians over ``repeats`` runs of each)."""
    if w.same_pool:
        configs = [("stock", True, w.big_pool), ("obcache", False, w.big_pool)]
    else:
        configs = [("stock, small pool", True, w.small_pool),
                   ("stock, unlimited", True, w.big_pool),
                   ("obcache, small pool", False, w.small_pool)]  # fmt: skip
    configs = [(label, stock, pool, w) for label, stock, pool in configs]
    if w.compare_kv is not None:
        other = replace(w, kv=w.compare_kv, compare_kv=None)
        configs.append(("obcache (compared kv), small pool", False, w.small_pool, other))
    rows: dict[str, dict] = {}
    for label, stock, pool, config in configs:
        spec = json.dumps(asdict(config))
        runs = [common.run_child(__file__, "serving", stock,
                                 ["--model", model, "--workload-json", spec, "--pool", str(pool)])
                for _ in range(repeats)]  # fmt: skip
        rows[label] = _median_run(runs)
        rows[label]["pool_blocks"] = pool
        print(f"  {name}: {label} done ({rows[label]['wall_s']:.0f} s)", flush=True)
    return rows


def _median_run(runs: list[dict]) -> dict:
    """Each scalar is the median over the runs; the timeline is the median-throughput run's."""
    out = {}
    for key, value in runs[0].items():
        out[key] = (statistics.median(r[key] for r in runs)
                    if isinstance(value, (int, float)) else value)  # fmt: skip
    best = sorted(runs, key=lambda r: r["requests_per_s"])[len(runs) // 2]
    out["timeline"] = best["timeline"]
    out["runs"] = len(runs)
    return out


TABLE_HEAD = (
    "| config | req/s | out tok/s | max / mean running | preemptions | TTFT p50 / p99 s "
    "| TPOT p50 / p99 ms | decode tok/s | step ms (model + eviction) | kept prompt tokens |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
)


def table_row(label: str, r: dict, w: Workload) -> str:
    """One configuration's row of :data:`TABLE_HEAD`."""
    return (
        f"| {label} | {r['requests_per_s']:.3f} | {r['output_tokens_per_s']:.1f} "
        f"| {r['max_running']:.0f} / {r['mean_running']:.1f} | {r['preemptions']:.0f} "
        f"| {r['ttft_p50_s']:.1f} / {r['ttft_p99_s']:.1f} "
        f"| {1e3 * r['tpot_p50_s']:.0f} / {1e3 * r['tpot_p99_s']:.0f} "
        f"| {r['decode_tokens_per_s']:.1f} "
        f"| {r['step_ms_mean']:.0f} ({r['model_ms_per_step']:.0f} + "
        f"{r['eviction_ms_per_step']:.1f}) "
        f"| {r.get('kept_prompt_tokens_mean', w.prompt_tokens):.0f} |"
    )


def table(name: str, w: Workload, rows: dict[str, dict]) -> str:
    labels = [label for label in rows if "compared" not in label]
    plugin = rows[labels[-1]]
    same, unlimited = rows[labels[0]], rows[labels[1]] if len(labels) == 3 else None
    compared = next((r for label, r in rows.items() if "compared" in label), None)
    lines = [
        f"**{name}**: {w.requests} x ({w.prompt_tokens} prompt + {w.max_tokens} generated), "
        f"kv {json.dumps(w.kv)}; " + ", ".join(f"{k}: {r['pool_blocks']} blocks"
                                              for k, r in rows.items()) + f". {w.note}",
        "",
        *TABLE_HEAD,
    ]
    lines += [table_row(label, r, w) for label, r in rows.items()]
    ratios = [("vs stock, same pool", same)] + ([("vs stock, unlimited", unlimited)]
                                                if unlimited else [])  # fmt: skip
    lines.append("")
    for label, base in ratios:
        lines.append(
            f"- obcache {label}: req/s {plugin['requests_per_s'] / base['requests_per_s']:.2f}x, "
            f"out tok/s {plugin['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x, "
            f"decode tok/s {plugin['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x, "
            f"mean step {plugin['step_ms_mean'] / base['step_ms_mean']:.3f}x"
        )
    if compared is not None:
        lines.append(
            f"- compared kv {json.dumps(w.compare_kv)}: req/s "
            f"{compared['requests_per_s'] / same['requests_per_s']:.2f}x stock (same pool); "
            f"obcache / compared: req/s "
            f"{plugin['requests_per_s'] / compared['requests_per_s']:.2f}x, out tok/s "
            f"{plugin['output_tokens_per_s'] / compared['output_tokens_per_s']:.2f}x"
        )
    for label, r in rows.items():
        if "prefill_steps_s" in r:
            lines.append(
                f"- {label}, where the time goes: steps with prompt tokens "
                f"{r['prefill_steps_s']:.1f} s (eviction {r['prefill_eviction_s']:.1f} s), "
                f"decode-only steps {r['decode_steps_s']:.1f} s (eviction "
                f"{r['decode_eviction_s']:.1f} s), of {r['wall_s']:.1f} s"
            )
    return "\n".join(lines)


def plot(results: dict[str, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(11, 3.2 * len(results)), squeeze=False)
    for (name, rows), (ax_kv, ax_run) in zip(results.items(), axes, strict=True):
        for label, r in rows.items():
            t = [p[0] for p in r["timeline"]]
            ax_kv.plot(t, [100 * p[1] for p in r["timeline"]], label=label)
            ax_run.plot(t, [p[2] for p in r["timeline"]], label=label)
        ax_kv.set_ylabel(f"{name}\nKV pool used (%)")
        ax_run.set_ylabel("running requests")
        ax_kv.legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("seconds since all requests arrived")
    fig.suptitle("KV pool usage and concurrency over time (bench_serving.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = common.parser(__doc__, "serving")
    ap.add_argument("--workloads", nargs="+", default=["decode-bound", "prefill-bound"],
                    choices=sorted(WORKLOADS))
    ap.add_argument("--quick", action="store_true", help="small versions (make bench)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per configuration (median)")
    ap.add_argument("--out", default="results/bench")
    ap.add_argument("--workload-json", help=argparse.SUPPRESS)
    ap.add_argument("--pool", type=int, help=argparse.SUPPRESS)
    args = common.parse(ap, worker)
    if args is None:
        return
    chosen = QUICK if args.quick else {n: WORKLOADS[n] for n in args.workloads}
    results, text = {}, []
    core = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0")
    header = (f"bench_serving.py, {time.strftime('%Y-%m-%d')}, fp32, block 32, one core "
              f"(VLLM_CPU_OMP_THREADS_BIND={core}), {os.cpu_count()} CPUs, "
              f"repeats {args.repeats}")
    print(header)
    for name, w in chosen.items():
        results[name] = run_workload(name, w, args.model, args.repeats)
        text.append(table(name, w, results[name]))
        print(text[-1] + "\n", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "serving_quick" if args.quick else "serving"
    (out / f"{stem}.json").write_text(json.dumps(
        {"header": header, "workloads": {n: asdict(w) for n, w in chosen.items()},
         "results": results}, indent=1))  # fmt: skip
    (out / f"{stem}.md").write_text(header + "\n\n" + "\n\n".join(text) + "\n")
    plot(results, out / f"{stem}_kv_usage.png")
    print(f"wrote {out / stem}.json, .md and _kv_usage.png")


if __name__ == "__main__":
    main()
