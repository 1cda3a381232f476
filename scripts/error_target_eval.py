#!/usr/bin/env python
"""Budgets by error target, measured: is the estimate calibrated, and is a target worth it?

One in-process engine, the fidelity measure of ``obcache-vllm eval fidelity`` (every generated
position's next-token distribution against the full cache's, on the same forced continuation),
on a mix of dense and redundant documents (``--kinds``: the KJV, Python's stdlib source,
seeded needle haystacks, and one KJV passage repeated).

1. **Targets and a fixed grid.** For each scorer: ``kv_budget: {"max_error": e}`` for every
   ``--targets`` e, and fixed fractional budgets (``--grid``), all query-aware on ``--pipeline``.
2. **Matched fixed budgets.** For each target, a fixed budget at the target's mean kept
   fraction over all prompts: the same memory, spent evenly instead of where the estimate says.

Reported (``OUT/error_target.{json,md,png}``):

* **calibration**: per request, the server's ``usage.obcache.estimated_error`` against the
  measured mean KL to the full cache (Spearman's rank correlation per scorer; a scatter plot);
* **the choice moves with the document**: the mean kept fraction per kind of document;
* **same memory**: each target against its matched fixed budget, the paired difference of
  mean KL and of top-1 agreement (95 % paired bootstrap over prompts);
* **same fidelity**: the kept fraction a fixed budget needs for the target's mean KL
  (interpolated on the grid), and the ratio of the two (memory a target saves).

    make error-target     # .venv/bin/python scripts/error_target_eval.py --out results/error-target
    .venv/bin/python scripts/error_target_eval.py \
        --report-only results/error-target/error_target.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from obcache_vllm.evidence import fidelity as F  # noqa: E402
from obcache_vllm.evidence.eval.command import csv_list as _csv  # noqa: E402
from obcache_vllm.evidence.eval.command import parse_script_args  # noqa: E402
from obcache_vllm.evidence.rank import spearman  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", type=_csv(str), default=["bible", "code", "needle", "repeated"])
    ap.add_argument("--samples", type=int, default=8, help="prompts per kind")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=32, help="forced tokens per prompt")
    ap.add_argument("--pipeline", default="tova")
    ap.add_argument("--scorers", type=_csv(str), default=["obcache_key", "attn"])
    ap.add_argument("--targets", type=_csv(float), default=[0.001, 0.003, 0.01, 0.03, 0.1, 0.3])
    ap.add_argument("--grid", type=_csv(float), default=[0.05, 0.1, 0.15, 0.2, 0.3, 0.45, 0.6])
    ap.add_argument("--max-batch", type=int, default=16)
    return parse_script_args(ap, ROOT / "results" / "error-target", argv)


def _target_arm(pipeline: str, scorer: str, e: float) -> F.Arm:
    return F.Arm(f"{pipeline}+{scorer}@e{e:g}", pipeline, scorer, None, "aware", max_error=e)


def _fixed_arm(pipeline: str, scorer: str, b: float, tag: str = "") -> F.Arm:
    return F.Arm(f"{pipeline}+{scorer}@{b:g}{tag}", pipeline, scorer, b, "aware")


def _engine(args, max_len: int):
    from vllm import LLM

    return LLM(model=args.model, dtype="float32", enforce_eager=True, block_size=32, seed=0,
               max_model_len=max_len, max_num_seqs=args.max_batch, max_num_batched_tokens=1024,
               logits_processors=[F.FIDELITY_FQCN], logprobs_mode="raw_logprobs")  # fmt: skip


def measure(args) -> dict:
    from obcache_vllm.evidence.perplexity import in_process_engine

    args.model = in_process_engine(args.model)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    samples = F.make_samples(tok, args.kinds, args.samples, args.prompt_tokens, 32, args.seed)
    start = time.time()
    llm = _engine(args, args.prompt_tokens + args.tokens + 64)
    first = [F.Arm("full")]
    for scorer in args.scorers:
        first += [_target_arm(args.pipeline, scorer, e) for e in args.targets]
        first += [_fixed_arm(args.pipeline, scorer, b) for b in args.grid]
    print(f"error-target: {len(samples)} prompts x {len(first)} arms", file=sys.stderr)
    per_request = F.run(llm, samples, first, args.tokens, progress=True)
    matched = []
    for scorer in args.scorers:
        for e in args.targets:
            kept = [r["kept_fraction"] for r in
                    per_request[_target_arm(args.pipeline, scorer, e).name].values()]
            b = round(sum(kept) / len(kept), 3)  # fmt: skip
            matched.append((scorer, e, _fixed_arm(args.pipeline, scorer, b, f"~e{e:g}")))
    print(f"error-target: matched fixed budgets, {len(matched)} arms", file=sys.stderr)
    second = F.run(llm, samples, [F.Arm("full")] + [m[2] for m in matched], args.tokens,
                   progress=True)  # fmt: skip
    per_request.update({k: v for k, v in second.items() if k != "full"})
    return {
        "command": "scripts/error_target_eval.py " + " ".join(args.argv),
        "model_name": Path(args.model).name,
        "date": time.strftime("%Y-%m-%d"),
        "machine": "2-core x86_64 CPU, 24 GiB (vLLM CPU backend, fp32)",
        "seconds": round(time.time() - start, 1),
        "pipeline": args.pipeline,
        "scorers": args.scorers,
        "targets": args.targets,
        "grid": args.grid,
        "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens,
        "samples": [{"name": s.name, "kind": s.kind, "tokens": len(s.ids)} for s in samples],
        "matched": {f"{s}@{e:g}": a.name for s, e, a in matched},
        "per_request": {arm: {name: {k: v for k, v in stats.items() if k != "logprobs"}
                              for name, stats in rows.items()}
                        for arm, rows in per_request.items()},  # fmt: skip
    }


# ---------------------------------------------------------------------------------------------
# Analysis (pure: --report-only)


def _interp(xs: list[float], ys: list[float], y: float) -> float | None:
    """The x where the piecewise-linear curve (xs ascending, ys falling) reaches ``y``."""
    pts = sorted(zip(xs, ys, strict=True))
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if (y0 - y) * (y1 - y) <= 0 and y0 != y1:
            return x0 + (x1 - x0) * (y0 - y) / (y0 - y1)
    return None


def analyse(res: dict) -> dict:
    names = [s["name"] for s in res["samples"]]
    kinds = {s["name"]: s["kind"] for s in res["samples"]}
    draws = F.bootstrap_draws(len(names))
    pr = res["per_request"]
    pipe = res["pipeline"]
    out = {"scorers": {}}
    for scorer in res["scorers"]:
        calib_x, calib_y, within = [], [], []
        targets = []
        grid_kept = [sum(pr[f"{pipe}+{scorer}@{b:g}"][n]["kept_fraction"] for n in names)
                     / len(names) for b in res["grid"]]  # fmt: skip
        grid_kl = [sum(pr[f"{pipe}+{scorer}@{b:g}"][n]["kl"] for n in names) / len(names)
                   for b in res["grid"]]  # fmt: skip
        for e in res["targets"]:
            rows = pr[f"{pipe}+{scorer}@e{e:g}"]
            fixed = pr[res["matched"][f"{scorer}@{e:g}"]]
            est = [rows[n]["usage"].get("estimated_error", 0.0) for n in names]
            kl = [rows[n]["kl"] for n in names]
            calib_x += est
            calib_y += kl
            within.append(spearman(est, kl))
            kept = [rows[n]["kept_fraction"] for n in names]
            by_kind = {}
            for n in names:
                by_kind.setdefault(kinds[n], []).append(rows[n]["kept_fraction"])
            d_kl = [rows[n]["kl"] - fixed[n]["kl"] for n in names]
            d_agree = [rows[n]["agree"] - fixed[n]["agree"] for n in names]
            mean_kept, mean_kl = sum(kept) / len(kept), sum(kl) / len(kl)
            need = _interp(grid_kept, grid_kl, mean_kl)
            targets.append({
                "max_error": e,
                "kept": mean_kept,
                "kept_range": (min(kept), max(kept)),
                "kept_by_kind": {k: sum(v) / len(v) for k, v in by_kind.items()},
                "estimate_max": max(est),
                "kl": F.interval(kl, draws),
                "agree": F.interval([rows[n]["agree"] for n in names], draws),
                "matched_budget": res["matched"][f"{scorer}@{e:g}"],
                "matched_kl": F.interval([fixed[n]["kl"] for n in names], draws),
                "matched_agree": F.interval([fixed[n]["agree"] for n in names], draws),
                "d_kl": F.interval(d_kl, draws),
                "d_agree": F.interval(d_agree, draws),
                "fixed_kept_for_same_kl": need,
                "memory_ratio": None if need is None else need / mean_kept,
            })  # fmt: skip
        out["scorers"][scorer] = {
            "spearman": spearman(calib_x, calib_y),
            # Within one target the estimates sit just under it: does their order still say
            # which requests lose the most?
            "spearman_within": sum(within) / len(within),
            "calibration": list(zip(calib_x, calib_y, strict=True)),
            "grid": [{"budget": b, "kept": k, "kl": v}
                     for b, k, v in zip(res["grid"], grid_kept, grid_kl, strict=True)],
            "targets": targets,
        }  # fmt: skip
    return out


def _ci(t, digits=4) -> str:
    mean, lo, hi = t
    return f"{mean:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def render(res: dict, an: dict) -> str:
    kinds = sorted({s["kind"] for s in res["samples"]})
    n = len(res["samples"])
    lines = [
        "# Budgets by error target: calibration and worth",
        "",
        f"Command: `{res['command']}` ({res['date']}, {res['machine']}, {res['model_name']}, "
        f"{res['seconds'] / 60:.0f} min). {n} prompts of {res['prompt_tokens']} tokens "
        f"({', '.join(kinds)}), {res['tokens']} forced tokens each; pipeline "
        f"`{res['pipeline']}`, query-aware. KL: mean over positions of KL(full || arm), nats; "
        "intervals: 95 % paired bootstrap over prompts.",
        "",
    ]
    for scorer, a in an["scorers"].items():
        lines += [
            f"## `{scorer}`",
            "",
            f"Calibration: Spearman's rank correlation of the estimate with the measured KL, "
            f"over {len(a['calibration'])} (request, target) pairs: **{a['spearman']:.2f}**; "
            f"among the requests of one target (mean over targets): "
            f"**{a['spearman_within']:.2f}**.",
            "",
            "| max_error | kept (mean, range over prompts) | kept by kind | KL | top-1 agree "
            "| matched fixed | its KL | "
            "ΔKL (target − fixed) | Δagree | fixed kept for the same KL | memory ratio |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for t in a["targets"]:
            by_kind = ", ".join(f"{k} {v:.2f}" for k, v in sorted(t["kept_by_kind"].items()))
            need = "beyond the grid" if t["fixed_kept_for_same_kl"] is None else (
                f"{t['fixed_kept_for_same_kl']:.3f}")  # fmt: skip
            ratio = "-" if t["memory_ratio"] is None else f"{t['memory_ratio']:.2f}x"
            lines.append(
                f"| {t['max_error']:g} | {t['kept']:.3f} ({t['kept_range'][0]:.2f}-"
                f"{t['kept_range'][1]:.2f}) | {by_kind} | {_ci(t['kl'])} | "
                f"{_ci(t['agree'], 3)} | `{t['matched_budget'].split('@')[1]}` | "
                f"{_ci(t['matched_kl'])} | {_ci(t['d_kl'])} | {_ci(t['d_agree'], 3)} | "
                f"{need} | {ratio} |"
            )
        lines += ["", "Fixed grid: " + ", ".join(
            f"{g['budget']:g} → kept {g['kept']:.3f}, KL {g['kl']:.4f}" for g in a["grid"]), ""]
    return "\n".join(lines) + "\n"


def plot(res: dict, an: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    for color, (scorer, a) in zip(colors, an["scorers"].items(), strict=False):
        xs = [max(x, 1e-6) for x, _ in a["calibration"]]
        ys = [max(y, 1e-6) for _, y in a["calibration"]]
        left.scatter(xs, ys, s=10, alpha=0.5, color=color,
                     label=f"{scorer} (Spearman {a['spearman']:.2f})")  # fmt: skip
        right.plot([g["kept"] for g in a["grid"]], [g["kl"] for g in a["grid"]], "-o",
                   color=color, ms=3, label=f"{scorer}, fixed budgets")  # fmt: skip
        right.plot([t["kept"] for t in a["targets"]], [t["kl"][0] for t in a["targets"]], "*",
                   color=color, ms=11, label=f"{scorer}, error targets")  # fmt: skip
    left.set(xscale="log", yscale="log", xlabel="estimated error (usage.obcache)",
             ylabel="measured mean KL to the full cache (nats)",
             title="Calibration: one point per request and target")  # fmt: skip
    right.set(yscale="log", xlabel="mean kept fraction of the prompt",
              ylabel="mean KL to the full cache (nats)", title="Memory against fidelity")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report_only is not None:
        res = json.loads(args.report_only.read_text())
    else:
        res = measure(args)
    args.out.mkdir(parents=True, exist_ok=True)
    an = analyse(res)
    (args.out / "error_target.json").write_text(json.dumps({**res, "analysis": an}, indent=1)
                                                + "\n")  # fmt: skip
    (args.out / "error_target.md").write_text(render(res, an))
    for path in (args.out / "error_target.json", args.out / "error_target.md",
                 plot(res, an, args.out / "error_target.png")):  # fmt: skip
        if path is not None:
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
