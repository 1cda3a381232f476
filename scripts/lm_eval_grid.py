#!/usr/bin/env python
"""EleutherAI's lm-evaluation-harness through obcache-vllm's OpenAI server, one run per arm.

Each arm is a set of kv_* request fields passed as lm-eval's ``--gen_kwargs``: lm-eval's
``local-completions`` model spreads them into every request body, and the server applies them
per request. The full-cache arm sends ``"kv_budget": null`` (stock vLLM whatever the server's
default budget). Query-agnostic arms add ``"kv_compress_at": -TAIL``: the prompt is compressed
TAIL tokens before its end, so the question (at the end of every RULER prompt) is prefilled
on the compressed cache; a negative ``kv_compress_at`` counts back from each prompt's end, one
setting for prompts of every length. The TAIL tokens are kept whole, so the kept fraction of an
agnostic arm is above its budget: the report gives the server's own mean kept fraction per arm
(``vllm:obcache_kept_prompt_ratio``, read from ``/metrics`` before and after the arm).

The RULER tasks that build their data locally are the default (the others download essays or
QA sets from a model hub). RULER's ``prepare_niah`` asks nltk for ``punkt_tab`` when it is
imported, and uses it only for the essay haystack; an empty ``tokenizers/punkt_tab`` directory
(``NLTK_DATA``, made here) satisfies it offline.

    make lm-eval          # .venv/bin/python scripts/lm_eval_grid.py $(LM_EVAL_ARGS)

lm-eval 0.4.13 is part of the project's ``eval`` extra (``make setup`` installs it): it talks to
the server over HTTP only.

Starts ``obcache-vllm serve`` on a free port unless ``--url`` names a running server (then
``--model`` must be its served name and ``--tokenizer`` a path or hub name of its tokenizer).
Writes ``OUT/raw/<arm>/`` (lm-eval's own output, samples included), ``OUT/lm_eval.json`` (every
sample's score, per arm and task) and ``OUT/lm_eval.md`` (accuracy with 95 % intervals, Wilson
for 0/1 scores and bootstrap otherwise; each budgeted arm's paired difference to the full cache,
bootstrapped over the same documents).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.launch import launched  # noqa: E402
from loadtest.scrape import Snapshot  # noqa: E402
from obcache_vllm import metrics as M  # noqa: E402
from obcache_vllm.evidence.eval.report import interval  # noqa: E402

# The RULER tasks of lm-eval 0.4.13 whose data is generated locally (no download).
OFFLINE_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe",
                 "ruler_fwe")  # fmt: skip
KEPT_RATIO = M.KEPT_RATIO.exposed
REQUEST_TIMEOUT_S = 3600


@dataclass(frozen=True)
class Arm:
    """One lm-eval run: a name and the kv_* fields every request carries."""

    name: str
    fields: dict = field(hash=False)

    @property
    def is_full(self) -> bool:
        return self.fields.get("kv_budget") is None


def arms(pipelines, scorers, budgets, settings, tail: int, full: bool = True) -> list[Arm]:
    """The full cache (unless ``full`` is false), then every pipeline x scorer x budget x
    setting. An empty pipeline or scorer name leaves that field to the server's default."""
    out = [Arm("full", {"kv_budget": None})] if full else []
    for pipeline in pipelines:
        for scorer in scorers:
            for budget in budgets:
                for setting in settings:
                    if setting not in ("aware", "agnostic"):
                        raise ValueError(f"unknown setting {setting!r} (aware, agnostic)")
                    fields: dict = {"kv_budget": budget}
                    if pipeline:
                        fields["kv_pipeline"] = pipeline
                    if scorer:
                        fields["kv_scorer"] = scorer
                    if setting == "agnostic":
                        fields["kv_compress_at"] = -tail
                    name = "/".join(x for x in (pipeline, scorer, f"{budget:g}", setting) if x)
                    out.append(Arm(name, fields))
    return out


def named_arms(path: Path, full: bool = True) -> list[Arm]:
    """The full cache (unless ``full`` is false), then the arms of a JSON file: an object of
    arm name -> the kv_* fields its requests carry (every field the arm depends on: the
    server's defaults fill in the rest)."""
    named = json.loads(path.read_text())
    out = [Arm("full", {"kv_budget": None})] if full else []
    return out + [Arm(name, dict(fields)) for name, fields in named.items()]


def nltk_stub(root: Path) -> Path:
    """An NLTK_DATA directory in which ``nltk.data.find("tokenizers/punkt_tab")`` succeeds."""
    (root / "tokenizers" / "punkt_tab" / "english").mkdir(parents=True, exist_ok=True)
    return root


def lm_eval_command(lm_eval: str, url: str, model: str, tokenizer: str, arm: Arm, tasks,
                    lengths, limit: int, concurrent: int, out: Path) -> list[str]:  # fmt: skip
    """The lm_eval command line of one arm (printed in the report: a user reruns it as is)."""
    model_args = ",".join([
        f"model={model}", f"base_url={url}/v1/completions", f"tokenizer={tokenizer}",
        f"num_concurrent={concurrent}", "max_length=8192", "tokenized_requests=False",
        "max_retries=1",
        # lm-eval's own default is 300 s a request; a request waits behind the others in
        # flight, and an arm that scores every prompt query (h2o with DropKV at 2,048 tokens,
        # 16 in flight on one core) took longer than that
        f"timeout={REQUEST_TIMEOUT_S}",
    ])  # fmt: skip
    return [
        lm_eval, "--model", "local-completions", "--model_args", model_args,
        "--tasks", ",".join(tasks), "--metadata", json.dumps({"max_seq_lengths": list(lengths)}),
        "--gen_kwargs", json.dumps(arm.fields), "--limit", str(limit),
        "--output_path", str(out), "--log_samples", "--seed", "0",
    ]  # fmt: skip


def read_samples(out: Path, lengths) -> dict[str, dict[int, dict[int, float]]]:
    """``{task: {length: {doc_id: score}}}`` from lm-eval's samples files under ``out``."""
    scores: dict[str, dict[int, dict[int, float]]] = {}
    for path in sorted(out.rglob("samples_*.jsonl")):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        for line in path.read_text().splitlines():
            sample = json.loads(line)
            for length in lengths:
                value = sample.get(str(length), -1.0)
                if value != -1.0:
                    per = scores.setdefault(task, {}).setdefault(length, {})
                    per[sample["doc_id"]] = float(value)
    return scores


def paired_difference(arm: dict[int, float], full: dict[int, float], resamples: int = 2000,
                      seed: int = 0) -> tuple[float, float, float] | None:  # fmt: skip
    """Mean of arm - full over the documents both scored, with a 95 % paired bootstrap."""
    docs = sorted(set(arm) & set(full))
    if not docs:
        return None
    diffs = [arm[d] - full[d] for d in docs]
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(diffs, k=len(diffs))) / len(diffs) for _ in range(resamples))
    lo, hi = means[int(0.025 * resamples)], means[min(resamples - 1, int(0.975 * resamples))]
    return sum(diffs) / len(diffs), lo, hi


def summarize(runs: dict[str, dict]) -> list[dict]:
    """One row per (arm, task, length): n, accuracy, interval, paired difference to full."""
    full = runs.get("full", {}).get("scores", {})
    rows = []
    for name, run in runs.items():
        for task, per_length in sorted(run["scores"].items()):
            for length, docs in sorted(per_length.items()):
                values = [docs[d] for d in sorted(docs)]
                lo, hi = interval(values)
                row = {"arm": name, "task": task, "length": length, "n": len(values),
                       "accuracy": sum(values) / len(values), "low": lo, "high": hi,
                       "kept": run.get("kept_ratio")}  # fmt: skip
                if name != "full" and task in full and length in full[task]:
                    diff = paired_difference(docs, full[task][length])
                    if diff is not None:
                        row["diff"], row["diff_low"], row["diff_high"] = diff
                rows.append(row)
    return rows


def versus(runs: dict[str, dict], baseline: str = "attn") -> list[dict]:
    """Each budgeted arm whose scorer is not ``baseline`` against the arm that differs only by
    scoring with ``baseline``: the paired difference per (task, length) over the same
    documents, with a paired-bootstrap interval."""
    def without_scorer(fields):
        return {k: v for k, v in fields.items() if k != "kv_scorer"}

    rows = []
    for name, run in runs.items():
        scorer = run["fields"].get("kv_scorer")
        if run["fields"].get("kv_budget") is None or scorer in (None, baseline):
            continue
        base = next((n for n, r in runs.items() if r["fields"].get("kv_scorer") == baseline
                     and without_scorer(r["fields"]) == without_scorer(run["fields"])), None)
        if base is None:
            continue
        for task, per_length in sorted(run["scores"].items()):
            for length, docs in sorted(per_length.items()):
                other = runs[base]["scores"].get(task, {}).get(length)
                diff = None if other is None else paired_difference(docs, other)
                if diff is not None:
                    rows.append({"arm": name, "baseline": base, "task": task, "length": length,
                                 "diff": diff[0], "low": diff[1], "high": diff[2]})
    return rows


def added_what(added: dict) -> str:
    """What a later run added to an lm_eval.json (an ``added`` entry): its lengths or arms."""
    if "lengths" in added:
        return "lengths " + ", ".join(map(str, added["lengths"]))
    return "arms " + ", ".join(added["arms"])


def _first_up(text: str) -> str:
    return text[:1].upper() + text[1:]


def render(results: dict) -> str:
    """The markdown report: a table per length, tasks as columns, arms as rows."""
    rows = results["rows"]
    lines = [
        f"lm-evaluation-harness {results['lm_eval_version']} through `obcache-vllm serve` "
        f"({results['model']}), {results['date']}, {results['machine']}.",
        "",
        f"Command: `{results['command']}` ({results['seconds']:.0f} s). Every lm_eval command "
        "line is in `lm_eval.json`.",
        *(f"\n{_first_up(added_what(a))} added {a['date']}: `{a['command']}` "
          f"({a['seconds']:.0f} s)." for a in results.get("added", [])),
        "",
        "Accuracy [95 % interval] per task (RULER's string match: 0/1 for one needle, the "
        "fraction found for several; Wilson for 0/1 scores, bootstrap otherwise); "
        "Δ full: the paired difference to the full cache over the same documents, with a "
        "paired-bootstrap 95 % interval. Kept: the server's mean kept fraction of the prompt "
        "over the arm's requests.",
    ]
    for length in sorted({r["length"] for r in rows}):
        tasks = sorted({r["task"] for r in rows if r["length"] == length})
        lines += ["", f"### {length} tokens", "",
                  "| arm | kept | " + " | ".join(tasks) + " | mean Δ full |",
                  "|---|---|" + "---|" * len(tasks) + "---|"]  # fmt: skip
        for arm in results["arms"]:
            cells = {r["task"]: r for r in rows if r["arm"] == arm and r["length"] == length}
            if not cells:
                continue
            kept = next(iter(cells.values()))["kept"]
            text = []
            for task in tasks:
                r = cells.get(task)
                if r is None:
                    text.append("")
                    continue
                cell = f"{r['accuracy']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"
                if "diff" in r:
                    cell += f"<br>Δ {r['diff']:+.2f} [{r['diff_low']:+.2f}, {r['diff_high']:+.2f}]"
                text.append(cell)
            diffs = [r["diff"] for r in cells.values() if "diff" in r]
            mean = f"{sum(diffs) / len(diffs):+.3f}" if diffs else ""
            kept_text = "1.00" if arm == "full" else ("" if kept is None else f"{kept:.2f}")
            lines.append(f"| {arm} | {kept_text} | " + " | ".join(text) + f" | {mean} |")
    pairs = results.get("versus", [])
    if pairs:
        lines += ["", "### Against the attention score, paired", "",
                  "Each arm minus the arm that differs only by `kv_scorer: attn`, over the same "
                  "documents (paired-bootstrap 95 % interval; an interval above zero: better "
                  "than `attn`).", ""]  # fmt: skip
        tasks = sorted({p["task"] for p in pairs})
        lines += ["| arm | length | " + " | ".join(tasks) + " |",
                  "|---|---|" + "---|" * len(tasks)]
        for arm, length in sorted({(p["arm"], p["length"]) for p in pairs}):
            cells = {p["task"]: p for p in pairs if p["arm"] == arm and p["length"] == length}
            text = [f"{c['diff']:+.2f} [{c['low']:+.2f}, {c['high']:+.2f}]" if c else ""
                    for c in (cells.get(t) for t in tasks)]  # fmt: skip
            lines.append(f"| {arm} | {length} | " + " | ".join(text) + " |")
    return "\n".join(lines) + "\n"


def kept_ratio(before: Snapshot, after: Snapshot) -> float | None:
    """Mean kept fraction of the prompt over the requests between two scrapes."""
    count = after.value(f"{KEPT_RATIO}_count") - before.value(f"{KEPT_RATIO}_count")
    total = after.value(f"{KEPT_RATIO}_sum") - before.value(f"{KEPT_RATIO}_sum")
    return total / count if count else None


def scrape(url: str) -> Snapshot:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        return Snapshot.parse(resp.read().decode(), time.time())


def planned_arms(args) -> list[Arm]:
    if args.arms:
        return named_arms(args.arms, full=args.full)
    return arms(args.pipelines, args.scorers, args.budgets, args.settings, args.agnostic_tail,
                full=args.full)  # fmt: skip


def run_grid(args, url: str, model: str, tokenizer: str) -> dict:
    grid = planned_arms(args)
    if args.max_gen_toks:
        grid = [Arm(a.name, {**a.fields, "max_gen_toks": args.max_gen_toks}) for a in grid]
    stub = nltk_stub(Path(tempfile.mkdtemp(prefix="nltk-stub-")))
    env = {**os.environ, "NLTK_DATA": str(stub), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    runs: dict[str, dict] = {}
    for arm in grid:
        before = scrape(url)
        started = time.monotonic()
        commands, scores = [], {}
        # One lm_eval run per length: its --limit counts a task's documents over every length
        # it builds, shortest first, so one run with several lengths scores the first only.
        for length in args.lengths:
            out = args.out / "raw" / arm.name.replace("/", "_") / str(length)
            cmd = lm_eval_command(args.lm_eval, url, model, tokenizer, arm, args.tasks,
                                  [length], args.limit, args.concurrent, out)  # fmt: skip
            print(f"[lm-eval] {arm.name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
            subprocess.run(cmd, env=env, check=True, stdout=sys.stderr)
            commands.append(cmd)
            for task, per in read_samples(out, [length]).items():
                scores.setdefault(task, {}).update(per)
        after = scrape(url)
        runs[arm.name] = {"fields": arm.fields, "command": commands, "scores": scores,
                          "seconds": time.monotonic() - started,
                          "kept_ratio": None if arm.is_full else kept_ratio(before, after)}
    return {"arms": [a.name for a in grid], "runs": runs}


def lm_eval_version(lm_eval: str) -> str:
    python = Path(lm_eval).with_name("python")
    try:
        return subprocess.run([str(python), "-c", "import lm_eval; print(lm_eval.__version__)"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip() or text.strip() == ""]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=_csv, default=list(OFFLINE_TASKS))
    p.add_argument("--lengths", type=lambda t: [int(x) for x in t.split(",")], default=[1024],
                   help="RULER max_seq_lengths (prompt tokens)")
    p.add_argument("--limit", type=int, default=50, help="documents per task and length")
    p.add_argument("--pipelines", type=_csv, default=[""],
                   help="kv_pipeline values ('' = the server's default)")
    p.add_argument("--scorers", type=_csv, default=["attn", "obcache_key"])
    p.add_argument("--budgets", type=lambda t: [float(x) for x in t.split(",")],
                   default=[0.2, 0.4], help="kv_budget fractions")
    p.add_argument("--settings", type=_csv, default=["aware", "agnostic"])
    p.add_argument("--agnostic-tail", type=int, default=96,
                   help="query-agnostic arms compress this many tokens before the prompt's end "
                   "(kv_compress_at: -TAIL; RULER's questions and answer prefixes fit)")
    p.add_argument("--arms", type=Path, default=None,
                   help="a JSON file of named arms (name -> kv_* fields), instead of the "
                   "pipelines x scorers x budgets x settings product")
    p.add_argument("--no-full", dest="full", action="store_false", help="skip the full cache")
    p.add_argument("--max-gen-toks", type=int, default=None,
                   help="cap every task's generation (RULER asks 128 tokens for most tasks; "
                   "the answers are shorter), the same in every arm")
    p.add_argument("--concurrent", type=int, default=16, help="requests lm-eval keeps in flight")
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--model", default=None, help="served model name (with --url)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path or name (with --url)")
    p.add_argument("--serve-args", default="", help="extra `obcache-vllm serve` arguments")
    p.add_argument("--lm-eval", default=os.environ.get(
                   "LM_EVAL", str(Path(sys.executable).with_name("lm_eval"))),
                   help="the lm_eval executable (default: $LM_EVAL, else the one beside this "
                   "python: the project's eval extra)")
    p.add_argument("--machine", default="the 2-core development machine (CPU)",
                   help="described in the report")
    p.add_argument("--out", type=Path, default=Path("results/lm-eval"))
    p.add_argument("--report-only", type=Path, default=None,
                   help="re-render the report from an lm_eval.json, running nothing")
    p.add_argument("--add-to", type=Path, default=None,
                   help="an lm_eval.json to add this run's arms to (new names only; its full "
                   "cache pairs with them, so give the tasks, lengths, limit and server "
                   "defaults it ran with): the report is rewritten beside it")
    p.add_argument("--add-lengths-to", type=Path, default=None,
                   help="an lm_eval.json to add this run's lengths to (the same arms, the same "
                   "tasks, limit and server defaults, lengths it has not run): a rule that "
                   "grows a length reruns only that length; the report is rewritten beside it")
    args = p.parse_args(argv)
    if args.add_to and args.add_lengths_to:
        p.error("--add-to and --add-lengths-to: one at a time")
    return args


def refuse_clashes(results: dict, names) -> None:
    """ValueError if any of the arm ``names`` is in ``results`` already."""
    clash = sorted(set(names) & set(results["arms"]))
    if clash:
        raise ValueError(f"arms already in the results: {', '.join(clash)}")


def add_run(results: dict, added: dict) -> dict:
    """``results`` (a committed lm_eval.json) with the arms of a later run ``added`` appended,
    their command recorded under ``added``; an arm name already there is refused (its
    documents would be paired with another run's)."""
    refuse_clashes(results, added["arms"])
    out = {**results, "arms": results["arms"] + added["arms"],
           "runs": {**results["runs"], **added["runs"]}}  # fmt: skip
    out["added"] = [*results.get("added", []), {
        k: added[k] for k in ("command", "date", "machine", "lm_eval_version", "seconds", "arms")}]
    return out


def recorded_lengths(results: dict) -> set[int]:
    """The prompt lengths an lm_eval.json has scores at (any arm, any task)."""
    return {int(n) for run in results["runs"].values() for per in run["scores"].values()
            for n in per}  # fmt: skip


def refuse_lengths(results: dict, names, lengths) -> None:
    """ValueError unless ``names`` are ``results``' arms, in its order, and none of
    ``lengths`` is recorded there yet."""
    if list(names) != list(results["arms"]):
        raise ValueError(f"the arms differ from the results' ({', '.join(results['arms'])})")
    again = sorted(set(map(int, lengths)) & recorded_lengths(results))
    if again:
        raise ValueError(f"lengths already in the results: {', '.join(map(str, again))}")


def add_lengths(results: dict, added: dict) -> dict:
    """``results`` (a committed lm_eval.json) with a later run of the same arms at new lengths
    ``added`` merged in: each arm's scores gain the new lengths, its lm_eval commands and
    seconds are appended, its kept fraction becomes the mean over every request (weighted by
    the documents each run scored). The arms must be the same, field for field (their
    documents pair with the full cache's at the new lengths only)."""
    refuse_lengths(results, added["arms"], recorded_lengths(added))
    runs = {}
    for name in results["arms"]:
        old, new = results["runs"][name], added["runs"][name]
        if old["fields"] != new["fields"]:
            raise ValueError(f"{name}: fields {new['fields']} differ from the results' "
                             f"{old['fields']}")
        scores = {t: dict(per) for t, per in old["scores"].items()}
        for task, per in new["scores"].items():
            scores.setdefault(task, {}).update(per)
        count = [sum(len(d) for per in r["scores"].values() for d in per.values())
                 for r in (old, new)]  # fmt: skip
        kept = None
        if old.get("kept_ratio") is not None and new.get("kept_ratio") is not None:
            kept = (old["kept_ratio"] * count[0] + new["kept_ratio"] * count[1]) / sum(count)
        runs[name] = {**old, "scores": scores, "kept_ratio": kept,
                      "command": [*old.get("command", []), *new.get("command", [])],
                      "seconds": old.get("seconds", 0.0) + new.get("seconds", 0.0)}
    out = {**results, "runs": runs}
    out["added"] = [*results.get("added", []), {
        **{k: added[k] for k in ("command", "date", "machine", "lm_eval_version", "seconds")},
        "lengths": sorted(recorded_lengths(added))}]
    return out


def _string_keys(runs: dict) -> None:
    for run in runs.values():  # JSON keys are strings
        run["scores"] = {t: {str(n): d for n, d in per.items()} for t, per in run["scores"].items()}


def rerender(path: Path) -> None:
    """Rewrite ``lm_eval.md`` (and the summaries in ``lm_eval.json``) from ``lm_eval.json``."""
    results = json.loads(path.read_text())
    runs = {name: {**run, "scores": {t: {int(n): {int(d): v for d, v in docs.items()}
                                         for n, docs in per.items()}
                                     for t, per in run["scores"].items()}}
            for name, run in results["runs"].items()}  # fmt: skip
    results["rows"] = summarize(runs)
    results["versus"] = versus(runs)
    path.write_text(json.dumps(results, indent=1) + "\n")
    path.with_suffix(".md").write_text(render(results))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report_only:
        rerender(args.report_only)
        print(args.report_only.with_suffix(".md").read_text())
        return 0
    if not Path(args.lm_eval).exists():
        print(f"lm_eval not found at {args.lm_eval}: install the eval extra (make setup)",
              file=sys.stderr)
        return 2
    if args.add_to:
        try:  # before the run, not after it
            refuse_clashes(json.loads(args.add_to.read_text()),
                           [a.name for a in planned_arms(args)])
        except (OSError, ValueError) as exc:
            print(f"--add-to {args.add_to}: {exc}", file=sys.stderr)
            return 2
    if args.add_lengths_to:
        try:
            refuse_lengths(json.loads(args.add_lengths_to.read_text()),
                           [a.name for a in planned_arms(args)], args.lengths)
        except (OSError, ValueError) as exc:
            print(f"--add-lengths-to {args.add_lengths_to}: {exc}", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if args.url:
        if not (args.model and args.tokenizer):
            print("--url needs --model and --tokenizer", file=sys.stderr)
            return 2
        grid = run_grid(args, args.url.rstrip("/"), args.model, args.tokenizer)
        model = args.model
    else:
        from obcache_vllm.model import default_model_path

        tokenizer = args.tokenizer or str(default_model_path())
        serve_args = args.serve_args.split()
        with launched(serve_args, {}, args.out / "server.log") as url:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
                model = json.load(resp)["data"][0]["id"]
            grid = run_grid(args, url, model, tokenizer)
    results = {
        "command": "python scripts/lm_eval_grid.py " + shlex.join(sys.argv[1:] if argv is None
                                                                 else argv),
        "date": time.strftime("%Y-%m-%d"), "machine": args.machine, "model": model,
        "lm_eval_version": lm_eval_version(args.lm_eval),
        "seconds": time.monotonic() - started, **grid,
    }  # fmt: skip
    if args.add_to or args.add_lengths_to:
        _string_keys(results["runs"])
        path = args.add_to or args.add_lengths_to
        merge = add_run if args.add_to else add_lengths
        path.write_text(json.dumps(merge(json.loads(path.read_text()), results), indent=1)
                        + "\n")  # fmt: skip
        rerender(path)
        print(path.with_suffix(".md").read_text())
        return 0
    results["rows"] = summarize(results["runs"])
    results["versus"] = versus(results["runs"])
    _string_keys(results["runs"])
    (args.out / "lm_eval.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "lm_eval.md").write_text(render(results))
    print((args.out / "lm_eval.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
