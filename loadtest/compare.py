"""Compare runs of one scenario: stock vLLM, obcache-vllm without budgets, obcache-vllm with the
scenario's budget mix. Each arm gets a fresh server (same ``server.args``; the stock arm with
``VLLM_PLUGINS=``, the plugin disabled in the same install), the same planned requests (same
prompts, lengths, seeds, kinds; the no-budget arms have every ``kv_*`` field removed), and its
own report; the comparison puts their figures side by side with ratios to the first arm and
of the budget mix to the plugin without budgets.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest import report, runner
from loadtest.launch import launched
from loadtest.scenario import Scenario, make_plan


@dataclass(frozen=True)
class Arm:
    key: str
    title: str
    env: dict[str, str]
    budgets: bool


ARMS = {
    "stock": Arm("stock", "stock vLLM (VLLM_PLUGINS=)", {"VLLM_PLUGINS": ""}, False),
    "nobudget": Arm("nobudget", "obcache-vllm, no budget", {}, False),
    "mix": Arm("mix", "obcache-vllm, budget mix", {}, True),
}

# (key in the run summary, section, higher is better?)
ROWS = (
    ("request_throughput", "metrics", True),
    ("output_throughput", "metrics", True),
    ("request_goodput", "metrics", True),
    ("mean_ttft_ms", "metrics", False),
    ("median_ttft_ms", "metrics", False),
    ("p99_ttft_ms", "metrics", False),
    ("mean_tpot_ms", "metrics", False),
    ("p99_tpot_ms", "metrics", False),
    ("mean_itl_ms", "metrics", False),
    ("p99_itl_ms", "metrics", False),
    ("mean_e2el_ms", "metrics", False),
    ("p99_e2el_ms", "metrics", False),
    ("duration_s", "metrics", False),
    ("kv_usage_mean", "server", None),
    ("running_mean", "server", None),
    ("running_max", "server", None),
    ("waiting_max", "server", None),
    ("preemptions", "server", None),
    ("obcache_evicted_tokens", "server", None),
)


def run_arm(scenario: Scenario, arm: Arm, out_dir: Path, progress: bool = True) -> dict:
    """Launch a server for ``arm``, run the scenario against it, write ``<arm>.{json,md,png}``."""
    sc = scenario if arm.budgets else scenario.without_budgets()
    env = {**sc.server.env, **arm.env}
    with launched(sc.server.args, env, out_dir / f"{arm.key}.server.log") as url:
        result = asyncio.run(runner.run(sc, make_plan(sc), url, label=arm.title,
                                        progress=progress))
    summary = report.summarize(result)
    summary["arm"] = arm.key
    summary["server_args"] = sc.server.args
    summary["server_env"] = env
    report.write(summary, out_dir, stem=arm.key)
    return summary


def _ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, int | float) or not isinstance(b, int | float) or not b:
        return None
    return a / b


def comparison(summaries: list[dict]) -> dict[str, Any]:
    """Figures per arm and ratios: each arm / the first arm, and mix / nobudget."""
    by = {s.get("arm", s["label"]): s for s in summaries}
    base = summaries[0]
    rows = []
    for key, section, better in ROWS:
        vals = {arm: s[section].get(key) for arm, s in by.items()}
        row = {"metric": key, "higher_is_better": better, "values": vals,
               "ratio_to_first": {arm: _ratio(v, base[section].get(key))
                                  for arm, v in vals.items()}}
        if "mix" in by and "nobudget" in by:
            row["mix_over_nobudget"] = _ratio(vals["mix"], vals["nobudget"])
        rows.append(row)
    return {
        "scenario": base["scenario"],
        "arms": [{"arm": a, "label": s["label"], "passed": s["passed"],
                  "counts": s["counts"], "server_args": s.get("server_args")}
                 for a, s in by.items()],
        "rows": rows,
    }


def markdown(comp: dict[str, Any]) -> str:
    arms = [a["arm"] for a in comp["arms"]]
    first = arms[0]
    head = "| metric | " + " | ".join(arms) + " | " + " | ".join(
        f"{a} / {first}" for a in arms[1:]) + (" | mix / nobudget |" if "mix" in arms
                                                and "nobudget" in arms else " |")
    lines = [f"### Comparison: scenario `{comp['scenario']['name']}`", "",
             head, "|---|" + "---:|" * (head.count("|") - 2)]
    for row in comp["rows"]:
        vals = [report._fmt(row["values"][a], 3) for a in arms]
        ratios = [report._fmt(row["ratio_to_first"][a], 3) for a in arms[1:]]
        extra = [report._fmt(row["mix_over_nobudget"], 3)] if "mix_over_nobudget" in row else []
        lines.append(f"| {row['metric']} | " + " | ".join(vals + ratios + extra) + " |")
    lines += ["", "| arm | label | checks | counts |", "|---|---|---|---|"]
    for a in comp["arms"]:
        counts = {k: v for k, v in a["counts"].items() if v}
        lines.append(f"| {a['arm']} | {a['label']} | {'pass' if a['passed'] else 'FAIL'} | "
                     f"{json.dumps(counts)} |")
    return "\n".join(lines) + "\n"


def write(summaries: list[dict], out_dir: Path) -> list[Path]:
    comp = comparison(summaries)
    paths = [out_dir / "compare.json", out_dir / "compare.md", out_dir / "compare.png"]
    paths[0].write_text(json.dumps(comp, indent=1) + "\n")
    paths[1].write_text(markdown(comp))
    report.plot(summaries, paths[2])
    return paths


def load_summaries(out_dir: Path, arms: list[str]) -> list[dict]:
    """The arm reports already in ``out_dir`` (to rebuild a comparison without rerunning)."""
    return [json.loads((out_dir / f"{a}.json").read_text()) for a in arms]
