"""lm-evaluation-harness through the server, as `make lm-eval` runs it (short form): lm-eval's
own ``local-completions`` model, a RULER task that builds its data offline (the nltk stub), the
arms' kv_* fields as ``--gen_kwargs``, the query-agnostic arm's negative ``kv_compress_at``."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _evicted(server) -> float:
    """The server's evicted-token counter, summed over its labels."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:obcache_evicted_tokens_total{"))  # fmt: skip


def test_lm_eval_runs_ruler_through_the_server_with_each_arm(server, model_path, tmp_path):
    model = server.get_json("/v1/models")["data"][0]["id"]
    before = _evicted(server)
    cmd = [sys.executable, str(ROOT / "scripts" / "lm_eval_grid.py"), "--url", server.url,
           "--model", model, "--tokenizer", str(model_path), "--tasks", "niah_single_1",
           "--lengths", "512", "--limit", "2", "--scorers", "obcache_key", "--budgets", "0.3",
           "--settings", "agnostic", "--max-gen-toks", "12", "--concurrent", "2",
           "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((tmp_path / "lm_eval.json").read_text())
    assert results["arms"] == ["full", "obcache_key/0.3/agnostic"]
    arm = results["runs"]["obcache_key/0.3/agnostic"]
    assert arm["fields"] == {"kv_budget": 0.3, "kv_scorer": "obcache_key",
                             "kv_compress_at": -96, "max_gen_toks": 12}  # fmt: skip
    # Every document scored in both arms, paired; the budgeted arm really compressed: the
    # server's kept fraction is below 1 (0.3 of the compressed part plus the 96-token tail).
    rows = {r["arm"]: r for r in results["rows"]}
    assert rows["full"]["n"] == rows["obcache_key/0.3/agnostic"]["n"] == 2
    assert "diff" in rows["obcache_key/0.3/agnostic"]
    assert 0.3 < arm["kept_ratio"] < 0.7 and results["runs"]["full"]["kept_ratio"] is None
    assert _evicted(server) > before
    assert "| obcache_key/0.3/agnostic |" in (tmp_path / "lm_eval.md").read_text()
