"""A request's kv_* options are parsed and resolved once, in the front end; EngineCore and the
worker only decode the admitted wire form (obcache_vllm/admission.py).

On the session's in-process engine, where the front end, the scheduler and the worker share
this process, so a spy on the option functions sees every call any of them makes.
"""

from __future__ import annotations

from collections import Counter

import pytest
from support.texts import haystack

from obcache_vllm import admission, options

pytestmark = pytest.mark.engine


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """Counts of parse_request (wherever it is called from), KvRequest.resolve and
    KvOptions.from_wire during the test."""
    counts: Counter = Counter()

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(admission, "parse_request", spy("parse_request", admission.parse_request))
    monkeypatch.setattr(admission, "resolve", spy("resolve", admission.resolve))
    from_wire = options.KvOptions.from_wire.__func__
    monkeypatch.setattr(options.KvOptions, "from_wire",
                        classmethod(spy("from_wire", from_wire)))  # fmt: skip
    return counts


def _generate(engine, prompt: list[int], extra: dict | None, max_tokens: int = 24):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args=extra)  # fmt: skip
    out = engine.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return out[0]


def test_options_are_parsed_and_resolved_once_per_request(engine, tokenizer, calls) -> None:
    prompt = tokenizer(haystack(12, seed=4)).input_ids
    out = _generate(engine, prompt, {"kv_budget": 96, "kv_decode": True, "kv_pipeline": "tova"})
    outcome = out.kv_transfer_params["obcache"]
    assert outcome["evictions"] >= 2  # the prefill and decode steps both evicted
    assert calls["parse_request"] == 1 and calls["resolve"] == 1, calls
    assert calls["from_wire"] >= 1  # decoded in EngineCore (and the worker), never re-parsed


def test_an_unbudgeted_request_is_never_parsed_past_the_front_end(engine, tokenizer,
                                                                   calls) -> None:  # fmt: skip
    prompt = tokenizer(haystack(4, seed=4)).input_ids
    out = _generate(engine, prompt, None, max_tokens=4)
    assert out.kv_transfer_params is None
    assert calls["resolve"] == 0 and calls["from_wire"] == 0, calls
