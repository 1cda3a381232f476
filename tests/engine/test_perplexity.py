"""Teacher forcing on the real engine: exact tokens, raw log-probs, eviction while forcing."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from support.engine import POOL_BLOCKS
from support.texts import haystack

from obcache_vllm.evidence import perplexity as ppl
from obcache_vllm.evidence.forcing import (
    ForcedRequest,
    ForceTokensProcessor,
    forced_params,
    run_forced,
)

BS = 32
BUDGET = 128
PROMPT = 32
FORCED = 400


def _text_ids(tokenizer) -> tuple[str, list[int]]:
    """Genesis when bible-kjv is installed (as `make setup` does), else the seeded haystack."""
    if shutil.which("bible"):
        return "Genesis", tokenizer(ppl.kjv_book("Genesis")).input_ids
    return "haystack", tokenizer(haystack(60, seed=11)).input_ids


def test_processor_tracks_batch_rows_through_adds_moves_and_removals():
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    proc = ForceTokensProcessor(None, torch.device("cpu"), False)
    out_a, out_b = [], [7]
    added = [(0, forced_params([5, 6]), [1], out_a), (1, forced_params([2, 3]), [1], out_b),
             (2, None, [1], [])]
    proc.update_state(BatchUpdate(3, removed=[], added=added, moved=[]))
    logits = proc.apply(torch.zeros(3, 10))
    assert logits[0].argmax() == 5 and logits[1].argmax() == 3  # b already emitted one token
    assert torch.isinf(logits[0]).sum() == 9 and not torch.isinf(logits[2]).any()
    proc.update_state(BatchUpdate(3, removed=[], added=[],
                                  moved=[(0, 1, MoveDirectionality.SWAP)]))
    out_a.append(5)
    logits = proc.apply(torch.zeros(3, 10))
    assert logits[1].argmax() == 6 and logits[0].argmax() == 3
    proc.update_state(BatchUpdate(1, removed=[1], added=[],
                                  moved=[(0, 2, MoveDirectionality.UNIDIRECTIONAL)]))
    assert list(proc.rows) == [2]
    from vllm import SamplingParams

    with pytest.raises(ValueError, match="forced_tokens"):
        ForceTokensProcessor.validate_params(SamplingParams(extra_args={"forced_tokens": ["a"]}))
    ForceTokensProcessor.validate_params(SamplingParams())  # not opted in: fine


@pytest.mark.slow
def test_teacher_forcing_matches_prompt_logprobs_and_evicts(engine, tokenizer):
    from vllm import SamplingParams

    name, ids = _text_ids(tokenizer)
    doc = ppl.make_document(name, ids, PROMPT, FORCED)
    methods = ppl.methods([BUDGET], scorers=["obcache_key"])  # full, streaming, h2o+obcache_key
    assert [m.name for m in methods] == ["full", "streaming@128", "h2o+obcache_key@128"]
    requests = [ForcedRequest(m.name, list(doc.prompt), list(doc.target), m.kv) for m in methods]
    outcome = run_forced(engine.llm, requests)

    # The forced tokens are the text's, whatever the cache held.
    for m in methods:
        assert outcome[m.name].tokens == list(doc.target), m.name
        assert len(outcome[m.name].logprobs) == FORCED

    # Full cache: the raw log-prob of each forced token is the model's, i.e. what a
    # prompt_logprobs pass over the same text gives (decode vs prefill kernels: fp32 rounding).
    full = torch.tensor(outcome["full"].logprobs)
    ref = engine.llm.generate(
        [{"prompt_token_ids": list(doc.prompt) + list(doc.target)}],
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False,
    )[0].prompt_logprobs
    expected = torch.tensor([ref[PROMPT + i][t].logprob for i, t in enumerate(doc.target)])
    diff = (full - expected).abs()
    print(f"forced vs prompt_logprobs: max |diff| {float(diff.max()):.2e}, "
          f"mean {float(diff.mean()):.2e} over {FORCED} tokens")
    assert diff.max() < 1e-3, float(diff.max())  # measured: 4e-5
    assert full.min() < -1.0  # not the forced distribution (that would be all zeros)

    # Budgeted: the same log-probs until the first eviction, different after it.
    first_evict = BUDGET + BS - PROMPT  # the cache first holds a whole block over budget here
    for m in methods[1:]:
        got = outcome[m.name]
        lp = torch.tensor(got.logprobs)
        assert (lp[: first_evict - 1] - full[: first_evict - 1]).abs().max() < 2e-3, m.name
        assert (lp[first_evict + 8 :] - full[first_evict + 8 :]).abs().max() > 1e-2, m.name
        assert got.max_resident_tokens < BUDGET + BS, m.name
        assert got.max_live_blocks <= -(-(BUDGET + BS) // BS), m.name
        assert got.evictions >= (PROMPT + FORCED - BUDGET) // BS - 1, m.name
    assert outcome["full"].max_live_blocks == -(-(PROMPT + FORCED) // BS)
    assert outcome["full"].evictions == 0

    # Streaming keeps the 4 sinks and a contiguous recent window (StreamingLLM).
    iid = [k for k in engine.runner.obcache.records if k.startswith("streaming@128")]
    record = engine.runner.obcache.records[iid[-1]]
    keep = next(v for k, v in record.items() if ":" not in k)  # [Hkv, K] one layer
    assert (keep[:, : ppl.SINKS] == torch.arange(ppl.SINKS)).all()
    assert (keep[:, ppl.SINKS + 1 :] - keep[:, ppl.SINKS : -1] == 1).all()
    assert keep.shape[1] >= BUDGET

    # Perplexity is finite.
    nll = {m.name: -sum(outcome[m.name].logprobs) / FORCED for m in methods}
    assert all(math.isfinite(v) and v > 0 for v in nll.values()), nll
    assert engine.free_blocks() == POOL_BLOCKS - 1
