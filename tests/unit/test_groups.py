"""Which KV-cache group budgets evict in (``obcache_vllm/vllm_ext/groups.py``), and what admission
refuses on a model that interleaves sliding-window and global layers: vLLM's own spec classes,
no engine. The engine side is ``tests/engine/test_gemma3.py`` (Gemma 3 270M) and the Gemma 2
row of ``tests/engine/test_architectures.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from obcache_vllm import admission
from obcache_vllm.admission import CAPABILITIES, parse_kv_options
from obcache_vllm.vllm_ext.groups import evicting_group, window_blocks

HEAD = dict(num_kv_heads=1, head_size=256, dtype=torch.float32)


def _config(*specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=groups)


def _full(bs=32, **kw):
    return FullAttentionSpec(block_size=bs, **HEAD, **kw)


def _window(bs=32):
    return SlidingWindowSpec(block_size=bs, sliding_window=512, **HEAD)


def test_one_group_of_global_layers_is_where_budgets_evict():
    group = evicting_group(_config(_full()))
    assert (group.index, group.hybrid, group.reason) == (0, False, None)


def test_a_hybrid_model_evicts_in_its_global_group_wherever_vllm_put_it():
    # Gemma 3 270M: vLLM lists the sliding-window groups and the global one in layer order.
    group = evicting_group(_config(_window(), _window(), _full(), _window()))
    assert (group.index, group.hybrid, group.num_groups) == (2, True, 4)


@pytest.mark.parametrize("specs, why", [
    ((_full(), _full(), _window()), "2 groups of global attention layers"),
    ((_window(), _window()), "no group of global attention layers"),
    ((_full(), _window(bs=16)), "different block sizes"),
    ((MLAAttentionSpec(block_size=32, **HEAD), _window()), "no group of global attention"),
    ((_full(sliding_window=512), _window()), "no group of global attention layers"),
])  # fmt: skip
def test_hybrid_layouts_without_one_global_group_have_none(specs, why):
    group = evicting_group(_config(*specs))
    assert group.index is None and why in group.reason, group


@pytest.mark.parametrize("spec", [
    MLAAttentionSpec(block_size=32, **HEAD),  # admission refuses MLA
    _full(sliding_window=512),  # the unified layout: admission refuses its windows
    UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs={  # global layers, two head sizes
        "a": _full(), "b": FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                                             dtype=torch.float32)}),
])  # fmt: skip
def test_a_single_group_is_always_the_one_budgets_evict_in(spec):
    """What a single-group model cannot serve is admission's to refuse, by the engine
    configuration (MLA, windows), as before hybrid models were served."""
    group = evicting_group(_config(spec))
    assert (group.index, group.hybrid) == (0, False)


def test_global_layers_of_two_head_sizes_are_one_global_group_beside_windows():
    uniform = UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs={"a": _full(), "b": _full()})
    assert evicting_group(_config(_window(), uniform)).index == 1


def _vllm_config(layer_types, window=512, disabled=False):
    text = SimpleNamespace(layer_types=layer_types)
    model = SimpleNamespace(get_sliding_window=lambda: window, hf_text_config=text)
    return SimpleNamespace(model_config=model,
                           scheduler_config=SimpleNamespace(
                               disable_hybrid_kv_cache_manager=disabled))  # fmt: skip


GEMMA3 = ["sliding_attention"] * 5 + ["full_attention"]


def test_admission_tells_interleaved_models_from_windowed_ones():
    assert admission.interleaved(_vllm_config(GEMMA3))
    cpu, cuda = CAPABILITIES["cpu"], CAPABILITIES["cuda"]  # what each platform's adapter serves
    assert admission._window_reason(_vllm_config(GEMMA3), cpu) is None
    every = _vllm_config(["sliding_attention"] * 4)  # a window in every layer (Mistral 7B v0.1)
    assert not admission.interleaved(every)
    assert "other than those interleaving" in admission._window_reason(every, cpu)
    # FLASH_ATTN shares seq_lens between groups
    assert "CPU attention backend only" in admission._window_reason(_vllm_config(GEMMA3), cuda)
    unified = _vllm_config(GEMMA3, disabled=True)
    assert "hybrid KV-cache manager disabled" in admission._window_reason(unified, cpu)
    assert admission._window_reason(_vllm_config(None, window=None), cpu) is None


@pytest.mark.parametrize("fields, refused", [
    ({"kv_budget": 64}, None),
    ({"kv_budget": 64, "kv_decode": True}, None),
    ({"kv_budget": 64, "kv_compress_at": 100}, None),  # no entry left, no reuse
    ({"kv_budget": 64, "kv_session": True}, "kv_session"),
    ({"kv_budget": 64, "kv_prefill_evict": True}, None),  # its peak counts every group
    ({"kv_budget": 64, "kv_when": "pressure"}, None),  # the planner counts every group
    ({"kv_budget": 64, "kv_pipeline": "adakv"}, None),  # per-head memory in the global layers
    ({"kv_budget": {"max_error": 0.01}}, None),  # estimated in the global layers
])  # fmt: skip
def test_options_that_need_more_than_the_global_group_are_refused_on_interleaved_models(
    fields, refused
):
    options = parse_kv_options(fields, 1000)
    got = admission.hybrid_refusal(_vllm_config(GEMMA3), options)
    assert (got[0] if got else None) == refused
    assert admission.hybrid_refusal(_vllm_config(None, window=None), options) is None


def test_a_bounded_peak_adds_what_the_sliding_window_groups_hold_at_most():
    config = SimpleNamespace(max_in_flight_tokens=256,
                             model_config=SimpleNamespace(max_model_len=2048))  # fmt: skip
    layout = _config(_window(), _full(), _window())
    group = evicting_group(layout)
    # Each window: 511 tokens behind the newest plus 256 in flight, in 32-token blocks, one
    # more for a window that starts inside a block: 25 blocks (vLLM's admission cap).
    assert window_blocks(layout, group, config) == 2 * 25
    assert window_blocks(_config(_full()), evicting_group(_config(_full())), config) == 0
