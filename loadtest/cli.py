"""Command line of the load tool (``python -m loadtest``).

    run SCENARIO [--url URL | --launch [--stock]] [--out DIR] [--set KEY=VALUE ...]
        One run; writes DIR/report.{json,md,png}; exit status 1 when a check failed.
    compare SCENARIO --out DIR [--arms stock,nobudget,mix] [--set ...] [--from-reports]
        One fresh server per arm, then DIR/compare.{json,md,png} (ratios) and one report per arm.
    parity [--out DIR] [--quick]
        Every request option of vLLM's completions and chat APIs against the plugin server and
        stock vLLM (both launched); DIR/report.{json,md}; exit status 1 on a difference or 5xx.
    fleet [--workers N] [--policy P] [--chats C] [--turns T] [--out DIR]
        N workers behind vllm-router (all launched), chats with kv_session through the router;
        DIR/report.{json,md}; exit status 1 when a check failed (loadtest/fleet.py).
    multiturn [--arms ...] [--out DIR]
        Multi-turn chats at the pool's limit, stock beside (loadtest/multiturn.py).
    routing [--policies round_robin consistent_hash kv_aware] [--out DIR]
        Documents and session chats through vllm-router, a fresh fleet per policy; TTFT,
        throughput, reuse and balance per policy (loadtest/routing.py).

Only loopback targets unless ``--allow-remote``.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from loadtest import compare, report, runner
from loadtest.scenario import load_scenario, make_plan

ROUTING_POLICIES = ("round_robin", "consistent_hash", "kv_aware")  # loadtest/routing.py


def is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("scenario", type=Path, help="scenario YAML (loadtest/scenarios/*.yaml)")
    common.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a scenario field, e.g. requests=24")
    common.add_argument("--no-progress", action="store_true", help="no progress bar")

    run_p = sub.add_parser("run", parents=[common], help="one run against one server")
    run_p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    run_p.add_argument("--launch", action="store_true",
                       help="start `obcache-vllm serve` with the scenario's server args")
    run_p.add_argument("--stock", action="store_true",
                       help="with --launch: VLLM_PLUGINS= (stock vLLM) and no kv_* fields")
    run_p.add_argument("--out", type=Path, default=None,
                       help="report folder (default results/loadtest/<scenario>-<time>)")
    run_p.add_argument("--label", default="", help="title of the report")
    run_p.add_argument("--allow-remote", action="store_true",
                       help="allow a non-loopback URL (only for your own servers)")

    cmp_p = sub.add_parser("compare", parents=[common], help="stock vs no budget vs mix")
    cmp_p.add_argument("--out", type=Path, required=True, help="report folder")
    cmp_p.add_argument("--arms", default="stock,nobudget,mix",
                       help=f"comma-separated, from {','.join(compare.ARMS)}")
    cmp_p.add_argument("--from-reports", action="store_true",
                       help="rebuild compare.* from the arm reports already in --out")
    par_p = sub.add_parser("parity", help="every request option: plugin vs stock vLLM")
    par_p.add_argument("--out", type=Path, default=Path("results/parity"), help="report folder")
    par_p.add_argument("--quick", action="store_true", help="one value per field (the suite's)")
    fleet_p = sub.add_parser("fleet", help="workers behind vllm-router, chats through it")
    fleet_p.add_argument("--workers", type=int, default=2)
    fleet_p.add_argument("--policy", default="consistent_hash",
                         help="vllm-router --policy (consistent_hash: X-Session-ID affinity)")
    fleet_p.add_argument("--chats", type=int, default=4)
    fleet_p.add_argument("--turns", type=int, default=3)
    fleet_p.add_argument("--plain", type=int, default=4, help="unbudgeted requests beside them")
    fleet_p.add_argument("--out", type=Path, default=Path("results/fleet"), help="report folder")
    mt_p = sub.add_parser("multiturn", help="multi-turn chats at the pool's limit, stock beside")
    mt_p.add_argument("--arms", nargs="+",
                      default=["stock", "session", "policy", "policy-session-id"],
                      choices=multiturn_arms(),
                      help="arms; ARM:before runs ARM with the hold policy of the release "
                      "before (least recently used first, base share only)")
    mt_p.add_argument("--conversations", type=int, default=8)
    mt_p.add_argument("--clients", type=int, default=2)
    mt_p.add_argument("--active", type=int, default=4, help="active conversations (all clients)")
    mt_p.add_argument("--pool-blocks", type=int, default=96, help="KV pool, blocks of 32 tokens")
    mt_p.add_argument("--seed", type=int, default=0)
    mt_p.add_argument("--shape", default="light", choices=["light", "vllm"],
                      help="conversation shape: light (6-8 turns, ~600-token documents) or "
                      "vllm (vLLM's multi-turn client: 12-16 turns, 800-1,200-token documents)")
    mt_p.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE",
                      help="server environment of every arm but stock (e.g. a hold policy)")
    mt_p.add_argument("--out", type=Path, default=Path("results/multiturn"), help="report folder")
    rt_p = sub.add_parser("routing", help="documents and chats through vllm-router, per policy")
    rt_p.add_argument("--policies", nargs="+", default=list(ROUTING_POLICIES),
                      choices=list(ROUTING_POLICIES))
    rt_p.add_argument("--workers", type=int, default=2)
    rt_p.add_argument("--docs", type=int, default=4)
    rt_p.add_argument("--questions", type=int, default=4, help="questions per document")
    rt_p.add_argument("--doc-clients", type=int, default=2)
    rt_p.add_argument("--chats", type=int, default=4)
    rt_p.add_argument("--turns", type=int, default=4)
    rt_p.add_argument("--max-tokens", type=int, default=16)
    rt_p.add_argument("--seed", type=int, default=0)
    rt_p.add_argument("--stock", action="store_true", help="stock vLLM workers (no plugin)")
    rt_p.add_argument("--router-args", nargs="*", default=[], help="more vllm-router flags")
    rt_p.add_argument("--out", type=Path, default=Path("results/routing"), help="report folder")
    return ap


def _routing(args: argparse.Namespace) -> int:
    from loadtest import routing

    return routing.main(args)


def multiturn_arms() -> list[str]:
    from loadtest import multiturn

    return multiturn.arm_names()


def _multiturn(args: argparse.Namespace) -> int:
    from loadtest import multiturn

    return multiturn.main(args)


def _fleet(args: argparse.Namespace) -> int:
    from loadtest import fleet

    report = fleet.launch_and_run(args.out, args.workers, args.policy, args.chats, args.turns,
                                  args.plain)  # fmt: skip
    fleet.write_report(report, args.out)
    print((args.out / "report.md").read_text())
    return 0 if report["passed"] else 1


def _parity(args: argparse.Namespace) -> int:
    from loadtest import parity

    report = parity.launch_and_run(args.out, quick=args.quick)
    parity.write_report(report, args.out)
    keys = ("stock_cases", "stock_differences", "budgeted_cases", "budgeted_5xx",
            "budgeted_4xx_without_reason", "fields_without_values")
    print({k: report[k] for k in keys})
    print(f"wrote {args.out / 'report.md'}")
    bad = report["stock_differences"] or report["budgeted_5xx"] or report["fields_without_values"]
    return 1 if bad or report["budgeted_4xx_without_reason"] else 0


def _run(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario, args.overrides)
    if args.stock:
        scenario = scenario.without_budgets()
    out = args.out or Path("results/loadtest") / f"{scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    plans = make_plan(scenario)
    if args.launch:
        from loadtest.launch import launched

        env = {**scenario.server.env, **({"VLLM_PLUGINS": ""} if args.stock else {})}
        with launched(scenario.server.args, env, out / "server.log") as url:
            result = asyncio.run(runner.run(scenario, plans, url, args.label,
                                            not args.no_progress))
    else:
        if not is_loopback(args.url) and not args.allow_remote:
            print(f"refusing non-loopback target {args.url} (use --allow-remote for your own "
                  "servers)", file=sys.stderr)
            return 2
        result = asyncio.run(runner.run(scenario, plans, args.url, args.label,
                                        not args.no_progress))
    summary = report.summarize(result)
    paths = report.write(summary, out)
    print(report.markdown(summary))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if summary["passed"] else 1


def _compare(args: argparse.Namespace) -> int:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in compare.ARMS]
    if unknown:
        print(f"unknown arm {unknown[0]!r}; known: {', '.join(compare.ARMS)}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_reports:
        summaries = compare.load_summaries(args.out, arms)
        for key, summary in zip(arms, summaries, strict=True):  # the tables, as of this code
            (args.out / f"{key}.md").write_text(report.markdown(summary))
    else:
        scenario = load_scenario(args.scenario, args.overrides)
        summaries = []
        for key in arms:
            summaries.append(compare.run_arm(scenario, compare.ARMS[key], args.out,
                                             not args.no_progress))
    paths = compare.write(summaries, args.out)
    print(compare.markdown(compare.comparison(summaries)))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if all(s["passed"] for s in summaries) else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        commands = {"run": _run, "compare": _compare, "parity": _parity, "fleet": _fleet,
                    "multiturn": _multiturn, "routing": _routing}
        return commands[args.command](args)
    except KeyboardInterrupt:
        return 130
