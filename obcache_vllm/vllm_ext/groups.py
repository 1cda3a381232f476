"""Which KV-cache group a budget evicts in (EngineCore and worker processes).

vLLM gives a model one KV-cache group per kind of attention layer (``KVCacheConfig.
kv_cache_groups``; its hybrid KV-cache manager). A model whose attention layers are all global
(Llama, Qwen, Mistral without a window) has one group, and budgets evict there. A hybrid model
of sliding-window and global layers (Gemma 2 and 3) has one group of global layers and
one or more of sliding-window layers, all with the same block size, sharing one block pool.
Budgets evict in the global layers' group only: those hold the whole context (nearly all of a
long prompt's KV), while a sliding-window layer holds its last window and vLLM already frees
what falls out of it (``SlidingWindowManager``: null blocks before the window). A request's
sliding-window layers therefore run exactly as stock vLLM runs them.

Served layouts (:func:`evicting_group`): a single group (whatever admission lets through: it
refuses MLA, windows and the rest by the engine configuration, as before hybrid models were
served), or several groups of which exactly one holds global attention layers and the others
sliding-window layers with its block size. A hybrid layout other than that has no group to
evict in: two groups of global layers (vLLM splits the layers so that every group has the same
count; the worker keeps one block table per request), Mamba, chunked-local or attention-sink
groups, MLA. The scheduler and the worker both read the layout from here, so they agree on
the group.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)


@dataclass(frozen=True)
class EvictingGroup:
    """The KV-cache group budgets evict in, or why there is none (``index`` None)."""

    index: int | None
    num_groups: int
    reason: str | None = None

    @property
    def hybrid(self) -> bool:
        """Several groups: the other ones are sliding-window layers, left to vLLM."""
        return self.num_groups > 1


def evicting_group(kv_cache_config) -> EvictingGroup:
    """The group of global attention layers of ``kv_cache_config`` (see the module docstring)."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) == 1:
        return EvictingGroup(0, 1)
    full = [i for i, g in enumerate(groups) if _is_global(g.kv_cache_spec)]
    sliding = [i for i, g in enumerate(groups) if type(g.kv_cache_spec) is SlidingWindowSpec]
    n = len(groups)
    if len(full) != 1:
        why = ("no group of global attention layers" if not full else
               f"{len(full)} groups of global attention layers")  # fmt: skip
        return EvictingGroup(None, n, f"{why} among the model's {n} KV-cache groups")
    index = full[0]
    if len(full) + len(sliding) != n:
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        return EvictingGroup(None, n, f"KV-cache groups of kinds {', '.join(kinds)}: only "
                                      "global and sliding-window attention layers are served")
    size = groups[index].kv_cache_spec.block_size
    if any(groups[i].kv_cache_spec.block_size != size for i in sliding):
        return EvictingGroup(None, n, "KV-cache groups with different block sizes")
    return EvictingGroup(index, n)


def _is_global(spec) -> bool:
    """A group of plain global attention (not MLA, sinks or a unified layout with a window);
    layers of different head sizes in one group each keep their own spec."""
    if type(spec) is UniformTypeKVCacheSpecs:
        return all(_is_global(one) for one in spec.kv_cache_specs.values())
    return (
        type(spec) is FullAttentionSpec
        and spec.sliding_window is None
        and spec.attention_chunk_size is None
    )


def window_blocks(kv_cache_config, group: EvictingGroup, vllm_config) -> int:
    """The most blocks one request holds at once in the sliding-window groups besides the
    group budgets evict in (0 for a single group): vLLM's own per-request admission cap of each
    (``SlidingWindowSpec.max_admission_blocks_per_request``: the window plus the tokens in
    flight, one block more for a window that starts inside a block)."""
    if not group.hybrid:
        return 0
    return sum(
        g.kv_cache_spec.max_admission_blocks_per_request(
            max_in_flight_tokens=vllm_config.max_in_flight_tokens,
            max_model_len=vllm_config.model_config.max_model_len,
        )
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
        if i != group.index
    )
