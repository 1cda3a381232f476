"""Run ``engine="kvpress"`` cells through kvpress_runner.py in the kvpress venv.

The same generated samples, token ids and kept counts as the vLLM cells: every request keeps
exactly the number of document tokens the engine's budget rule keeps
(:func:`obcache_vllm.evidence.eval.cells.kept_tokens`), so both engines are compared at
equal kept counts.
Results land in the same results file, under ``engine="kvpress"``.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from obcache_vllm.evidence.eval.cells import FULL, Cell, append_result, kept_tokens
from obcache_vllm.evidence.eval.grid import KVPRESS_PER_HEAD
from obcache_vllm.evidence.eval.harness import BLOCK_SIZE, MAX_TOKENS, Harness, file_lock, summarize

RUNNER = Path(__file__).with_name("kvpress_runner.py")
RULES = ("kvpress", "obcache")


def default_python() -> str:
    env = os.environ.get("KVPRESS_PYTHON")
    if env:
        return env
    # The repository's parent, as scripts/kvpress_venv.sh defaults (../venvs/kvpress).
    return str(Path(__file__).resolve().parents[4] / "venvs" / "kvpress" / "bin" / "python")


def kvpress_request(cell: Cell, prompt, rid: str, rule: str = "kvpress") -> dict:
    """The runner's request for one sample of one cell (``rule``: the press as published, or
    ``obcache`` for snapkv with this project's rule, ``kvpress_runner.obcache_rule_snapkv``)."""
    n_doc, n_all = len(prompt.document_ids), len(prompt.ids)
    compress = n_doc if cell.setting == "query_agnostic" else n_all
    if cell.pipeline == FULL:
        kept = compress
    else:
        kept = kept_tokens(compress, cell.budget_tokens(n_doc), BLOCK_SIZE)
    return {
        "id": rid, "press": cell.pipeline, "prompt_ids": prompt.ids, "compress": compress,
        "kept": kept, "max_tokens": MAX_TOKENS[cell.task], "window": cell.window,
        "rule": rule,
    }  # fmt: skip


def run_kvpress(
    cells: Sequence[Cell],
    results: Path,
    python: str | None = None,
    model: str | None = None,
    lock: str | None = None,
    rule: str = "kvpress",
) -> list[dict]:
    """Compute the kvpress cells missing from ``results``, one runner process per cell
    (``rule``: see :func:`kvpress_request`; keep each rule's results in its own file)."""
    if rule not in RULES:
        raise SystemExit(f"no kvpress rule {rule!r}; known: {', '.join(RULES)}")
    python = python or default_python()
    if not Path(python).exists():
        raise SystemExit(f"no kvpress venv at {python}: run scripts/kvpress_venv.sh first")
    harness = Harness(results, model=model, progress=False)
    todo = [c for c in harness.pending(cells) if c.engine == "kvpress"]
    written = []
    from tqdm import tqdm

    for cell in tqdm(todo, desc="kvpress cells", unit="cell"):
        if cell.pipeline != FULL and cell.scorer not in ("attn", "-"):
            raise SystemExit(f"kvpress has no scorer {cell.scorer!r} (only attn and streaming)")
        if KVPRESS_PER_HEAD.get(cell.pipeline, True) != cell.per_head:
            raise SystemExit(f"kvpress's {cell.pipeline} press does not select with "
                             f"per_head={cell.per_head}")  # fmt: skip
        prompts = harness.prompts(cell)
        if rule != "kvpress" and cell.pipeline not in (FULL, "snapkv"):
            raise SystemExit(f"the {rule!r} rule is snapkv's; {cell.pipeline} has none")
        requests = [kvpress_request(cell, p, str(i), rule) for i, p in enumerate(prompts)]
        with tempfile.TemporaryDirectory() as tmp:
            spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.jsonl"
            spec.write_text(json.dumps({"model": harness._model_path(), "requests": requests}))
            with file_lock(lock):
                proc = subprocess.run(
                    [python, str(RUNNER), str(spec), str(out)],
                    capture_output=True, text=True, check=False,
                )  # fmt: skip
            if proc.returncode != 0:
                raise RuntimeError(f"kvpress runner failed:\n{proc.stderr[-4000:]}")
            texts = {r["id"]: r["text"] for r in map(json.loads, out.read_text().splitlines())}
        seconds = sum(
            float(line.split()[-1].rstrip("s"))
            for line in proc.stdout.splitlines()[-1:]
            if line.startswith("KVPRESS")
        )
        record = summarize(cell, prompts, [texts[r["id"]] for r in requests], seconds)
        written.append(append_result(results, cell, record))
    return written
