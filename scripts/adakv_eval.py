#!/usr/bin/env python
"""AdaKV against uniform per-head SnapKV, with each scorer, measured in the HF reference.

Per-head budgets cannot be served yet (see docs/contributing/per_head_memory.md), so they are
measured where per-head masking is exact: the HF reference with a full prompt cache and the
evicted (head, token) pairs masked in every later attention
(:mod:`obcache_vllm.evidence.head_budgets`). For each prompt, scorer, budget and setting, the
uniform selection (``keep`` per KV head) and AdaKV's (``keep * Hkv`` per layer, kvpress's
``AdaKVPress`` rule with ``alpha_safeguard`` 0.2) run over the same scores, so they hold the
same number of entries; each is teacher-forced on the full cache's greedy continuation and
compared with it at every position (the fidelity measure: KL to the full cache, top-1
agreement; 95 % paired bootstrap over prompts).

* query-aware: the whole prompt is scored (its last ``--window`` queries) and compressed;
* query-agnostic: the prompt is compressed ``--question-tokens`` before its end (the needle's
  question; the last tokens of prose or code) and the rest is computed on the masked cache.

    make adakv            # .venv/bin/python scripts/adakv_eval.py --out results/adakv
    .venv/bin/python scripts/adakv_eval.py --report-only results/adakv/adakv.json
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
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32, help="forced tokens per prompt")
    ap.add_argument("--scorers", type=_csv(str), default=list(SCORERS))
    ap.add_argument("--budgets", type=_csv(float), default=[0.1, 0.2, 0.3, 0.4])
    ap.add_argument("--settings", type=_csv(str), default=["aware", "agnostic"])
    ap.add_argument("--window", type=int, default=32, help="snapkv's window (as eval fidelity)")
    ap.add_argument("--alpha", type=float, default=0.2, help="AdaKV's per-head safeguard")
    ap.add_argument("--layout", action="store_true",
                    help="instead: the blocks AdaKV's per-head counts need under each block "
                    "layout, relative to uniform (OUT/layout.{json,md})")
    return parse_script_args(ap, ROOT / "results" / "adakv", argv)


def measure(args) -> dict:
    import torch

    from obcache_vllm.admission import parse_kv_options
    from obcache_vllm.evidence import head_budgets as hb
    from obcache_vllm.evidence import hf_reference as ref
    from obcache_vllm.model import default_model_path

    args.model = str(args.model or default_model_path())
    model, tok = ref.load_model(args.model)
    samples = F.make_samples(tok, args.kinds, args.samples, args.prompt_tokens,
                             args.question_tokens, args.seed)  # fmt: skip
    start = time.time()
    rows: dict[str, dict[str, dict]] = {}
    for i, s in enumerate(samples):
        ids = torch.tensor(s.ids)
        full_state = ref.prefill(model, ids, query_window=args.window)
        tokens, _ = ref.generate(model, full_state, None, max_new_tokens=args.tokens)
        for setting in args.settings:
            point = len(ids) if setting == "aware" else s.point
            state = full_state if setting == "aware" else ref.prefill(
                model, ids[:point], query_window=args.window)  # fmt: skip
            rest = None if setting == "aware" else ids[point:]
            reference = hb.forced_logits(model, state, None, tokens, rest)
            for scorer in args.scorers:
                opts = parse_kv_options({"kv_budget": 0.5, "kv_pipeline": "snapkv",
                                         "kv_window": args.window, "kv_scorer": scorer,
                                         "kv_recent": 16, "kv_sinks": 4}, point)  # fmt: skip
                scores = hb.layer_scores(state, opts)
                for budget in args.budgets:
                    keep = max(opts.recent + opts.sinks + 1, math.ceil(budget * point))
                    for alloc in ("uniform", "adakv"):
                        kept = hb.masks(state, opts, keep, adaptive=alloc == "adakv",
                                        alpha=args.alpha, scores=scores)  # fmt: skip
                        stats = hb.compare(reference, hb.forced_logits(model, state, kept,
                                                                       tokens, rest))  # fmt: skip
                        name = f"{alloc}+{scorer}@{budget:g}/{setting}"
                        rows.setdefault(name, {})[s.name] = stats
        print(f"adakv: {i + 1}/{len(samples)} prompts, {time.time() - start:.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    return {
        "command": "scripts/adakv_eval.py " + " ".join(args.argv),
        "model_name": Path(args.model).name,
        "date": time.strftime("%Y-%m-%d"),
        "machine": "2-core x86_64 CPU, 24 GiB (HF transformers, fp32)",
        "seconds": round(time.time() - start, 1),
        "samples": [{"name": s.name, "kind": s.kind, "tokens": len(s.ids), "point": s.point}
                    for s in samples],  # fmt: skip
        "scorers": args.scorers, "budgets": args.budgets, "settings": args.settings,
        "window": args.window, "alpha": args.alpha, "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens, "question_tokens": args.question_tokens,
        "per_request": rows,
    }  # fmt: skip


LAYOUTS = {
    "exact": "a block table per layer and KV head: sum of ceil(n / bs)",
    "slots": "block ids shared by the layers, each layer's heads mapped to head slots by count",
    "fixed": "block ids shared by the layers, one table per KV head",
    "shared": "one table for every head and layer (today's paged cache): Hkv x the largest",
}


def layout(args) -> dict:
    """The 32-token blocks AdaKV's per-head counts need under each of :data:`LAYOUTS`, per
    (scorer, budget), relative to the uniform selection's, mean over prompts."""
    import torch

    from obcache_vllm.admission import parse_kv_options
    from obcache_vllm.evidence import head_budgets as hb
    from obcache_vllm.evidence import hf_reference as ref
    from obcache_vllm.model import default_model_path

    bs = 32
    args.model = str(args.model or default_model_path())
    model, tok = ref.load_model(args.model)
    samples = F.make_samples(tok, args.kinds, args.samples, args.prompt_tokens,
                             args.question_tokens, args.seed)  # fmt: skip
    ratios: dict[str, dict[str, list[float]]] = {}
    for s in samples:
        ids = torch.tensor(s.ids)
        state = ref.prefill(model, ids, query_window=args.window)
        for scorer in args.scorers:
            opts = parse_kv_options({"kv_budget": 0.5, "kv_pipeline": "snapkv",
                                     "kv_window": args.window, "kv_scorer": scorer,
                                     "kv_recent": 16, "kv_sinks": 4}, len(ids))  # fmt: skip
            scores = hb.layer_scores(state, opts)
            for budget in args.budgets:
                keep = math.ceil(budget * len(ids))
                kept = hb.masks(state, opts, keep, adaptive=True, alpha=args.alpha,
                                scores=scores)  # fmt: skip
                counts = torch.stack([m.sum(1) for m in kept.values()])  # [layers, Hkv]
                blocks = (counts + bs - 1) // bs
                layers, heads = counts.shape
                uniform = layers * heads * -(-keep // bs)
                need = {
                    "exact": int(blocks.sum()),
                    "slots": layers * int(blocks.sort(1, descending=True).values.max(0)
                                          .values.sum()),  # fmt: skip
                    "fixed": layers * int(blocks.max(0).values.sum()),
                    "shared": layers * heads * int(blocks.max()),
                }
                row = ratios.setdefault(f"{scorer}@{budget:g}", {k: [] for k in LAYOUTS})
                for name, value in need.items():
                    row[name].append(value / uniform)
    return {
        "command": "scripts/adakv_eval.py " + " ".join(args.argv),
        "date": time.strftime("%Y-%m-%d"),
        "model_name": Path(args.model).name,
        "prompts": len(samples),
        "layouts": LAYOUTS,
        "ratios": {key: {k: sum(v) / len(v) for k, v in row.items()}
                   for key, row in ratios.items()},  # fmt: skip
    }


def render_layout(res: dict) -> str:
    lines = [
        "# Blocks for AdaKV's per-head counts, by block layout (relative to uniform)",
        "",
        f"Command: `{res['command']}` ({res['date']}, {res['model_name']}, {res['prompts']} "
        "prompts). 32-token blocks; 1.00 = the blocks of the uniform selection of the same "
        "total (AdaKV keeps as many entries per layer).",
        "",
        *(f"- `{name}`: {text}" for name, text in res["layouts"].items()),
        "",
        "| scorer @ budget | " + " | ".join(res["layouts"]) + " |",
        "|---" * (len(res["layouts"]) + 1) + "|",
    ]
    for key, row in res["ratios"].items():
        lines.append(f"| {key} | " + " | ".join(f"{row[k]:.2f}x" for k in res["layouts"])
                     + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _ci(t, digits=3, signed=False) -> str:
    mean, lo, hi = t
    f = f"{{:{'+' if signed else ''}.{digits}f}}"
    return f"{f.format(mean)} [{f.format(lo)}, {f.format(hi)}]"


def analyse(res: dict) -> dict:
    names = [s["name"] for s in res["samples"]]
    draws = F.bootstrap_draws(len(names))
    pr = res["per_request"]
    cells = []
    for setting in res["settings"]:
        for budget in res["budgets"]:
            for scorer in res["scorers"]:
                u = pr[f"uniform+{scorer}@{budget:g}/{setting}"]
                a = pr[f"adakv+{scorer}@{budget:g}/{setting}"]
                att = pr[f"adakv+attn@{budget:g}/{setting}"]
                cell = {"setting": setting, "budget": budget, "scorer": scorer}
                for key in ("kl", "agree"):
                    cell[f"uniform_{key}"] = F.interval([u[n][key] for n in names], draws)
                    cell[f"adakv_{key}"] = F.interval([a[n][key] for n in names], draws)
                    cell[f"d_{key}"] = F.interval([a[n][key] - u[n][key] for n in names], draws)
                    cell[f"vs_attn_{key}"] = F.interval([a[n][key] - att[n][key] for n in names],
                                                        draws)  # fmt: skip
                cells.append(cell)
    return {"cells": cells}


def render(res: dict, an: dict) -> str:
    kinds = sorted({s["kind"] for s in res["samples"]})
    lines = [
        "# AdaKV against uniform per-head SnapKV (HF reference, masked per head)",
        "",
        f"Command: `{res['command']}` ({res['date']}, {res['machine']}, {res['model_name']}, "
        f"{res['seconds'] / 60:.0f} min). {len(res['samples'])} prompts of "
        f"{res['prompt_tokens']} tokens ({', '.join(kinds)}), {res['tokens']} forced tokens; "
        f"snapkv window {res['window']}, 16 recent + 4 sinks, AdaKV safeguard "
        f"{res['alpha']:g}. KL: mean over positions of KL(full || arm), nats; agree: top-1 "
        "agreement; Δ: AdaKV − uniform on the same prompts, and AdaKV with the scorer − AdaKV "
        "with attn; 95 % paired bootstrap intervals over prompts.",
        "",
        "| setting | budget | scorer | uniform KL | AdaKV KL | Δ KL (AdaKV − uniform) | "
        "uniform agree | AdaKV agree | Δ agree | Δ KL vs AdaKV + attn |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in an["cells"]:
        vs = "-" if c["scorer"] == "attn" else _ci(c["vs_attn_kl"], signed=True)
        lines.append(
            f"| {c['setting']} | {c['budget']:g} | `{c['scorer']}` | {_ci(c['uniform_kl'])} | "
            f"{_ci(c['adakv_kl'])} | {_ci(c['d_kl'], signed=True)} | "
            f"{_ci(c['uniform_agree'])} | {_ci(c['adakv_agree'])} | "
            f"{_ci(c['d_agree'], signed=True)} | {vs} |"
        )
    better = sum(1 for c in an["cells"] if c["d_kl"][2] < 0)
    worse = sum(1 for c in an["cells"] if c["d_kl"][1] > 0)
    gains = [c for c in an["cells"] if c["scorer"] != "attn"]
    ob_better = sum(1 for c in gains if c["vs_attn_kl"][2] < 0)
    ob_worse = sum(1 for c in gains if c["vs_attn_kl"][1] > 0)
    lines += [
        "",
        f"AdaKV closer to the full cache than uniform (interval of Δ KL below 0) in {better} of "
        f"{len(an['cells'])} cells, further in {worse}. Under AdaKV, a scorer other than attn "
        f"closer than attn in {ob_better} of {len(gains)} cells, further in {ob_worse}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.layout:
        res = layout(args)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "layout.json").write_text(json.dumps(res, indent=1) + "\n")
        (args.out / "layout.md").write_text(render_layout(res))
        print(args.out / "layout.md")
        return 0
    res = json.loads(args.report_only.read_text()) if args.report_only else measure(args)
    an = analyse(res)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adakv.json").write_text(json.dumps({**res, "analysis": an}, indent=1) + "\n")
    (args.out / "adakv.md").write_text(render(res, an))
    print(args.out / "adakv.json")
    print(args.out / "adakv.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
