#!/usr/bin/env python
"""Does an OBCache score beat attention on the quantity it estimates? The layer-local error.

OBCache's scores estimate how much evicting each token changes the attention outputs of the
queries they were computed from. This measures that change itself, per layer, for the tokens
each scorer's selection keeps at a fixed budget: the relative squared change of the window
queries' attention outputs when the rest is evicted, the softmax renormalised over the kept
tokens (``obcache_vllm.scoring.estimate.window_error_curve``, exact for the layer's window),
averaged over KV heads and layers. No generation: one prefill per prompt in the HF reference.

Reported per pipeline, budget and scorer: the mean error over prompts and each scorer's paired
difference to ``attn`` (95 % paired bootstrap over prompts). End-to-end fidelity of the same
selections is in results/fidelity.

    make local-error      # .venv/bin/python scripts/local_error_eval.py --out results/local-error
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from obcache_vllm.evidence import fidelity as F  # noqa: E402
from obcache_vllm.evidence.eval.command import csv_list as _csv  # noqa: E402
from obcache_vllm.evidence.eval.command import parse_script_args  # noqa: E402

SCORERS = F.SCORERS


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", type=_csv(str), default=["bible", "code", "needle"])
    ap.add_argument("--samples", type=int, default=6, help="prompts per kind")
    ap.add_argument("--prompt-tokens", type=_csv(int), default=[1024, 2048])
    ap.add_argument("--pipelines", type=_csv(str), default=["snapkv", "tova"])
    ap.add_argument("--scorers", type=_csv(str), default=list(SCORERS))
    ap.add_argument("--budgets", type=_csv(float), default=[0.1, 0.2, 0.3, 0.4])
    ap.add_argument("--window", type=int, default=32, help="snapkv's window")
    return parse_script_args(ap, ROOT / "results" / "local-error", argv)


def measure(args) -> dict:
    import torch

    from obcache_vllm.admission import parse_kv_options
    from obcache_vllm.evidence import hf_reference as ref
    from obcache_vllm.model import default_model_path
    from obcache_vllm.scoring import estimate

    args.model = str(args.model or default_model_path())
    model, tok = ref.load_model(args.model)
    start = time.time()
    rows: dict[str, dict[str, float]] = {}
    names = []
    for length in args.prompt_tokens:
        samples = F.make_samples(tok, args.kinds, args.samples, length, 32, args.seed)
        for s in samples:
            name = f"{s.name}@{length}"
            names.append(name)
            ids = torch.tensor(s.ids)
            state = ref.prefill(model, ids, query_window=args.window)
            n = state.length
            for pipeline in args.pipelines:
                for scorer in args.scorers:
                    kv = {"kv_budget": 0.5, "kv_pipeline": pipeline, "kv_scorer": scorer}
                    if pipeline == "snapkv":
                        kv["kv_window"] = args.window
                    opts = parse_kv_options(kv, n)
                    sc, pipe = opts.build_scoring()
                    w = max(1, opts.query_window)
                    kept = torch.tensor([max(opts.recent + opts.sinks + 1, math.ceil(b * n))
                                         for b in args.budgets])  # fmt: skip
                    total = torch.zeros(len(args.budgets), dtype=torch.float64)
                    for q, k, v in zip(state.queries, state.keys, state.values, strict=True):
                        q = q[-w:]
                        q_pos, k_pos = torch.arange(n - w, n), torch.arange(n)
                        ranking = pipe.prefill_scores(sc, q, k, v, state.geometry, q_pos, k_pos)
                        total += estimate.window_error_curve(
                            q, k, v, state.geometry, ranking, kept, q_pos=q_pos, k_pos=k_pos,
                            recent=opts.recent, sinks=opts.sinks, per_head=opts.per_head)
                    for b, err in zip(args.budgets, (total / len(state.keys)).tolist(),
                                      strict=True):  # fmt: skip
                        rows.setdefault(f"{pipeline}+{scorer}@{b:g}", {})[name] = err
            print(f"local-error: {len(names)} prompts, {time.time() - start:.0f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
    return {
        "command": "scripts/local_error_eval.py " + " ".join(args.argv),
        "model_name": Path(args.model).name,
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(time.time() - start, 1),
        "samples": names,
        "prompt_tokens": args.prompt_tokens, "pipelines": args.pipelines,
        "scorers": args.scorers, "budgets": args.budgets, "window": args.window,
        "per_request": rows,
    }  # fmt: skip


def analyse(res: dict) -> list[dict]:
    cells = []
    pr = res["per_request"]
    for length in res["prompt_tokens"]:
        names = [n for n in res["samples"] if n.endswith(f"@{length}")]
        draws = F.bootstrap_draws(len(names))
        for pipeline in res["pipelines"]:
            for b in res["budgets"]:
                base = pr[f"{pipeline}+attn@{b:g}"]
                for scorer in res["scorers"]:
                    got = pr[f"{pipeline}+{scorer}@{b:g}"]
                    cells.append({
                        "tokens": length, "pipeline": pipeline, "budget": b, "scorer": scorer,
                        "error": F.interval([got[n] for n in names], draws),
                        "vs_attn": F.interval([got[n] - base[n] for n in names], draws),
                    })  # fmt: skip
    return cells


def render(res: dict, cells: list[dict]) -> str:
    lines = [
        "# The layer-local error each scorer's selection leaves",
        "",
        f"Command: `{res['command']}` ({res['date']}, {res['model_name']}, "
        f"{res['seconds'] / 60:.0f} min). Prompts: {len(res['samples'])} (KJV, stdlib code, "
        f"needles; {', '.join(map(str, res['prompt_tokens']))} tokens). Error: the relative "
        "squared change of the window queries' attention outputs when what the selection "
        "leaves out is evicted (softmax renormalised), mean over KV heads and layers; "
        f"snapkv window {res['window']}, tova's last query; per head, 16 recent + 4 sinks. "
        "Δ: the scorer − attn on the same prompts, 95 % paired bootstrap.",
        "",
        "| tokens | pipeline | budget | scorer | error | Δ vs attn |",
        "|---|---|---|---|---|---|",
    ]
    for c in cells:
        err = "{:.4f} [{:.4f}, {:.4f}]".format(*c["error"])
        vs = "-" if c["scorer"] == "attn" else "{:+.4f} [{:+.4f}, {:+.4f}]".format(*c["vs_attn"])
        lines.append(f"| {c['tokens']} | {c['pipeline']} | {c['budget']:g} | `{c['scorer']}` "
                     f"| {err} | {vs} |")  # fmt: skip
    scored = [c for c in cells if c["scorer"].startswith("obcache")]
    lower = sum(1 for c in scored if c["vs_attn"][2] < 0)
    higher = sum(1 for c in scored if c["vs_attn"][1] > 0)
    lines += ["", f"An OBCache score leaves a lower error than attn in {lower} of {len(scored)} "
              f"cells (interval of Δ below 0), a higher one in {higher}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    res = json.loads(args.report_only.read_text()) if args.report_only else measure(args)
    cells = analyse(res)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "local_error.json").write_text(json.dumps({**res, "cells": cells}, indent=1)
                                               + "\n")  # fmt: skip
    (args.out / "local_error.md").write_text(render(res, cells))
    print(args.out / "local_error.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
