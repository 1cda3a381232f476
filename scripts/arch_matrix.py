"""The supported-architectures matrix: every family of obcache_vllm/evidence/architectures.py,
a tiny random-weight model each, parity with stock vLLM and a budget against the HF reference.

Usage (about a minute per family on 2 cores)::

    .venv/bin/python scripts/arch_matrix.py                    # all families
    .venv/bin/python scripts/arch_matrix.py --families qwen3 phi3

Writes ``results/architectures/matrix.json`` and ``matrix.md`` (the table of the Supported
models page, ``docs/user_guide/models.md``). Models are written to
``~/.cache/obcache-vllm/arch-models/<family>`` (kept between runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # support.arch, support.engine

STATUS = {"served": "budgets served", "refused": "budgets refused at admission",
          "failed": "FAILED", "not run": "stock vLLM cannot run it here"}  # fmt: skip


def models_home() -> Path:
    from obcache_vllm import model

    return model.default_model_path().parent.parent / "arch-models"


def prompt_ids(tokenizer_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    from obcache_vllm.textgen import haystack

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return tok(haystack(40, seed=5)).input_ids[:640]


def table(rows: list[dict]) -> str:
    lines = ["| family | architecture | what the eviction path meets | status | stock parity "
             "| freed blocks | kept-set overlap with HF (least layer) | tokens as HF | note |",
             "|---|---|---|---|---|---:|---:|---|---|"]  # fmt: skip
    for r in rows:
        overlap = r.get("kept_overlap_min")
        lines.append(
            f"| {r['family']} | `{r['architecture']}` | {r['features']} "
            f"| {STATUS.get(r['status'], r['status'])} "
            f"| {'yes' if r.get('parity') else ('no' if 'parity' in r else '-')} "
            f"| {r.get('freed_blocks', '-')} "
            f"| {'-' if overlap is None else f'{overlap:.3f}'} "
            f"| {'yes' if r.get('tokens_equal_reference') else ('no' if 'tokens_equal_reference' in r else '-')} "  # noqa: E501
            f"| {r.get('reason', '')} |"
        )
    return "\n".join(lines)


def main() -> int:
    from obcache_vllm import model
    from obcache_vllm.evidence.architectures import BY_NAME, FAMILIES, write_model

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--families", nargs="+", default=[f.name for f in FAMILIES],
                    choices=[f.name for f in FAMILIES])
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "architectures")
    args = ap.parse_args()
    from support.arch import run_family

    tokenizer_dir = model.pull(log=lambda m: None)
    prompt = prompt_ids(tokenizer_dir)
    cores = sorted(os.sched_getaffinity(0))
    rows = []
    start = time.time()
    for name in args.families:
        family = BY_NAME[name]
        model_dir = write_model(family, models_home() / name, tokenizer_dir)
        t0 = time.time()
        row = run_family(family, model_dir, prompt, cores)
        row["seconds"] = round(time.time() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    header = (f"scripts/arch_matrix.py, {time.strftime('%Y-%m-%d')}, {len(rows)} families, "
              f"{time.time() - start:.0f} s")
    (args.out / "matrix.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    (args.out / "matrix.md").write_text(header + "\n\n" + table(rows) + "\n")
    print(table(rows))
    return 0 if all(r["status"] != "failed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
