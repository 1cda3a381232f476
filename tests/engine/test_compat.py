"""The vLLM seams obcache-vllm patches: pinned, checked at start-up, failing loudly on change."""

from __future__ import annotations

import copy
import inspect
from types import SimpleNamespace

import pytest

from obcache_vllm import admission as support
from obcache_vllm.vllm_ext import install as inst


def test_installed_vllm_matches_every_pinned_seam():
    inst.check_compatibility()  # raises with the list of differences otherwise


def test_every_seam_is_pinned_by_its_exact_parameters():
    for module, qualname, params in inst.SEAMS:
        target = inst._resolve(module, qualname)
        names = tuple(inspect.signature(target).parameters)
        assert names[: len(params)] == params, f"{module}.{qualname}: {names}"


def test_a_changed_signature_refuses_to_start(monkeypatch):
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    def changed(self, request_id, start, stop):  # renamed parameters
        raise AssertionError

    monkeypatch.setattr(SingleTypeKVCacheManager, "_remove_blocks_in_range", changed)
    with pytest.raises(inst.IncompatibleVllmError, match="_remove_blocks_in_range"):
        inst.check_compatibility()


def test_changed_request_state_refuses_to_start(monkeypatch):
    from vllm.v1.core.sched.output import SchedulerOutput

    fields = dict(SchedulerOutput.__dataclass_fields__)
    del fields["total_num_scheduled_tokens"]
    monkeypatch.setattr(SchedulerOutput, "__dataclass_fields__", fields)
    with pytest.raises(inst.IncompatibleVllmError, match="total_num_scheduled_tokens"):
        inst.check_compatibility()


def test_another_vllm_version_refuses_to_start(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with pytest.raises(inst.IncompatibleVllmError, match="0.34.0"):
        inst.check_compatibility()


def test_a_supported_version_is_checked_against_its_own_seams(monkeypatch):
    """0.33.0's rows (its moved and extended seams) do not hold on 0.32.0's source."""
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(inst.IncompatibleVllmError, match="kv_cache_planning") as info:
        inst.check_compatibility()
    assert "max_cache_hit_length" in str(info.value)


def test_install_is_idempotent():
    from vllm.config.scheduler import SchedulerConfig
    from vllm.v1.engine.input_processor import InputProcessor

    inst.install()
    first = (SchedulerConfig.get_scheduler_cls, InputProcessor.process_inputs)
    inst.install()
    assert (SchedulerConfig.get_scheduler_cls, InputProcessor.process_inputs) == first
    assert not getattr(
        getattr(InputProcessor.process_inputs, "__wrapped__", None), "__obcache_wrapped__", False
    ), "wrapped twice"


def test_unsupported_configurations_are_named(llm):
    config = llm.llm_engine.vllm_config
    assert support.engine_refusal(config, support.CAPABILITIES["cpu"]) is None
    # Speculative decoding is refused per option (decode-time eviction): test_spec_decode.py.
    cases = {
        "KV connectors": dict(kv_transfer_config=SimpleNamespace()),
    }
    for needle, change in cases.items():
        fake = copy.copy(config)
        for k, v in change.items():
            object.__setattr__(fake, k, v)
        assert needle in support.engine_refusal(fake, support.CAPABILITIES["cpu"])
    # Per-layer-scaled fp8 is served on CPU (test_fp8_kv.py); other quantized layouts are not.
    for dtype, refused in (("fp8", False), ("fp8_e5m2", False), ("fp8_per_token_head", True),
                           ("fp8_inc", True)):
        fake = copy.copy(config)
        object.__setattr__(fake, "cache_config", copy.copy(config.cache_config))
        object.__setattr__(fake.cache_config, "cache_dtype", dtype)
        reason = support.engine_refusal(fake, support.CAPABILITIES["cpu"])
        assert (reason is not None and "quantized KV cache" in reason and dtype in reason) \
            if refused else reason is None, (dtype, reason)


@pytest.mark.parametrize(
    "extra, field",
    [
        pytest.param({"kv_budget": -1}, "kv_budget", id="negative"),
        pytest.param({"kv_budget": 64, "kv_scorer": "magic"}, "kv_scorer", id="scorer"),
        pytest.param({"kv_budget": 99999}, "kv_budget", id="beyond-context"),
        pytest.param({"kv_budget": 64, "kv_compress_at": 500}, "kv_compress_at", id="compress-at"),
    ],
)
def test_bad_options_are_rejected_before_the_engine_and_it_keeps_serving(engine, extra, field):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    free = engine.free_blocks()
    with pytest.raises(VLLMValidationError) as info:
        engine.llm.generate(["Hello there"], SamplingParams(max_tokens=2, extra_args=extra),
                            use_tqdm=False)
    assert info.value.parameter == field
    assert engine.free_blocks() == free and not engine.scheduler.requests
    ok = engine.llm.generate(["Hello there"], SamplingParams(max_tokens=2, temperature=0),
                             use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 2


def test_api_server_install_is_idempotent_and_wraps_each_seam_once():
    from vllm.entrypoints.launchers import app as app_module
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.v1.engine import async_llm

    def patched():
        return (
            async_llm.AsyncLLM.generate,
            ChatCompletionRequest.to_sampling_params,
            CompletionRequest.to_sampling_params,
            OpenAIServingChat.chat_completion_full_generator,
            OpenAIServingChat.chat_completion_stream_generator,
            OpenAIServingCompletion.completion_stream_generator,
            OpenAIServingCompletion.request_output_to_completion_response,
            app_module.register_api_routers,
            async_llm.load_stat_logger_plugin_factories,
        )

    inst.install_api_server()
    first = patched()
    inst.install_api_server()
    assert patched() == first
    for fn in first:
        assert getattr(fn, "__obcache_wrapped__", False), fn
        assert not getattr(fn.__wrapped__, "__obcache_wrapped__", False), f"{fn} wrapped twice"
    from obcache_vllm.vllm_ext.frontend.stats import OBCachePrometheusStatLogger

    factories = async_llm.load_stat_logger_plugin_factories()
    assert factories.count(OBCachePrometheusStatLogger) == 1


def test_scheduler_stats_carry_the_obcache_field_through_msgspec():
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    inst.install()
    stats = SchedulerStats()
    assert stats.obcache is None
    stats.obcache = {"by_option": [["obcache_key", "snapkv", 64, 2, 1]], "seconds": [0.01]}
    wire = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=stats))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(wire)
    assert decoded.scheduler_stats.obcache == stats.obcache
