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


def test_summary_pairs_the_arms(outcome):
    samples, _, result = outcome
    summary = fid.summarize(result, [s.name for s in samples])
    assert summary["full"]["kl"][0] < 1e-5
    for name, row in summary.items():
        mean, lo, hi = row["kl"]
        assert lo <= mean <= hi, name
