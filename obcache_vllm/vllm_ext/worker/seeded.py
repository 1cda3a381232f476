"""Seeded sampling under chunked prefill with CPU generators (a model-runner mixin).

The upstream bug (vLLM 0.32.0, ``GPUModelRunner._bookkeeping_sync``): every step samples a
token for every row, including a row whose prompt is only partly prefilled (its token is then
discarded, ``discard_request_mask``). A request with its own ``seed`` has its own
``torch.Generator``, and the dropped draw must not advance it, or the request's text would
depend on how its prompt was chunked. vLLM undoes the draw with
``gen.set_offset(gen.get_offset() - 4)``, which assumes a CUDA Philox generator ("relies on
cuda-specific torch-internal impl details", vllm-project/vllm#10097). A CPU generator
(mt19937) has no offset: ``RuntimeError: CPU Generator does not use offset``, raised in the
worker, kills the engine and every request in flight gets HTTP 500. Any seeded request whose
prompt exceeds ``max_num_batched_tokens`` triggers it on vLLM's CPU build. Other CPU-generator
backends hit the same line (RBLN-SW/vllm-rbln#1025, qualcomm/vllm-qaic#92).

The fix, for generators whose device is the CPU only (a CUDA/XPU generator keeps vLLM's rewind,
untouched)::

    _sample            snapshot get_state() of each discarded row's CPU generator
                       -> vLLM's sampler (draws from every generator, as stock)
                       -> set_state(snapshot): the dropped draw never happened (exact)
    _bookkeeping_sync  those generators are hidden from vLLM's offset rewind (a filtered
                       copy of ``input_batch.generators`` for the call; restored after)

So a seeded request consumes its generator once per token it keeps, whatever the chunking and
the batch around it: the same stream as an unchunked run. Every vLLM name used here is pinned
in :mod:`obcache_vllm.vllm_ext.seams` (``SEAMS``, ``STATE``).
"""

from __future__ import annotations

import torch


def _cpu_generators_of_discarded_rows(runner) -> dict[int, torch.Generator]:
    """Row index -> the row's own CPU generator, for rows whose sampled token is discarded."""
    generators = runner.input_batch.generators
    if not generators:
        return {}
    num_reqs = runner.input_batch.num_reqs
    discard = runner.discard_request_mask.np[:num_reqs]
    return {
        row: gen
        for row, gen in generators.items()
        if row < num_reqs and discard[row] and gen.device.type == "cpu"
    }


class SeededCpuSamplingMixin:
    """Mixin for a ``GPUModelRunner`` subclass (CPU build): see the module docstring.

    Place it before the vLLM runner class in the bases, so its two methods wrap vLLM's.
    """

    def _sample(self, logits, spec_decode_metadata):
        """vLLM's ``_sample``, leaving the CPU generators of discarded rows as they were."""
        saved = [(gen, gen.get_state()) for gen in _cpu_generators_of_discarded_rows(self).values()]
        try:
            return super()._sample(logits, spec_decode_metadata)
        finally:
            for gen, state in saved:
                gen.set_state(state)

    def _bookkeeping_sync(self, *args, **kwargs):
        """vLLM's ``_bookkeeping_sync`` without its Philox rewind for CPU generators.

        The rewind loop reads ``self.input_batch.generators`` only; for the call it sees a copy
        without the discarded rows' CPU generators (already restored by :meth:`_sample`).
        """
        hidden = _cpu_generators_of_discarded_rows(self)
        if not hidden:
            return super()._bookkeeping_sync(*args, **kwargs)
        batch = self.input_batch
        generators = batch.generators
        batch.generators = {row: g for row, g in generators.items() if row not in hidden}
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            batch.generators = generators
