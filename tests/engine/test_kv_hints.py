"""kv_hints on the real engine: an orchestrator that drives the engine API (``add_request(...,
kv_hints=...)``) sets a request's kv_* options with the ``obcache.kv_options`` action; the
request's own fields win field by field; a malformed hint is refused with its reason."""

from __future__ import annotations

import pytest
from support.texts import haystack

HINT = "obcache.kv_options"


def _hints(payload, version="1"):
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    action = KvHintAction("a-1", HINT, version, payload)
    return KvHintsEnvelope(protocol_version="1", message_id="m-1", actions=[action])


def _run(engine, prompt, hints, own=None, max_tokens=8):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, extra_args=own)
    llm = engine.llm.llm_engine
    req_id = llm.add_request(f"hint-{id(params)}", {"prompt_token_ids": prompt}, params,
                             kv_hints=hints)  # fmt: skip
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                return list(out.outputs[0].token_ids), (out.kv_transfer_params or {}).get(
                    "obcache"
                )
    raise AssertionError(f"{req_id} did not finish")


def test_a_hint_sets_the_options_and_the_requests_own_fields_win(engine, tokenizer):
    prompt = tokenizer(haystack(20, seed=81)).input_ids
    _, usage = _run(engine, prompt, _hints({"kv_budget": 96, "kv_pipeline": "tova"}))
    assert usage["budget"] == 96 and usage["pipeline"] == "tova" and usage["evicted_tokens"] > 0
    _, usage = _run(engine, prompt, _hints({"kv_budget": 96, "kv_scorer": "attn"}),
                    own={"kv_budget": 128})  # fmt: skip
    assert usage["budget"] == 128 and usage["scorer"] == "attn"
    # the request's own "kv_budget": null opts out of the hint's budget: a stock request
    _, usage = _run(engine, prompt, _hints({"kv_budget": 96}), own={"kv_budget": None})
    assert usage is None
    # other components' actions alone leave a stock request
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    other = KvHintsEnvelope("1", "m-2", [KvHintAction("x", "offload.prefetch", "3", {})])
    tokens, usage = _run(engine, prompt, other)
    assert usage is None


@pytest.mark.parametrize(
    "payload, version, reason",
    [
        ({"kv_budget": 96}, "2", "version"),
        ({"kv_budget": 96, "top_p": 0.5}, "1", "kv_\\* fields only"),
        ({"kv_budget": "lots"}, "1", "kv_budget"),
    ],
)
def test_a_malformed_hint_is_refused_naming_its_field(engine, tokenizer, payload, version, reason):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    prompt = tokenizer(haystack(4, seed=82)).input_ids
    with pytest.raises(VLLMValidationError, match=reason):
        engine.llm.llm_engine.add_request("bad-hint", {"prompt_token_ids": prompt},
                                          SamplingParams(max_tokens=2),
                                          kv_hints=_hints(payload, version))  # fmt: skip
    assert not engine.llm.llm_engine.has_unfinished_requests()
