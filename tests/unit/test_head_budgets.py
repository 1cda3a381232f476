"""Per-head budgets on plain tensors and a tiny random Llama (no vLLM): AdaKV's allocation, and
the masked attention that measures it in the HF reference.

Oracles: the allocation's own definition (the layer total, the per-head floor, the layer's best
entries across heads); and, for the masked path, the reference's gathered cache: masking what
a uniform selection evicts gives the same logits as keeping only its entries.
"""

from __future__ import annotations

import pytest
import torch
from test_hf_reference_tiny import BLOCK, _opts, _prompt, model  # noqa: F401 (fixture)

from obcache_vllm.evidence import head_budgets as hb
from obcache_vllm.evidence import hf_reference as ref
from obcache_vllm.scoring.allocation import adaptive_keep

pytestmark = pytest.mark.unit


def test_the_layer_total_is_spread_by_score_above_a_floor_per_head():
    scores = torch.tensor([[9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0],   # concentrated ... not
                           [0.5, 0.4, 0.3, 0.2, 0.1, 0.0, 0.0, 0.0]])  # fmt: skip
    kept = adaptive_keep(scores, keep=4, alpha=0.5)  # floor 2 per head, 8 in all
    assert kept.sum() == 8 and kept.sum(1).tolist() == [6, 2]
    assert kept[1, :2].all() and kept[0, :6].all()  # each head's own best first
    with_fixed = adaptive_keep(scores, keep=4, recent=1, sinks=1, alpha=0.0)
    assert with_fixed[:, 0].all() and with_fixed[:, -1].all() and with_fixed.sum() == 8
    uniform = adaptive_keep(scores, keep=4, alpha=1.0)  # the floor is the whole budget
    assert uniform.sum(1).tolist() == [4, 4]


def test_the_most_salient_entries_of_the_layer_win_whatever_head_holds_them():
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand((3, 50), generator=gen)
    kept = adaptive_keep(scores, keep=10, alpha=0.2)
    floor = 2
    assert kept.sum() == 30 and bool((kept.sum(1) >= floor).all())
    # Above each head's own floor, no evicted entry scores above a kept one.
    per_head = torch.sort(scores, dim=1, descending=True).values[:, floor - 1 : floor]
    extra = kept & (scores < per_head)  # kept by the layer-wide rank, not by the head's floor
    evicted = ~kept
    if extra.any():
        assert scores[extra].min() >= scores[evicted & (scores < per_head)].max()


def test_masking_a_uniform_selection_is_keeping_only_its_entries(model):  # noqa: F811
    """The masked full cache gives the logits of the gathered one (the reference's own path),
    at every teacher-forced position; the full cache unmasked gives the full cache's."""
    ids = _prompt(60, seed=3)
    opts = _opts(24)
    state = ref.prefill(model, ids, query_window=opts.query_window)
    order, kept = ref.select_kept(state, opts, BLOCK)
    tokens, _ = ref.generate(model, state, kept, max_new_tokens=6)
    masked = hb.forced_logits(model, state, hb.masks(state, opts, order.kept, adaptive=False),
                              tokens)  # fmt: skip
    # The gathered cache, forced on the same tokens: greedy on it picked exactly these.
    _, gathered = ref.generate(model, state, kept, max_new_tokens=6)
    torch.testing.assert_close(masked, gathered, rtol=1e-4, atol=1e-4)
    full_tokens, full_logits = ref.generate(model, state, None, max_new_tokens=6)
    torch.testing.assert_close(hb.forced_logits(model, state, None, full_tokens), full_logits,
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    adaptive = hb.masks(state, opts, order.kept, adaptive=True)
    assert all(int(m.sum()) == order.kept * m.shape[0] for m in adaptive.values())
    assert hb.compare(full_logits, full_logits) == {"kl": 0.0, "agree": 1.0,
                                                    "first_divergence": 6}  # fmt: skip
