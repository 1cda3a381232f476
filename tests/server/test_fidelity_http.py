"""Fidelity through the real server: ``obcache-vllm eval fidelity --server`` and its top-k
estimate (obcache_vllm.evidence.fidelity_topk) over HTTP on the session's ``obcache-vllm serve``.

Oracles: the full cache read again matches its reference; each budgeted arm's first
divergence is where that arm's own greedy generation over HTTP (the same options, no forcing)
first leaves the full cache's continuation, which holds only if the compressed prompt followed
by the prefilled continuation attends to what decoding it does; the arm really evicted and
freed blocks (``usage.obcache``). How close the estimate is to the whole-vocabulary KL is
checked on the engine (tests/engine/test_fidelity.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from obcache_vllm.evidence import fidelity as fid
from obcache_vllm.evidence import fidelity_topk as ft

pytestmark = [pytest.mark.server]

TOKENS = 10


@pytest.fixture(scope="module")
def samples(model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    return fid.make_samples(tok, ["code", "needle"], 1, 520, 32, seed=11)


ARMS = [
    fid.Arm("full"),
    fid.Arm("tova+obcache_key@0.25/aware", "tova", "obcache_key", 0.25, "aware"),
    fid.Arm("snapkv+attn@0.2/agnostic", "snapkv", "attn", 0.2, "agnostic"),
]


@pytest.fixture(scope="module")
def measured(server, samples):
    client = ft.HttpClient(server.url, concurrency=4)
    return client, ft.run(client, samples, ARMS, TOKENS, k=20)


def test_the_control_reads_the_reference_again(samples, measured):
    _, got = measured
    for s in samples:
        full = got["full"][s.name]
        assert full["kl_max"] < 1e-4 and full["agree"] == 1.0 and full["kept_fraction"] == 1.0
        assert len(full["continuation"]) == TOKENS


def test_first_divergence_is_where_the_arms_own_greedy_output_leaves(server, samples, measured):
    client, got = measured
    for arm in ARMS[1:]:
        for s in samples:
            stats = got[arm.name][s.name]
            kv = arm.kv(s)
            body = {"prompt": list(s.ids), "max_tokens": TOKENS, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True, **kv}  # fmt: skip
            own = client._post(body)
            tokens = own["choices"][0]["token_ids"]
            reference = stats["continuation"]
            pairs = enumerate(zip(tokens, reference, strict=True))
            first = next((i for i, (a, b) in pairs if a != b), TOKENS)
            assert stats["first_divergence"] == first, (arm.name, s.name, tokens, reference)
            usage = stats["usage"]
            assert usage["evictions"] >= 1 and usage["freed_blocks"] >= 1, usage
            assert 0.15 < stats["kept_fraction"] < 0.45, usage
            assert all(k >= 0 for k in stats["kl_by_position"]) and stats["covered"] > 0.3
            assert own["usage"]["obcache"]["evictions"] >= 1


def test_the_command_measures_a_server_and_labels_the_estimate(server, tmp_path):
    out = tmp_path / "fidelity"
    cmd = [sys.executable, "-m", "obcache_vllm.cli", "eval", "fidelity", "--server", server.url,
           "--kinds", "code", "--samples", "2", "--prompt-tokens", "400", "--tokens", "6",
           "--pipelines", "tova", "--scorers", "attn,obcache_key", "--budgets", "0.3",
           "--max-batch", "4", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "fidelity.json").read_text())
    assert results["estimate"].startswith("top-20 over HTTP")
    assert set(results["summary"]) == {"full", "tova+attn@0.3/aware", "tova+obcache_key@0.3/aware"}
    assert "kl_minus_attn" in results["summary"]["tova+obcache_key@0.3/aware"]
    report = (out / "fidelity.md").read_text()
    assert "estimate, a lower bound" in report and "tova+obcache_key@0.3/aware" in report
    refused = subprocess.run([*cmd[:7], "--decode", "--out", str(tmp_path / "x")],
                             capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert refused.returncode != 0 and "--decode needs the in-process run" in refused.stderr
