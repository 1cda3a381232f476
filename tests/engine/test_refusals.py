"""What budgeted requests are refused with (admission.py), on real vLLM config objects.

Each case is a shallow copy of the session engine's real ``VllmConfig`` with one real
sub-config (itself a copy) changed, so the checks read vLLM's own attributes and properties
(``ModelConfig.use_mla`` from the architecture config, the scheduler class through vLLM's
``get_scheduler_cls``). Unbudgeted requests are never refused. The end-to-end 400s are in
tests/server/test_refusals_server.py; the prompt-embeds path on a real engine is in
``test_prompt_embeds_budget_is_refused_and_the_engine_keeps_serving`` below.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys

import pytest
from support.engine import ENGINE_KWARGS, PROBES

from obcache_vllm import admission as support
from obcache_vllm.options import KvOptionsError
from obcache_vllm.vllm_ext.frontend import intake
from obcache_vllm.vllm_ext.frontend.server import admit_rendered_prompt

BUDGET = {"kv_budget": 64}


def check_rendered_prompt(handler, inputs, fields):
    """The server's admission of one rendered prompt, for a request with these kv_* fields."""
    from types import SimpleNamespace

    requested = support.parse(fields)
    extra = {} if requested is None else {support.REQUESTED_KEY: requested}
    gate = support.Admission.for_engine(handler.engine_client.vllm_config, "cpu")
    admit_rendered_prompt(gate, inputs, SimpleNamespace(extra_args=extra, max_tokens=8))


def admit_fields(vllm_config, fields, num_prompt_tokens):
    """Stages 1 and 2 of admission on these kv_* fields: the resolved options, or None."""
    requested = support.parse(fields)
    gate = support.Admission.for_engine(vllm_config, "cpu")
    admitted = None if requested is None else gate.admit(requested,
                                                         support.Prompt(num_prompt_tokens))
    return None if admitted is None else admitted.options


def _copy(obj, **attrs):
    new = copy.copy(obj)
    for name, value in attrs.items():
        object.__setattr__(new, name, value)
    return new


def _plain_scheduler():
    from vllm.v1.core.sched.scheduler import Scheduler

    class PlainScheduler(Scheduler):  # the user's own scheduler, not ours
        pass

    return PlainScheduler


def _our_subclass():
    from obcache_vllm.vllm_ext.engine.scheduler import OBCacheScheduler

    class MyOBCacheScheduler(OBCacheScheduler):
        pass

    return MyOBCacheScheduler


def _kv_shared(c):
    text = _copy(c.model_config.hf_text_config, num_kv_shared_layers=10)
    return {"model_config": _copy(c.model_config, hf_text_config=text)}


def _mla(c):
    arch = dataclasses.replace(c.model_config.model_arch_config, is_deepseek_mla=True)
    return {"model_config": _copy(c.model_config, model_arch_config=arch)}


REFUSED = [
    pytest.param(
        lambda c: {"scheduler_config": _copy(c.scheduler_config, async_scheduling=True)},
        "async scheduling",
        id="async-scheduling",
    ),
    pytest.param(
        lambda c: {"scheduler_config": _copy(c.scheduler_config, scheduler_cls=_plain_scheduler())},
        "PlainScheduler is not supported",
        id="user-scheduler-class",
    ),
    pytest.param(
        lambda c: {
            "scheduler_config": _copy(
                c.scheduler_config,
                scheduler_cls="vllm.v1.core.sched.async_scheduler.AsyncScheduler",
            )
        },
        "--scheduler-cls vllm.v1.core.sched.async_scheduler.AsyncScheduler is",
        id="vllm-async-scheduler-by-name",
    ),
    pytest.param(
        lambda c: {"scheduler_config": _copy(c.scheduler_config, scheduler_cls="nowhere.Nothing")},
        "could not be checked",
        id="unresolvable-scheduler",
    ),
    pytest.param(_kv_shared, "KV-sharing layers (10 layers", id="kv-sharing"),
    pytest.param(_mla, "MLA", id="mla"),
    pytest.param(
        lambda c: {"parallel_config": _copy(c.parallel_config, decode_context_parallel_size=2)},
        "decode_context_parallel_size=2",
        id="decode-context-parallel",
    ),
    pytest.param(
        lambda c: {"parallel_config": _copy(c.parallel_config, prefill_context_parallel_size=2)},
        "prefill_context_parallel_size=2",
        id="prefill-context-parallel",
    ),
]


@pytest.mark.parametrize("change, needle", REFUSED)
def test_unsupported_configuration_refuses_budgets_only(llm, change, needle):
    config = llm.llm_engine.vllm_config
    assert support.engine_refusal(config, support.CAPABILITIES["cpu"]) is None
    fake = _copy(config, **change(config))
    reason = support.engine_refusal(fake, support.CAPABILITIES["cpu"])
    assert reason is not None and needle in reason, reason
    with pytest.raises(KvOptionsError) as info:
        admit_fields(fake, BUDGET, 500)
    assert info.value.field == "kv_budget" and str(info.value) == f"kv_budget: {reason}"
    # Without a budget the request is a stock one: never refused.
    assert admit_fields(fake, None, 500) is None
    assert admit_fields(fake, {"vllm_other": 1}, 500) is None


@pytest.mark.parametrize(
    "scheduler_cls",
    [
        pytest.param(None, id="default"),
        pytest.param("vllm.v1.core.sched.scheduler.Scheduler", id="vllm-scheduler-by-name"),
        pytest.param("obcache_vllm.vllm_ext.engine.scheduler.OBCacheScheduler", id="ours-by-name"),
        pytest.param("subclass-of-ours", id="subclass-of-ours"),
    ],
)
def test_our_scheduler_and_its_subclasses_are_accepted(llm, scheduler_cls):
    if scheduler_cls == "subclass-of-ours":
        scheduler_cls = _our_subclass()
    config = llm.llm_engine.vllm_config
    fake = _copy(
        config, scheduler_config=_copy(config.scheduler_config, scheduler_cls=scheduler_cls)
    )
    assert support.engine_refusal(fake, support.CAPABILITIES["cpu"]) is None
    assert admit_fields(fake, BUDGET, 500).budget == 64


def test_both_rankings_are_admitted_under_tensor_parallelism(llm):
    """Run in vLLM's TP=3 engine: tests/engine/test_tensor_parallel_engine.py."""
    config = llm.llm_engine.vllm_config
    tp2 = _copy(config, parallel_config=_copy(config.parallel_config, tensor_parallel_size=2))
    assert not admit_fields(tp2, {**BUDGET, "kv_per_head": False}, 500).per_head
    assert admit_fields(tp2, {**BUDGET, "kv_per_head": True}, 500).per_head
    assert admit_fields(tp2, BUDGET, 500).per_head  # the built-in default: per head


def test_window_beyond_the_context_is_refused(llm):
    config = llm.llm_engine.vllm_config
    context = config.model_config.max_model_len
    with pytest.raises(KvOptionsError) as info:
        admit_fields(config, {**BUDGET, "kv_window": context + 1}, 500)
    assert info.value.field == "kv_window" and str(context) in str(info.value)
    assert admit_fields(config, {**BUDGET, "kv_window": context}, 500).window == context


def test_prompt_embeds_requests_are_refused_at_both_front_end_checks(llm):
    """The input processor's check, on a real ``EngineCoreRequest``, and the server's check
    where the handler hands the prompt to the engine (``AsyncLLM.generate``), on a real
    ``EmbedsInput`` through vLLM's own prompt extraction."""
    import torch
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.inputs.engine import embeds_input, tokens_input
    from vllm.v1.engine import EngineCoreRequest

    config = llm.llm_engine.vllm_config
    embeds = torch.zeros(300, config.model_config.get_hidden_size())

    def request(extra):
        return EngineCoreRequest(
            request_id="embeds",
            prompt_token_ids=None,
            mm_features=None,
            sampling_params=SamplingParams(extra_args=extra),
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            prompt_embeds=embeds,
        )

    gate = support.Admission.for_engine(config, "cpu")
    with pytest.raises(VLLMValidationError) as info:
        intake.admit_engine_request(gate, request(BUDGET))
    assert info.value.parameter == "kv_budget" and "prompt embeddings" in str(info.value)
    intake.admit_engine_request(gate, request(None))  # no budget: stock
    # The prompt length counts the embeddings: a 300-token fraction, as for token ids.
    with pytest.raises(VLLMValidationError, match="kv_budget: a fractional"):
        intake.admit_engine_request(gate, request({"kv_budget": 1.5}))

    class Handler:  # what the check reads: the engine client's configuration
        engine_client = type("Client", (), {"vllm_config": config})()

    with pytest.raises(KvOptionsError, match="prompt embeddings"):
        check_rendered_prompt(Handler(), embeds_input(embeds), BUDGET)
    check_rendered_prompt(Handler(), embeds_input(embeds), {"kv_budget": None})
    check_rendered_prompt(Handler(), tokens_input(list(range(300))), BUDGET)
    with pytest.raises(KvOptionsError, match="kv_compress_at"):
        check_rendered_prompt(Handler(), tokens_input([1, 2, 3]), {**BUDGET, "kv_compress_at": 9})


@pytest.mark.slow
def test_prompt_embeds_budget_is_refused_and_the_engine_keeps_serving(model_path):
    """A real engine with ``enable_prompt_embeds`` (a subprocess: another engine config)."""
    spec = {"engine": {"model": str(model_path), **ENGINE_KWARGS}}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [sys.executable, str(PROBES / "embeds_probe.py"), json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("EMBEDS_PROBE "))
    result = json.loads(line.removeprefix("EMBEDS_PROBE "))
    assert result["refused"] == {"parameter": "kv_budget", "names_embeddings": True}
    # Unbudgeted prompt embeddings stay stock: the same tokens as the same prompt as token ids.
    assert result["embeds_tokens"] == result["ids_tokens"] and len(result["ids_tokens"]) == 8
    assert result["budgeted_ids_evictions"] == 1  # and a budgeted token prompt still evicts


def test_a_budget_on_prompt_embeddings_is_not_applied_when_let_through(model_path):
    """Why the refusal stays: with it lifted (the request admitted as if its prompt were token
    ids), the worker, which tracks token-id prompts only, has no state for the request; the
    scheduler's order is a counted fault and nothing is evicted, so the budget would be
    silently ignored (the tokens are the unbudgeted request's)."""
    spec = {"engine": {"model": str(model_path), **ENGINE_KWARGS}, "lift": True}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, str(PROBES / "embeds_probe.py"), json.dumps(spec)],
                          env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x.removeprefix("EMBEDS_PROBE ")) for x in proc.stdout.splitlines()
             if x.startswith("EMBEDS_PROBE ")]  # fmt: skip
    plain, got = lines
    outcome = got["outcome"]
    assert outcome["fault"] == "schedule: untracked" and outcome["freed_blocks"] == 0, got
    assert outcome["prompt_tokens_kept"] == got["prompt_tokens"] > 64
    assert got["budgeted"] == plain["plain"]
