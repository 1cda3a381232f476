"""The seeded-sampling mixin on a stand-in runner (no vLLM): CPU generators restored, others not.

The stand-in base reproduces the two vLLM behaviours the mixin wraps (GPUModelRunner in 0.32):
``_sample`` draws once from every row's generator, discarded rows included;
``_bookkeeping_sync`` rewinds each discarded row's generator with ``set_offset``. The real
engine path is covered by tests/engine/test_seeded.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from obcache_vllm.vllm_ext.worker.seeded import SeededCpuSamplingMixin


class PhiloxLike:
    """A device generator as vLLM assumes one (CUDA: an offset, no CPU state API needed)."""

    device = torch.device("cuda")

    def __init__(self) -> None:
        self.offset = 0

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset

    def draw(self) -> None:
        self.offset += 4

    def get_state(self):
        raise AssertionError("the mixin must leave non-CPU generators to vLLM")

    set_state = get_state


class StockRunner:
    """What vLLM's GPUModelRunner does with generators in the two wrapped methods."""

    def __init__(self, generators: dict, discard: list[bool]) -> None:
        self.input_batch = SimpleNamespace(generators=generators, num_reqs=len(discard))
        self.discard_request_mask = SimpleNamespace(np=np.array(discard))

    def _sample(self, logits, spec_decode_metadata):
        for gen in self.input_batch.generators.values():
            if isinstance(gen, PhiloxLike):
                gen.draw()
            else:
                torch.randint(0, 2**31, (1,), generator=gen)
        return "sampled"

    def _bookkeeping_sync(self, *args):
        for i in np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]:
            gen = self.input_batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)  # raises for a CPU generator
        return "booked"


class Runner(SeededCpuSamplingMixin, StockRunner):
    pass


def _cpu(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_the_stand_in_fails_like_vllm_without_the_mixin():
    runner = StockRunner({0: _cpu(1)}, [True])
    runner._sample(None, None)
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        runner._bookkeeping_sync()


def test_discarded_cpu_rows_are_restored_and_kept_rows_advance():
    discarded, kept = _cpu(1), _cpu(2)
    fresh = _cpu(1).get_state()
    runner = Runner({0: discarded, 2: kept}, [True, False, False])
    assert runner._sample(None, None) == "sampled"
    assert runner._bookkeeping_sync() == "booked"
    assert torch.equal(discarded.get_state(), fresh)
    reference = _cpu(2)
    torch.randint(0, 2**31, (1,), generator=reference)
    assert torch.equal(kept.get_state(), reference.get_state())
    # The batch's own dict is back in place, entries and order unchanged.
    assert list(runner.input_batch.generators.items()) == [(0, discarded), (2, kept)]


def test_non_cpu_generators_keep_vllms_rewind():
    gpu, cpu = PhiloxLike(), _cpu(3)
    runner = Runner({0: gpu, 1: cpu}, [True, True])
    runner._sample(None, None)
    runner._bookkeeping_sync()
    assert gpu.offset == 0  # drawn (+4) and rewound (-4) by vLLM's own code
    assert torch.equal(cpu.get_state(), _cpu(3).get_state())


def test_generators_are_restored_even_if_sampling_raises():
    gen = _cpu(4)

    class Failing(StockRunner):
        def _sample(self, logits, spec_decode_metadata):
            super()._sample(logits, spec_decode_metadata)
            raise ValueError("sampler failed")

    class FailingRunner(SeededCpuSamplingMixin, Failing):
        pass

    runner = FailingRunner({0: gen}, [True])
    with pytest.raises(ValueError):
        runner._sample(None, None)
    assert torch.equal(gen.get_state(), _cpu(4).get_state())
