"""Results file -> ``results.json``, ``RESULTS.md`` (tables with 95 % CIs) and PNG plots.

Confidence intervals: Wilson score intervals when every sample scored 0 or 1 (single-answer
tasks), else a percentile bootstrap of the mean (fractional scores of multi-answer tasks;
2,000 resamples, fixed seed, so the report is deterministic).
"""

from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from obcache_vllm.evidence.eval.cells import FULL, Cell, load_results
from obcache_vllm.evidence.eval.grid import SCORERS

Z95 = 1.959963984540054


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95 % by default)."""
    if n <= 0:
        raise ValueError("n must be positive")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap(scores: Sequence[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of the mean of ``scores``."""
    rng = random.Random(seed)
    n = len(scores)
    means = sorted(sum(rng.choices(scores, k=n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[min(resamples - 1, int(0.975 * resamples))]


def interval(scores: Sequence[float]) -> tuple[float, float]:
    """Wilson for 0/1 scores, bootstrap otherwise."""
    if all(s in (0.0, 1.0) for s in scores):
        return wilson(sum(scores), len(scores))
    return bootstrap(scores)


def summarize(records: Sequence[dict]) -> list[dict]:
    """One row per cell: its fields, accuracy, CI, token counts; sorted for stable output."""
    rows = []
    for r in records:
        parsed = Cell(**r["cell"])  # fields added later (per_head) get their defaults
        cell = asdict(parsed)
        lo, hi = interval(r["scores"])
        rows.append({
            **cell,
            "method": parsed.method,
            "n": len(r["scores"]),
            "accuracy": r["accuracy"],
            "ci95": [round(lo, 4), round(hi, 4)],
            "document_tokens_mean": r["document_tokens_mean"],
            "kept_tokens_mean": r["kept_tokens_mean"],
            "scores": r["scores"],
        })  # fmt: skip
    key = ("engine", "task", "length", "setting", "method", "budget")
    return sorted(rows, key=lambda row: tuple(str(row[k]) for k in key))


def largest_samples(rows: Sequence[dict]) -> list[dict]:
    """Of rows that differ only in their sample count, the one with the most samples."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["engine"], r["task"], r["length"], r["setting"], r["method"], r["budget"],
               r["seed"], r["chat"])  # fmt: skip
        if key not in best or r["n"] > best[key]["n"]:
            best[key] = r
    return [r for r in rows if best[(r["engine"], r["task"], r["length"], r["setting"],
                                     r["method"], r["budget"], r["seed"], r["chat"])] is r]


def paired_difference(
    base: Sequence[float], other: Sequence[float], resamples: int = 2000, seed: int = 0
) -> dict:
    """``other - base`` on the same samples: mean, 95 % paired-bootstrap CI, samples where
    ``other`` scored higher / lower, and the two-sided exact sign-test p-value over those.

    Pairing removes the between-sample variance (most samples are easy or hard for every
    method), so it resolves differences that two independent intervals cannot.
    """
    if len(base) != len(other) or not base:
        raise ValueError("paired scores need equal, non-zero lengths")
    diffs = [o - b for b, o in zip(base, other, strict=True)]
    better, worse = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    m, k = better + worse, min(better, worse)
    p = min(1.0, 2 * sum(math.comb(m, i) for i in range(k + 1)) / 2**m) if m else 1.0
    return {
        "difference": sum(diffs) / len(diffs),
        "ci95": bootstrap(diffs, resamples, seed),
        "better": better,
        "worse": worse,
        "p_sign": p,
    }


def paired_against(rows: Sequence[dict], baseline: str = "attn") -> list[str]:
    """Each scorer against ``baseline`` within the same pipeline, selection, budget, setting
    and samples (Markdown table lines; empty if no such pairs)."""

    def group(r):
        return (r["engine"], r["task"], r["length"], r["setting"], r["pipeline"], r["window"],
                r["per_head"], r["budget"], r["n"], r["seed"], r["chat"])  # fmt: skip

    base = {group(r): r for r in rows if r["scorer"] == baseline}
    pairs = [(base[group(r)], r) for r in rows
             if r["scorer"] not in (baseline, "-") and group(r) in base]  # fmt: skip
    if not pairs:
        return []
    out = [f"## Scorers against `{baseline}`, paired on the same samples", "",
           f"Difference = scorer - {baseline} accuracy on the same samples, 95 % paired-bootstrap "
           "CI; better/worse = samples where the scorer scored higher/lower; p = two-sided exact "
           "sign test over those.", "",
           "| engine | task | length | setting | pipeline | budget | n | scorer | accuracy | "
           f"{baseline} | difference [95 % CI] | better / worse | p |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    pairs.sort(key=lambda p: tuple(str(x) for x in (*group(p[1]), p[1]["scorer"])))
    for b, r in pairs:
        d = paired_difference(b["scores"], r["scores"])
        pipeline = Cell(**{k: r[k] for k in Cell.__dataclass_fields__}).method.replace(
            f"/{r['scorer']}", ""
        )
        out.append(f"| {r['engine']} | {r['task']} | {r['length']} | {r['setting']} | "
                   f"{pipeline} | {r['budget']:.0%} | {r['n']} | {r['scorer']} | "
                   f"{r['accuracy']:.2f} | {b['accuracy']:.2f} | {d['difference']:+.2f} "
                   f"[{d['ci95'][0]:+.2f}, {d['ci95'][1]:+.2f}] | {d['better']} / {d['worse']} "
                   f"| {d['p_sign']:.2g} |")  # fmt: skip
    return out + [""]


def paired_hosts(rows: Sequence[dict]) -> list[str]:
    """Each reallocating pipeline's cell (adakv) against its uniform host's (snapkv) of the
    same scorer, window, budget, setting and samples (Markdown lines; empty if none)."""
    from obcache_vllm.evidence.fidelity import host_of

    def group(r, pipeline):
        return (r["engine"], r["task"], r["length"], r["setting"], pipeline, r["scorer"],
                r["window"], r["per_head"], r["budget"], r["n"], r["seed"], r["chat"])  # fmt: skip

    index = {group(r, r["pipeline"]): r for r in rows}
    pairs = [(index[group(r, host_of(r["pipeline"]))], r) for r in rows
             if r["pipeline"] != FULL and host_of(r["pipeline"])
             and group(r, host_of(r["pipeline"])) in index]  # fmt: skip
    if not pairs:
        return []
    out = ["## Reallocations against their uniform host, paired on the same samples", "",
           "Difference = pipeline - host accuracy (adakv - snapkv) at the same scorer, window, "
           "budget and samples, 95 % paired-bootstrap CI; better/worse = samples where it "
           "scored higher/lower; p = two-sided exact sign test over those.", "",
           "| engine | task | length | setting | scorer | budget | n | pipeline | accuracy | "
           "host | difference [95 % CI] | better / worse | p |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    pairs.sort(key=lambda p: tuple(str(x) for x in group(p[1], p[1]["pipeline"])))
    for b, r in pairs:
        d = paired_difference(b["scores"], r["scores"])
        out.append(f"| {r['engine']} | {r['task']} | {r['length']} | {r['setting']} | "
                   f"{r['scorer']} | {r['budget']:.0%} | {r['n']} | {r['pipeline']} | "
                   f"{r['accuracy']:.2f} | {b['accuracy']:.2f} | {d['difference']:+.2f} "
                   f"[{d['ci95'][0]:+.2f}, {d['ci95'][1]:+.2f}] | {d['better']} / {d['worse']} "
                   f"| {d['p_sign']:.2g} |")  # fmt: skip
    return out + [""]


def _fmt(row: dict) -> str:
    lo, hi = row["ci95"]
    return f"{row['accuracy']:.2f} [{lo:.2f}, {hi:.2f}]"


def markdown(rows: Sequence[dict]) -> str:
    """Tables: full cache per task and length, then per (engine, task, length, setting).

    Each table cell shows the run with the most samples; the kvpress comparison pairs runs of
    the same samples.
    """
    all_rows, rows = rows, largest_samples(rows)
    out = ["# Accuracy under KV-cache eviction", "",
           "Accuracy [95 % CI] per cell (Wilson for 0/1 scores, bootstrap otherwise); budgets "
           "are fractions of the document's tokens. Generated by `obcache-vllm eval report`.", ""]
    full = [r for r in rows if r["pipeline"] == FULL]
    if full:
        out += ["## Full cache", "", "| engine | task | length (nominal) | document tokens (mean) "
                "| n | accuracy [95 % CI] |", "| --- | --- | --- | --- | --- | --- |"]
        for r in full:
            out.append(f"| {r['engine']} | {r['task']} | {r['length']} | "
                       f"{r['document_tokens_mean']:.0f} | {r['n']} | {_fmt(r)} |")
        out.append("")
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["pipeline"] != FULL:
            groups[(r["engine"], r["task"], r["length"], r["setting"])].append(r)
    for (engine, task, length, setting), group in sorted(groups.items()):
        budgets = sorted({r["budget"] for r in group})
        out += [f"## {task}, {length} tokens, {setting} ({engine})", "",
                "| method | " + " | ".join(f"{b:.0%}" for b in budgets) + " |",
                "| --- |" + " --- |" * len(budgets)]
        by_method: dict[str, dict[float, dict]] = defaultdict(dict)
        for r in group:
            by_method[r["method"]][r["budget"]] = r
        for method in sorted(by_method):
            cells = [_fmt(by_method[method][b]) if b in by_method[method] else "" for b in budgets]
            out.append(f"| {method} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out + paired_against(rows) + paired_hosts(rows)
                     + comparison(all_rows))  # fmt: skip


def comparison(rows: Sequence[dict]) -> list[str]:
    """vLLM (this project) next to kvpress on the cells both engines ran."""
    def key(r):
        return (r["task"], r["length"], r["setting"], r["method"], r["budget"], r["n"],
                r["seed"], r["chat"])  # fmt: skip

    ref = {key(r): r for r in rows if r["engine"] == "kvpress"}
    pairs = [(r, ref[key(r)]) for r in rows if r["engine"] == "vllm" and key(r) in ref]
    if not pairs:
        return []
    out = ["## obcache-vllm (vLLM) vs kvpress 0.5.5 (HF), same samples, same kept counts", "",
           "| task | length | setting | method | budget | n | kept (mean) | vLLM | kvpress "
           "| vLLM - kvpress, paired [95 % CI] |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mine, theirs in pairs:
        d = paired_difference(theirs["scores"], mine["scores"])
        out.append(f"| {mine['task']} | {mine['length']} | {mine['setting']} | {mine['method']} "
                   f"| {mine['budget']:.0%} | {mine['n']} | {mine['kept_tokens_mean']:.0f} "
                   f"| {_fmt(mine)} | {_fmt(theirs)} "
                   f"| {d['difference']:+.2f} [{d['ci95'][0]:+.2f}, {d['ci95'][1]:+.2f}] |")
    return out + [""]  # fmt: skip


def plot(rows: Sequence[dict], directory: Path) -> list[Path]:
    """One PNG per (engine, task, length): accuracy vs budget, a row of panels per pipeline and
    a column per setting. Within a panel the colour is the scorer (the same in every panel)
    and the line style the variant (window, shared ranking), so no two lines look alike."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    palette = plt.get_cmap("tab10").colors
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v"),
              ((0, (1, 1)), "P"), ((0, (8, 2)), "X"), ((0, (3, 1, 1, 1, 1, 1)), "*")]
    paths = []
    rows = largest_samples(rows)
    keys = sorted({(r["engine"], r["task"], r["length"]) for r in rows if r["pipeline"] != FULL})
    for engine, task, length in keys:
        mine = [r for r in rows if (r["engine"], r["task"], r["length"]) == (engine, task, length)]
        scored = [r for r in mine if r["pipeline"] != FULL]
        settings = sorted({r["setting"] for r in scored})
        pipelines = sorted({r["pipeline"] for r in scored})
        # The same colour for a scorer in every plot: the grid's order, then any other.
        known = [*SCORERS, "-"]
        scorers = known + sorted({r["scorer"] for r in scored} - set(known))
        colour = {sc: palette[i % len(palette)] for i, sc in enumerate(scorers)}
        fig, axes = plt.subplots(len(pipelines), len(settings), squeeze=False, sharex=True,
                                 sharey=True, figsize=(5.2 * len(settings) + 3.2,
                                                       2.6 * len(pipelines) + 0.8))  # fmt: skip
        full = [r for r in mine if r["pipeline"] == FULL]
        for row, pipeline in enumerate(pipelines):
            in_row = [r for r in scored if r["pipeline"] == pipeline]
            # Styles per row, so a variant looks the same in both settings.
            variants = sorted({_variant(r["method"], pipeline, r["scorer"]) for r in in_row})
            style = {v: styles[i % len(styles)] for i, v in enumerate(variants)}
            for col, setting in enumerate(settings):
                ax = axes[row][col]
                here = [r for r in in_row if r["setting"] == setting]
                methods = sorted({r["method"] for r in here})
                for i, method in enumerate(methods):
                    pts = sorted(((r["budget"], r) for r in here if r["method"] == method),
                                 key=lambda t: t[0])  # fmt: skip
                    scorer = pts[0][1]["scorer"]
                    line, marker = style[_variant(method, pipeline, scorer)]
                    # A small x offset per method keeps overlapping error bars readable.
                    shift = (i - (len(methods) - 1) / 2) * 0.35
                    xs = [b * 100 + shift for b, _ in pts]
                    ys = [r["accuracy"] for _, r in pts]
                    err = [[y - r["ci95"][0] for y, (_, r) in zip(ys, pts, strict=True)],
                           [r["ci95"][1] - y for y, (_, r) in zip(ys, pts, strict=True)]]
                    ax.errorbar(xs, ys, yerr=err, color=colour[scorer], linestyle=line,
                                marker=marker, capsize=2, alpha=0.85)  # fmt: skip
                if full:
                    ax.axhline(full[0]["accuracy"], color="black", linestyle="--", lw=1)
                    ax.axhspan(*full[0]["ci95"], color="grey", alpha=0.15)
                ax.set_title(f"{pipeline}, {setting}", fontsize=10)
                ax.set_ylim(-0.03, 1.03)
                ax.grid(alpha=0.3)
                if row == len(pipelines) - 1:
                    ax.set_xlabel("KV budget (% of document tokens)")
                if col == 0:
                    ax.set_ylabel("accuracy")
            # One legend per row: the colours (scorers), then the styles (variants).
            handles = [Line2D([], [], color=colour[sc], marker="o", label=sc if sc != "-"
                              else "no scorer")
                       for sc in sorted({r["scorer"] for r in in_row})]  # fmt: skip
            if len(variants) > 1:
                handles += [Line2D([], [], color="grey", linestyle=style[v][0],
                                   marker=style[v][1], label=v or "per head")
                            for v in variants]  # fmt: skip
            if full and row == 0:
                handles.append(Line2D([], [], color="black", linestyle="--", label="full cache"))
            axes[row][-1].legend(handles=handles, fontsize=7, loc="upper left",
                                 bbox_to_anchor=(1.02, 1.0))  # fmt: skip
        fig.suptitle(f"{task}, {length} tokens ({engine}; 95 % intervals)", fontsize=11)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))  # room for the title
        path = directory / f"{engine}_{task}_{length}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def _variant(method: str, pipeline: str, scorer: str) -> str:
    """What a method adds to its pipeline and scorer ("+w1/shared" -> "w1 shared")."""
    if method == pipeline:  # streaming: no scorer, no variant
        return ""
    rest = method.removeprefix(f"{pipeline}/").removeprefix(scorer)
    return " ".join(p for p in rest.replace("+", "/").split("/") if p)


def write_report(directory: Path) -> list[Path]:
    """Read ``directory/results.jsonl``; write results.json, RESULTS.md and the PNGs."""
    directory = Path(directory)
    rows = summarize(list(load_results(directory / "results.jsonl").values()))
    json_path = directory / "results.json"
    json_path.write_text(json.dumps(rows, indent=1) + "\n")
    md_path = directory / "RESULTS.md"
    md_path.write_text(markdown(rows) + "\n")
    return [json_path, md_path, *plot(rows, directory)]
