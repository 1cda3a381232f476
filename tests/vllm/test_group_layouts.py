"""The scheduler obcache-vllm builds for each KV-cache layout, on vLLM's real ``Scheduler`` and
block pool (no model): one group or a hybrid model's global group gets ``OBCacheScheduler``
evicting in that group; a layout with no group to evict in gets vLLM's own scheduler, where a
budgeted request that got past admission is finished with an error (counted, never served
silently unbudgeted) while requests without a budget run as stock."""

from __future__ import annotations

import time

import pytest
import torch
from support.sched_sim.engine import SimConfig, vllm_config
from vllm import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from obcache_vllm.admission import Admission
from obcache_vllm.vllm_ext.engine.scheduler import OBCacheScheduler, StockLayoutScheduler
from obcache_vllm.vllm_ext.frontend import intake

BS = 8
# No prefix caching: these requests carry no block hashes (the layouts are the question).
CFG = SimConfig(block_size=BS, num_blocks=64, prefix_caching=False)


def _scheduler(*specs):
    config = vllm_config(CFG)
    groups = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec)
              for i, spec in enumerate(specs)]  # fmt: skip
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    return OBCacheScheduler(vllm_config=config, kv_cache_config=kv,
                            structured_output_manager=StructuredOutputManager(config),
                            block_size=BS, log_stats=True)  # fmt: skip


def _full():
    return FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)


def _window():
    return SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32,
                             sliding_window=16)  # fmt: skip


def _request(scheduler, req_id: str, fields: dict | None) -> Request:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                            extra_args=dict(fields) if fields else None)  # fmt: skip
    request = EngineCoreRequest(
        request_id=req_id, prompt_token_ids=list(range(1, 41)), mm_features=None,
        sampling_params=params, pooling_params=None, arrival_time=time.time(),
        lora_request=None, cache_salt=None, data_parallel_rank=None,
    )  # fmt: skip
    intake.admit_engine_request(Admission.for_engine(vllm_config(CFG), "cpu"), request)
    return Request.from_engine_core_request(request, None)


@pytest.mark.parametrize("specs, group", [((_full(),), 0), ((_window(), _full(), _window()), 1)])
def test_a_global_group_gets_the_evicting_scheduler_in_that_group(specs, group):
    scheduler = _scheduler(*specs)
    assert type(scheduler) is OBCacheScheduler
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    assert scheduler.obcache_pool.group is managers[group]
    assert scheduler.obcache_pool.hybrid == (len(specs) > 1)



def test_no_group_to_evict_in_finishes_a_budgeted_request_with_an_error_and_serves_the_rest():
    scheduler = _scheduler(_full(), _full(), _window())  # two groups of global layers
    assert type(scheduler) is StockLayoutScheduler
    assert "2 groups of global attention layers" in scheduler.obcache_reason
    budget = {"kv_budget": 24, "kv_sinks": 0, "kv_recent": 0}
    scheduler.add_request(_request(scheduler, "budgeted", budget))
    scheduler.add_request(_request(scheduler, "plain", None))
    out: SchedulerOutput = scheduler.schedule()
    assert set(out.num_scheduled_tokens) == {"plain"}  # the budgeted one never runs
    runner = ModelRunnerOutput(req_ids=["plain"], req_id_to_index={"plain": 0},
                               sampled_token_ids=[[7]])  # fmt: skip
    outputs = scheduler.update_from_output(out, runner)
    finished = {o.request_id: o.finish_reason for eco in outputs.values() for o in eco.outputs
                if o.finish_reason is not None}  # fmt: skip
    assert str(finished.get("budgeted")) == "error", finished
    assert "budgeted" not in scheduler.requests and "plain" in scheduler.requests


def test_budgeted_requests_of_a_hybrid_model_neither_read_nor_leave_compressed_entries():
    config = vllm_config(SimConfig(block_size=BS, num_blocks=64, prefix_caching=True))
    for specs, enabled in (((_full(),), True), ((_window(), _full()), False)):
        kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec)
            for i, spec in enumerate(specs)])  # fmt: skip
        scheduler = OBCacheScheduler(vllm_config=config, kv_cache_config=kv,
                                     structured_output_manager=StructuredOutputManager(config),
                                     block_size=BS, log_stats=True)  # fmt: skip
        assert scheduler.obcache_prefix.enabled is enabled
