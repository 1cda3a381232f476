"""Teacher-forced perplexity vs position under decode-time eviction (the paper's PG19 experiment).

Each document (a book of the King James Bible, public domain, from Debian's ``bible-kjv``) is
tokenised; its first ``--prompt-tokens`` tokens are the prompt, the next ``--tokens`` are forced
through the engine one decode step at a time (:mod:`obcache_vllm.evidence.forcing`), so every
method sees exactly the same text while decode-time eviction runs as it would while generating.
The log-probability the model gave each true token is the raw one (before the forcing), so the
full-cache run equals a ``prompt_logprobs`` pass over the same text.

Every (document, method) pair is one request of ONE batch in ONE engine: the methods run
concurrently, which on a CPU costs far less than sequential runs.

Methods (``kv_decode`` on, budget B per layer and KV head):

* ``full``                       no eviction
* ``streaming``                  StreamingLLM: 4 sinks + the most recent B - 4 tokens
* ``h2o+attn``                   H2O: accumulated attention (prefill + every decode query)
* ``h2o+obcache_{value,key,joint}``  H2O's accumulation of the OBCache scores
* ``h2o+dropkv``, ``h2o+random`` (``--scorers``)  the same host with the closest published
  rival's score (kvpress's DropKV) and with uniform random scores, the floor

Usage::

    python -m obcache_vllm.evidence.perplexity --docs 2 --tokens 8000 --budgets 256 512 1024 \\
        --out results/ppl
    obcache-vllm ppl --help          # the same command

Everything but :func:`run` is pure (tested in ``tests/unit/test_perplexity_units.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from obcache_vllm.scoring import SCORER_NAMES

DEFAULT_BOOKS = ("Genesis", "Exodus", "Matthew", "Acts", "Numbers", "Isaiah")
SCORED = ("attn", "obcache_value", "obcache_key", "obcache_joint")  # the default --scorers
SINKS = 4
BIN = 64  # positions per stored bin (JSON); tables and plots merge bins
BIBLE_HELP = (
    "the KJV text needs Debian's `bible-kjv` package (the `bible` command): "
    "run `apt-get install -y bible-kjv` (as root) or `make setup`, which installs it when it can"
)


class MissingTextError(RuntimeError):
    """The text source (the ``bible`` command of ``bible-kjv``) is not available."""


# ---------------------------------------------------------------------------------------------
# Text


_VERSE = re.compile(r"^\s*[1-3]?[A-Za-z]+\d+:\d+\s+(.*)$")


def clean_verses(raw: str) -> str:
    """``bible -f`` output (one ``Ge1:1 text`` line per verse, long ones may wrap) -> prose."""
    verses: list[str] = []
    for line in raw.splitlines():
        match = _VERSE.match(line)
        if match:
            verses.append(match.group(1).strip())
        elif line.strip() and verses:  # a wrapped continuation line
            verses[-1] += " " + line.strip()
    return " ".join(verses)


def kjv_book(book: str, bible: str | None = None) -> str:
    """The whole text of one KJV book as prose. Raises MissingTextError without ``bible``."""
    exe = bible or shutil.which("bible")
    if exe is None:
        raise MissingTextError(f"`bible` not found: {BIBLE_HELP}")
    proc = subprocess.run(
        [exe, "-f", f"{book} 1:1-999:999"], capture_output=True, text=True, check=False
    )
    text = clean_verses(proc.stdout)
    if proc.returncode != 0 or not text:
        raise MissingTextError(
            f"`bible -f '{book} 1:1-999:999'` gave no verses ({proc.stdout[-200:]!r} "
            f"{proc.stderr[-200:]!r}); is {book!r} a book name? Otherwise: {BIBLE_HELP}"
        )
    return text


@dataclass(frozen=True)
class Document:
    """A prompt and the continuation forced after it (token ids)."""

    name: str
    prompt: tuple[int, ...]
    target: tuple[int, ...]


def make_document(name: str, ids: Sequence[int], prompt_tokens: int, tokens: int) -> Document:
    """First ``prompt_tokens`` ids as prompt, the next ``tokens`` as forced continuation."""
    if prompt_tokens < 1 or tokens < 1:
        raise ValueError("prompt_tokens and tokens must be >= 1")
    if len(ids) < prompt_tokens + tokens:
        raise ValueError(
            f"{name}: {len(ids)} tokens, fewer than prompt {prompt_tokens} + forced {tokens}"
        )
    return Document(
        name, tuple(ids[:prompt_tokens]), tuple(ids[prompt_tokens : prompt_tokens + tokens])
    )


# ---------------------------------------------------------------------------------------------
# Methods


@dataclass(frozen=True)
class Method:
    """One eviction configuration: a name and the request's kv_* options (None: full cache)."""

    name: str
    budget: int | None
    kv: dict | None = field(default=None, hash=False, compare=False)

    @property
    def family(self) -> str:
        return self.name.rsplit("@", 1)[0]


def methods(budgets: Sequence[int], scorers: Sequence[str] = SCORED, recent: int = 16,
            recent_fraction: float | None = None) -> list[Method]:
    """Full cache, then per budget: streaming and h2o with each scorer (decode eviction on).

    Streaming keeps the first ``SINKS`` tokens and fills the rest of the budget with the most
    recent ones (its select grows the recent window to the kept count, so ``kv_recent`` is only
    a floor; it is set to ``budget - SINKS - 1``, the largest the options allow, to make that
    explicit). The scored methods keep ``SINKS`` sinks and ``recent`` recent tokens (16, the
    plugin's default and the paper's example), or ``round(recent_fraction * budget)``.
    """
    out = [Method("full", None, None)]
    for b in budgets:
        if b <= SINKS + 17:
            raise ValueError(f"budget {b} too small (needs > {SINKS + 17})")
        out.append(
            Method(f"streaming@{b}", b, {"kv_budget": b, "kv_pipeline": "streaming",
                                         "kv_decode": True, "kv_sinks": SINKS,
                                         "kv_recent": b - SINKS - 1})
        )
        keep_recent = recent if recent_fraction is None else round(recent_fraction * b)
        for s in scorers:
            out.append(
                Method(f"h2o+{s}@{b}", b, {"kv_budget": b, "kv_pipeline": "h2o", "kv_scorer": s,
                                           "kv_decode": True, "kv_sinks": SINKS,
                                           "kv_recent": keep_recent})
            )
    return out


# ---------------------------------------------------------------------------------------------
# Statistics and reports


def bin_nll(logprobs: Sequence[float], start: int, width: int = BIN) -> list[tuple[float, int]]:
    """(sum of -logprob, count) per position bin; the first logprob is at position ``start``.

    Bins are aligned on absolute document positions: bin i covers [i*width, (i+1)*width).
    """
    bins: list[list[float]] = []
    for j, lp in enumerate(logprobs):
        i = (start + j) // width
        while len(bins) <= i:
            bins.append([0.0, 0])
        bins[i][0] -= lp
        bins[i][1] += 1
    return [(s, int(c)) for s, c in bins]


def merge_bins(per_doc: Sequence[Sequence[Sequence[float]]], factor: int = 1) -> list[list[float]]:
    """Sum (nll, count) bins over documents, then merge ``factor`` adjacent bins."""
    width = max((len(b) for b in per_doc), default=0)
    total = [[0.0, 0] for _ in range(-(-width // factor))]
    for bins in per_doc:
        for i, (s, c) in enumerate(bins):
            total[i // factor][0] += s
            total[i // factor][1] += c
    return total


def ppl(nll_sum: float, count: int) -> float:
    return math.exp(nll_sum / count) if count else float("nan")


def summarise(results: dict, table_bin: int) -> dict:
    """Per method: perplexity per ``table_bin`` positions and overall, from stored bins."""
    width = results["bin"]
    if table_bin % width:
        raise ValueError(f"table bin {table_bin} must be a multiple of {width}")
    out = {}
    for name, per_doc in results["methods"].items():
        bins = merge_bins([d["bins"] for d in per_doc], table_bin // width)
        total = (sum(s for s, _ in bins), sum(c for _, c in bins))
        out[name] = {"bins": [ppl(s, c) for s, c in bins], "overall": ppl(*total),
                     "tokens": total[1]}
    return out


def markdown_table(summary: dict, table_bin: int) -> str:
    """Methods as rows, position bins as columns, then the overall perplexity."""
    width = max(len(v["bins"]) for v in summary.values())
    heads = [f"{i * table_bin}-{(i + 1) * table_bin}" for i in range(width)]
    lines = ["| method | " + " | ".join(heads) + " | all |",
             "|---|" + "---:|" * (width + 1)]
    for name, v in summary.items():
        cells = [f"{x:.2f}" if not math.isnan(x) else "" for x in v["bins"]]
        cells += [""] * (width - len(cells))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {v['overall']:.3f} |")
    return "\n".join(lines)


# The references every budgeted method is compared with, where the run has them: the full
# cache, and at the method's own budget the floor (random scores) and the closest rival.
PAIRED_REFERENCES = ("full", "h2o+random", "h2o+dropkv")


def _units(per_doc: Sequence[dict]) -> list[tuple[float, int]]:
    """(nll sum, count) per (document, stored bin): the resampling unit of :func:`paired`."""
    return [(s, c) for d in per_doc for s, c in d["bins"]]


def paired(results: dict, name: str, reference: str, resamples: int = 2000,
           seed: int = 0) -> tuple[float, float, float]:  # fmt: skip
    """The perplexity ratio of ``name`` to ``reference`` over the same forced tokens, with a
    95 % paired block-bootstrap interval: the (document, bin) units of both are resampled
    together (bins of ``results["bin"]`` positions, so the correlation within a bin is kept;
    between bins it is taken as none). Above 1: ``name`` is further from the text."""
    a, b = _units(results["methods"][name]), _units(results["methods"][reference])
    if len(a) != len(b) or any(ca != cb for (_, ca), (_, cb) in zip(a, b, strict=True)):
        raise ValueError(f"{name} and {reference} were not forced over the same positions")

    def ratio(idx) -> float:
        count = sum(a[i][1] for i in idx)
        return math.exp((sum(a[i][0] for i in idx) - sum(b[i][0] for i in idx)) / count)

    rng = random.Random(seed)
    units = range(len(a))
    stats = sorted(ratio(rng.choices(units, k=len(a))) for _ in range(resamples))
    return ratio(units), stats[int(0.025 * resamples)], stats[min(resamples - 1,
                                                                  int(0.975 * resamples))]


def paired_table(results: dict) -> str:
    """Each budgeted method's perplexity ratio to the full cache and, at its budget, to the
    floor and the rival (:data:`PAIRED_REFERENCES`), with paired intervals."""
    info = results["method_info"]

    def at_budget(ref: str, budget) -> str | None:
        name = ref if ref == "full" else f"{ref}@{budget}"
        return name if name in results["methods"] else None

    refs = [r for r in PAIRED_REFERENCES
            if any(at_budget(r, m["budget"]) for m in info.values() if m["budget"])]  # fmt: skip
    lines = ["| method | " + " | ".join(f"/ {r}" for r in refs) + " |",
             "|---|" + "---:|" * len(refs)]  # fmt: skip
    for name, m in info.items():
        if not m["budget"] or name not in results["methods"]:
            continue
        cells = []
        for ref in refs:
            other = at_budget(ref, m["budget"])
            if other is None or other == name:
                cells.append("")
                continue
            r, lo, hi = paired(results, name, other)
            cells.append(f"{r:.3f} [{lo:.3f}, {hi:.3f}]")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path, plot_bin: int = 256) -> None:
    """Per budget (columns): perplexity vs position (top) and its ratio to the full cache."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarise(results, plot_bin)
    budgets = sorted({m["budget"] for m in results["method_info"].values() if m["budget"]})
    cols = max(1, len(budgets))
    fig, axes = plt.subplots(2, cols, figsize=(max(6, 5 * cols), 7), sharex=True, sharey="row",
                             squeeze=False)
    full = summary.get("full", {}).get("bins")
    for col, budget in enumerate(budgets or [None]):
        top, bottom = axes[0][col], axes[1][col]
        for name, info in results["method_info"].items():
            if info["budget"] not in (None, budget):
                continue
            ys = summary[name]["bins"]
            xs = [(i + 0.5) * plot_bin for i in range(len(ys))]
            style = {"marker": "."}
            if info["budget"] is None:
                style.update(color="black", linewidth=2)
            top.plot(xs, ys, label=name.split("@")[0], **style)
            if full:
                bottom.plot(xs, [y / f for y, f in zip(ys, full, strict=False)], **style)
        top.set_title(f"budget {budget}" if budget else "full cache")
        top.grid(alpha=0.3)
        bottom.grid(alpha=0.3)
        bottom.set_xlabel("position (tokens)")
    axes[0][0].set_ylabel(f"perplexity (per {plot_bin} positions)")
    axes[1][0].set_ylabel("perplexity / full cache")
    axes[0][-1].legend(fontsize=8)
    docs = len(results["documents"])
    fig.suptitle(f"{results['model_name']}, teacher-forced KJV, {docs} document(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_reports(results: dict, out: Path, table_bin: int) -> str:
    """results.json, table.md and ppl_vs_position.png under ``out``; returns the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    table = markdown_table(summarise(results, table_bin), table_bin)
    if results.get("methods") and "full" in results["methods"] and not results.get("partial"):
        paired_rows = paired_table(results)
        named = {"h2o+random": "the floor", "h2o+dropkv": "the rival"}
        others = [f"`/ {r}` with {what}" for r, what in named.items()
                  if f"/ {r} |" in paired_rows.splitlines()[0]]  # fmt: skip
        table += ("\n\nPerplexity ratio over every forced token [95 % paired block-bootstrap "
                  f"interval: (document, {results['bin']}-position bin) units resampled "
                  "together]; above 1 is further from the text"
                  + (f"; {' and '.join(others)} at the method's own budget" if others else "")
                  + ".\n\n" + paired_rows)  # fmt: skip
    (out / "table.md").write_text(table + "\n")
    plot(results, out / "ppl_vs_position.png")
    return table


# ---------------------------------------------------------------------------------------------
# The engine part


def in_process_engine(model: str | None) -> str:
    """Settings of an evaluation engine whose core runs in this process (the evaluation reads
    the scheduler or the worker's processor directly), set before vLLM starts; returns the
    model directory (``None``: the default model, provisioned as ``obcache-vllm model pull``)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    if model is not None:
        return model
    from obcache_vllm import model as model_mod

    return str(model_mod.pull(log=lambda m: None))


def engine_kwargs(model: str, max_len: int, num_requests: int) -> dict:
    """vLLM settings of the perplexity engine (the project's CPU defaults, fp32)."""
    from obcache_vllm.evidence.forcing import FORCE_TOKENS_FQCN

    return dict(model=model, dtype="float32", enforce_eager=True, max_model_len=max_len,
                block_size=32, seed=0, max_num_seqs=max(num_requests, 1),
                logits_processors=[FORCE_TOKENS_FQCN], logprobs_mode="raw_logprobs")


def collect(outcome, documents: Sequence[Document], method_list: Sequence[Method]) -> dict:
    """Per method, per document: position bins of -logprob and what the request held.

    Works on a partial outcome too (each request's tokens so far must be a prefix of its text).
    """
    per_method: dict[str, list] = {m.name: [] for m in method_list}
    for d in documents:
        for m in method_list:
            got = outcome[f"{d.name}|{m.name}"]
            if list(got.tokens) != list(d.target[: len(got.tokens)]):
                raise RuntimeError(f"{d.name}|{m.name}: forced tokens differ from the text")
            per_method[m.name].append({
                "document": d.name,
                "forced": len(got.tokens),
                "bins": bin_nll(got.logprobs, start=len(d.prompt)),
                "max_live_blocks": got.max_live_blocks,
                "max_resident_tokens": got.max_resident_tokens,
                "evictions": got.evictions,
            })
    return per_method


def run(llm, documents: Sequence[Document], method_list: Sequence[Method],
        checkpoint=None, every: int = 500) -> dict:
    """Force every document under every method, all requests in one batch; raw results.

    ``checkpoint(partial)`` gets the results so far every ``every`` steps (a long run leaves
    usable reports behind if it is stopped).
    """
    from obcache_vllm.evidence.forcing import ForcedRequest, check_logprobs_mode, run_forced

    check_logprobs_mode(llm.llm_engine.model_config.logprobs_mode)
    requests = [
        ForcedRequest(f"{d.name}|{m.name}", list(d.prompt), list(d.target), m.kv)
        for d in documents for m in method_list
    ]
    start = time.perf_counter()

    def progress(step: int, done: int, total: int, outcome) -> None:
        if step % every == 0:
            wall = time.perf_counter() - start
            print(f"[ppl] step {step}: {done}/{total} requests done, {wall:.0f} s "
                  f"({wall / step:.3f} s/step)", file=sys.stderr, flush=True)
            if checkpoint is not None:
                checkpoint({"methods": collect(outcome, documents, method_list),
                            "wall_s": wall, "steps": step, "partial": True})

    outcome = run_forced(llm, requests, progress=progress)
    wall = time.perf_counter() - start
    for d in documents:
        for m in method_list:
            if len(outcome[f"{d.name}|{m.name}"].tokens) != len(d.target):
                raise RuntimeError(f"{d.name}|{m.name}: stopped before the end of the text")
    return {"methods": collect(outcome, documents, method_list), "wall_s": wall,
            "steps": outcome.steps, "partial": False}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="obcache-vllm ppl", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--model", default=None, help="HF model dir (default: the provisioned model)")
    ap.add_argument("--books", nargs="+", default=list(DEFAULT_BOOKS), help="KJV books to use")
    ap.add_argument("--docs", type=int, default=2, help="how many of --books to force")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length per document")
    ap.add_argument("--tokens", type=int, default=8000, help="forced tokens per document")
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--scorers", nargs="+", default=list(SCORED), choices=SCORER_NAMES,
                    help="the h2o methods' scores (any kv_scorer: dropkv, the closest rival, "
                         "and random, the floor, beside the default four)")
    ap.add_argument("--recent", type=int, default=16,
                    help="recent tokens always kept by the h2o methods")
    ap.add_argument("--recent-fraction", type=float, default=None,
                    help="instead of --recent: that fraction of each budget")
    ap.add_argument("--table-bin", type=int, default=1024, help="positions per table column")
    ap.add_argument("--out", type=Path, default=Path("results/ppl"))
    ap.add_argument("--report-only", type=Path, default=None, metavar="RESULTS_JSON",
                    help="only rewrite the reports (--out) from an earlier results.json")
    ap.add_argument("--checkpoint-every", type=int, default=500,
                    help="write partial reports every N engine steps")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.report_only is not None:
        results = json.loads(args.report_only.read_text())
        print(write_reports(results, args.out, args.table_bin))
        return 0
    if args.docs < 1 or args.docs > len(args.books):
        raise SystemExit(f"--docs must be in [1, {len(args.books)}] (one per --books entry)")
    if args.table_bin % BIN:
        raise SystemExit(f"--table-bin must be a multiple of {BIN}")
    try:
        import matplotlib  # noqa: F401  (checked now: the plot comes after a long run)
    except ImportError:
        print("obcache-vllm ppl: error: matplotlib is missing (pip install matplotlib, or "
              "install the dev extra: pip install -e '.[cpu,dev]')", file=sys.stderr)
        return 2
    try:
        texts = {b: kjv_book(b) for b in args.books[: args.docs]}
    except MissingTextError as exc:
        print(f"obcache-vllm ppl: error: {exc}", file=sys.stderr)
        return 2
    # In-process engine core: the run reads the scheduler (blocks held) between steps.
    args.model = in_process_engine(args.model)
    from transformers import AutoTokenizer
    from vllm import LLM

    tok = AutoTokenizer.from_pretrained(args.model)
    docs = [make_document(b, tok(t).input_ids, args.prompt_tokens, args.tokens)
            for b, t in texts.items()]
    method_list = methods(args.budgets, args.scorers, args.recent, args.recent_fraction)
    max_len = args.prompt_tokens + args.tokens + 32
    kwargs = engine_kwargs(args.model, max_len, len(docs) * len(method_list))
    llm = LLM(**kwargs)

    meta = {
        "command": "obcache-vllm ppl " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model,
        "model_name": Path(args.model).name,
        "engine": {k: v for k, v in kwargs.items() if k != "model"},
        "documents": [{"name": d.name, "prompt_tokens": len(d.prompt),
                       "forced_tokens": len(d.target)} for d in docs],
        "method_info": {m.name: {"budget": m.budget, "kv": m.kv} for m in method_list},
        "bin": BIN,
        "threads": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ""),
    }

    def checkpoint(partial: dict) -> None:
        write_reports({**meta, **partial}, args.out, args.table_bin)

    raw = run(llm, docs, method_list, checkpoint=checkpoint, every=args.checkpoint_every)
    results = {**meta, **raw}
    table = write_reports(results, args.out, args.table_bin)
    print(table)
    print(f"[ppl] {raw['steps']} engine steps in {raw['wall_s']:.0f} s; reports in {args.out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

