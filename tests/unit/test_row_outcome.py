"""When a contained fault leaves a request's cache usable (the rule behind its fate)."""

from __future__ import annotations

import pytest

from obcache_vllm.eviction.faults import InjectedFault
from obcache_vllm.eviction.step import RowOutcome

LAYERS = 30


@pytest.mark.parametrize(
    ("compacted", "writing_at_fault", "torn"),
    [
        pytest.param(0, False, False, id="nothing-written: uncompressed"),
        pytest.param(0, True, True, id="first-layer-half-written"),
        pytest.param(5, False, True, id="some-layers-compacted"),
        pytest.param(5, True, True, id="some-layers-then-a-half-written-one"),
        pytest.param(LAYERS, False, False, id="every-layer-compacted: committed"),
    ],
)
def test_torn_means_neither_before_nor_after(compacted, writing_at_fault, torn):
    outcome = RowOutcome(compacted_layers=compacted)
    outcome.writing = writing_at_fault
    outcome.fail("compact" if writing_at_fault else "score", RuntimeError("x"), "layer")
    assert outcome.torn(LAYERS) is torn
    assert outcome.writing is False


def test_first_fault_is_kept_and_injected_faults_are_labelled():
    outcome = RowOutcome()
    outcome.fail("score", InjectedFault("score"), "model.layers.0")
    outcome.fail("compact", ValueError("later"), "model.layers.1")
    assert outcome.failure[:2] == ("score", "injected")
    assert "model.layers.0" in outcome.failure[2]


def test_a_worker_fault_can_name_one_tensor_parallel_rank(monkeypatch) -> None:
    from obcache_vllm.eviction import faults

    monkeypatch.setattr(faults, "enabled", lambda: True)
    parse = faults.requested
    assert parse({"obcache_fault": "score"}) == faults.Fault("score")
    one = parse({"obcache_fault": "compact:5@2"})
    assert one == faults.Fault("compact", 5, 2)
    assert one.on_rank(2) and not one.on_rank(0)
    assert faults.Fault("score").on_rank(1)  # no rank: every rank
    for bad in ("score@x", "schedule@1", "score@", "compact:a@1"):
        assert parse({"obcache_fault": bad}) is None, bad
