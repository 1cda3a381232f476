"""Fidelity to the full cache on the real engine: the worker's processor compares every
position of every arm with the full cache's distribution (obcache_vllm.evidence.fidelity).

Oracles: the full cache run again (a control in the same batch as the budgeted arms) differs
from its reference by float noise only; the reference's argmax at each position is the
token the full cache generated there; the arm's distribution the processor compared is the
one vLLM sampled from (its raw log-probability of each forced token, returned by vLLM, equals
the processor's). The engine's 256-token steps cut these prompts into several chunks, so the
processor also sees rows whose prefill is partial (vLLM samples and discards them).
"""

from __future__ import annotations

import math

import pytest

from obcache_vllm.evidence import fidelity as fid

pytestmark = [pytest.mark.engine]

TOKENS = 12


@pytest.fixture(scope="module")
def outcome(engine, tokenizer):
    samples = fid.make_samples(tokenizer, ["code", "needle"], 1, 600, 32, seed=5)
    arms = [
        fid.Arm("full"),
        fid.Arm("tova+obcache_key@0.25/aware", "tova", "obcache_key", 0.25, "aware"),
        fid.Arm("snapkv+attn@0.25/agnostic", "snapkv", "attn", 0.25, "agnostic"),
        fid.Arm("tova+attn@0.25/aware+decode", "tova", "attn", 0.25, "aware", decode=True),
        # A named selection (`eval fidelity --arms`): its fields whole, window 8 included.
        *fid.named_arms({"snap-w8-dropkv": {"kv_pipeline": "snapkv", "kv_scorer": "dropkv",
                                            "kv_window": 8}}, [0.25], ["aware"])[1:],
    ]
    result = fid.run(engine.llm, samples, arms, TOKENS)
    return samples, arms, result


def test_the_control_matches_its_reference(outcome):
    samples, _, result = outcome
    for s in samples:
        full = result["full"][s.name]
        assert full["first_divergence"] == TOKENS and full["agree"] == 1.0
        assert full["kl_max"] < 1e-5, full["kl_by_position"]
        assert full["kept_fraction"] == 1.0


def test_the_reference_is_the_full_caches_greedy_continuation(outcome):
    samples, _, result = outcome
    for s in samples:
        refs = fid.STORE.references[s.name]
        assert sorted(refs) == list(range(TOKENS))
        for step, row in refs.items():  # the forced token was the reference's argmax
            lp = result["full"][s.name]["logprobs"][step]
            assert math.isclose(float(row.max()), lp, rel_tol=1e-4, abs_tol=1e-5)


def test_budgeted_arms_are_compared_on_the_distribution_vllm_sampled_from(outcome):
    samples, arms, result = outcome
    for arm in arms[1:]:
        for s in samples:
            got = result[arm.name][s.name]
            stored = fid.STORE.positions[f"{arm.name}|{s.name}"]
            for step, lp in enumerate(got["logprobs"]):
                assert math.isclose(stored[step][2], lp, rel_tol=1e-4, abs_tol=1e-5)
            assert 0.2 < got["kept_fraction"] < 0.4, got["usage"]
            assert got["usage"]["evictions"] >= 1
            assert all(k >= -1e-6 for k in got["kl_by_position"])
        # Eviction changed the distributions (the first token too, but for query-agnostic
        # arms: the question is prefilled on the compressed cache).
        assert max(max(result[arm.name][s.name]["kl_by_position"]) for s in samples) > 1e-3
    decode = result["tova+attn@0.25/aware+decode"]
    assert all(decode[s.name]["usage"]["evictions"] >= 1 for s in samples)


def test_a_named_arm_runs_the_selection_it_names(outcome):
    samples, _, result = outcome
    for s in samples:
        usage = result["snap-w8-dropkv@0.25/aware"][s.name]["usage"]
        assert (usage["pipeline"], usage["scorer"]) == ("snapkv", "dropkv"), usage


def test_summary_pairs_the_arms(outcome):
    samples, _, result = outcome
    summary = fid.summarize(result, [s.name for s in samples])
    assert summary["full"]["kl"][0] < 1e-5
    for name, row in summary.items():
        mean, lo, hi = row["kl"]
        assert lo <= mean <= hi, name


@pytest.fixture(scope="module")
def estimate(engine, outcome):
    """The top-k estimate (what `eval fidelity --server` computes from a server's answers) on
    the same engine, prompts and arms, decode arms left out (decode cannot be forced there)."""
    from obcache_vllm.evidence import fidelity_topk as ft

    samples, arms, _ = outcome
    arms = [a for a in arms if not a.decode]
    return arms, ft.run(ft.EngineClient(engine.llm), samples, arms, TOKENS, k=20)


def test_topk_estimate_reads_the_same_continuation_and_control(outcome, estimate):
    samples, _, _ = outcome
    _, got = estimate
    for s in samples:
        refs = fid.STORE.references[s.name]
        assert got["full"][s.name]["continuation"] == [int(refs[i].argmax()) for i in range(TOKENS)]
        assert got["full"][s.name]["kl_max"] < 1e-5 and got["full"][s.name]["agree"] == 1.0


def test_topk_estimate_agrees_with_the_whole_vocabulary_measure(outcome, estimate):
    """Top-1 agreement, first divergence and kept tokens are the offline run's exactly (the
    prompt compressed at its end, then the continuation prefilled, attends to what decoding
    it did); the KL estimate is a lower bound of the exact KL at every position and close to
    it in the mean."""
    samples, _, exact = outcome
    arms, got = estimate
    sums = [0.0, 0.0]
    for arm in arms[1:]:
        for s in samples:
            e, g = exact[arm.name][s.name], got[arm.name][s.name]
            assert g["agree"] == e["agree"] and g["first_divergence"] == e["first_divergence"]
            assert g["kept_fraction"] == pytest.approx(e["kept_fraction"]), g["usage"]
            for k_est, k_exact in zip(g["kl_by_position"], e["kl_by_position"], strict=True):
                assert k_est <= k_exact + 1e-4, (arm.name, s.name)
            sums[0] += g["kl"]
            sums[1] += e["kl"]
            assert g["covered"] > 0.5
    print(f"top-20 KL estimate / exact KL: {sums[0] / sums[1]:.3f}")
    assert sums[0] >= 0.8 * sums[1], sums


def test_chats_are_written_by_the_model_and_measured(engine, tokenizer):
    """The chats kind on the engine: the assistant turns are the model's own greedy replies,
    and a query-agnostic arm compresses the conversation before its last question."""
    reply = fid.greedy_replies(engine.llm)
    samples = fid.make_samples(tokenizer, ["chats"], 1, 700, 32, seed=2, reply=reply)
    (sample,) = samples
    text = tokenizer.decode(sample.ids)
    turns = text.split("<|im_start|>assistant\n")[1:-1]  # the replies, not the open last turn
    assert len(turns) >= 2 and all(t.split("<|im_end|>")[0].strip() for t in turns)
    arms = [fid.Arm("full"), fid.Arm("tova+obcache_key@0.3/agnostic", "tova", "obcache_key",
                                     0.3, "agnostic")]  # fmt: skip
    result = fid.run(engine.llm, samples, arms, TOKENS)
    assert result["full"][sample.name]["kl_max"] < 1e-5
    got = result[arms[1].name][sample.name]
    assert got["usage"]["evictions"] >= 1 and got["usage"]["compress_at"] == sample.point
    assert got["kept_fraction"] < 0.6


@pytest.mark.fp8_kv
def test_a_reference_from_another_kv_cache_dtype_measures_that_cache_itself(tmp_path):
    """``--reference-kv-cache-dtype auto`` with ``--kv-cache-dtype fp8``: the reference (its
    continuation and distributions) from an fp32 engine, every arm on an fp8 one, so the
    ``full`` arm measures what the fp8 cache alone costs (above zero, small: its argmax is the
    reference's almost everywhere). A reference taken from the fp8 engine would give it 0."""
    import json
    import subprocess
    import sys

    out = tmp_path / "fid"
    cmd = [sys.executable, "-m", "obcache_vllm.cli", "eval", "fidelity", "--kinds", "code",
           "--samples", "2", "--prompt-tokens", "400", "--tokens", "8", "--pipelines", "tova",
           "--scorers", "obcache_key", "--budgets", "0.25", "--kv-cache-dtype", "fp8",
           "--reference-kv-cache-dtype", "auto", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "fidelity.json").read_text())
    assert (results["kv_cache_dtype"], results["reference_kv_cache_dtype"]) == ("fp8", "auto")
    full = results["per_request"]["full"]
    assert all(0 < r["kl"] < 0.5 and r["agree"] >= 0.5 for r in full.values()), full
    assert "the `auto` KV cache's" in (out / "fidelity.md").read_text()
