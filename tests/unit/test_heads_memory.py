"""Per-head memory on plain tensors (no vLLM): AdaKV's allocation in whole head-blocks, the
per-head read tables, and the query regrouping the kernel call uses.

Oracles: the layout's own definition (every layer's head-blocks fill the same blocks; a head's
entries are its best ones; the tail block is kept by every head) and, for the tables, a
straightforward loop over (layer, request, head) that reads the layout's description in
``obcache_vllm.eviction.heads``.
"""

from __future__ import annotations

import pytest
import torch

from obcache_vllm.eviction.heads import (
    HeadLayout,
    body_shape,
    head_block_slots,
    head_residents,
    head_tables,
    regroup_index,
)
from obcache_vllm.scoring import make_pipeline
from obcache_vllm.scoring.allocation import adaptive_head_blocks, adaptive_keep

pytestmark = pytest.mark.unit

BS = 4


def _scores(heads=3, length=22, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([4.0, 1.0, 0.25])[:heads, None]  # heads of different spread
    return torch.rand((heads, length), generator=gen) ** 3 * scale


def test_body_shape_splits_an_order_into_whole_head_blocks_and_the_tail():
    assert body_shape(22, 2, BS) == (2, 3)  # blocks 0-1 dead, 2-4 body, 5 holds tokens 20-21
    assert body_shape(24, 2, BS) == (4, 3)  # a full last block is the tail
    assert body_shape(5, 1, BS) == (1, 0)


def test_the_layer_keeps_a_uniform_total_in_whole_head_blocks_by_score():
    scores = _scores()
    tail, body = body_shape(22, 2, BS)
    kept = adaptive_head_blocks(scores, tail=tail, body_blocks=body, block_size=BS,
                                recent=1, sinks=1)  # fmt: skip
    counts = [len(k) for k in kept]
    assert sum(counts) == 3 * (body * BS + tail)  # a uniform selection's total
    for index in kept:
        assert index.equal(index.sort().values) and index.unique().numel() == index.numel()
        assert (len(index) - tail) % BS == 0  # whole head-blocks before the tail
        assert index[-tail:].tolist() == [20, 21]  # the tail block: every head keeps it
        assert 0 in index.tolist()  # the sink
    assert counts != [counts[0]] * 3  # the spread heads take more than the peaked ones
    # Each head keeps its own best entries before the tail (sinks and recent first).
    for h, index in enumerate(kept):
        body_index = index[:-tail]
        evicted = torch.ones(22 - tail, dtype=torch.bool)
        evicted[body_index] = False
        evicted[0] = False
        if evicted.any() and body_index.numel() > 1:
            assert scores[h, body_index[1:]].min() >= scores[h, : 22 - tail][evicted].max()


def test_the_head_block_counts_follow_adakvs_counts_rounded_to_blocks():
    scores = _scores(length=42, seed=3)
    tail, body = 2, 5
    kept = adaptive_head_blocks(scores, tail=tail, body_blocks=body, block_size=BS)
    exact = adaptive_keep(scores[:, : 42 - tail], body * BS).sum(1)
    for index, count in zip(kept, exact.tolist(), strict=True):
        assert abs((len(index) - tail) - count) < BS  # within one head-block of AdaKV's count


def test_a_head_never_drops_below_its_sinks_and_recent_tokens():
    scores = torch.zeros((3, 26))
    scores[0, 4:] = 10.0  # head 0 wants everything; the others nothing
    kept = adaptive_head_blocks(scores, tail=2, body_blocks=2, block_size=BS, recent=6, sinks=2,
                                alpha=0.0)  # fmt: skip
    for index in kept:
        assert {0, 1, 20, 21, 22, 23, 24, 25} <= set(index.tolist())


def test_bad_shapes_are_refused():
    scores = _scores()
    with pytest.raises(ValueError, match="whole blocks"):
        adaptive_head_blocks(scores, tail=3, body_blocks=2, block_size=BS)
    with pytest.raises(ValueError, match="cannot keep"):
        adaptive_head_blocks(scores, tail=2, body_blocks=6, block_size=BS)
    with pytest.raises(ValueError, match="sinks"):
        adaptive_head_blocks(scores, tail=2, body_blocks=1, block_size=BS, sinks=5)
    with pytest.raises(ValueError, match="fill"):
        HeadLayout(torch.tensor([[1, 1, 2]]), 2)


def test_the_adakv_pipeline_scores_as_snapkv_and_selects_per_head():
    ada, snap = make_pipeline("adakv", window=8), make_pipeline("snapkv", window=8)
    assert ada.heads_own_memory and not snap.heads_own_memory
    assert ada.window == snap.window == 8
    kept = ada.select_heads(_scores(), tail=2, body_blocks=3, block_size=BS)
    assert sum(len(k) for k in kept) == 3 * 14


def _table_by_loop(read, lens, layouts, num_layers, hkv, bs):
    """The layout's definition, one (layer, request, head) at a time: (ids, length) lists."""
    out = {}
    for layer in range(num_layers):
        for r in range(read.shape[0]):
            for h in range(hkv):
                row = read[r].tolist()
                if r not in layouts:
                    out[layer, r, h] = ([b * hkv + h for b in row], int(lens[r]))
                    continue
                lay = layouts[r]
                counts = lay.counts[layer].tolist()
                offset = sum(counts[:h])
                body = [row[s // hkv] * hkv + s % hkv for s in range(offset, offset + counts[h])]
                tail = [b * hkv + h for b in row[lay.body_blocks :]]
                length = counts[h] * bs + int(lens[r]) - lay.body_blocks * bs
                out[layer, r, h] = (body + tail, length)
    return out


def test_head_tables_read_each_head_from_its_own_head_blocks_then_the_shared_tail():
    hkv, layers = 3, 2
    read = torch.tensor([[7, 3, 9, 4, 0], [5, 8, 6, 0, 0], [11, 12, 13, 14, 15]], dtype=torch.int32)
    lens = torch.tensor([15, 10, 17], dtype=torch.int32)  # shifted: after the dead blocks
    layouts = {
        0: HeadLayout(torch.tensor([[3, 1, 2], [0, 6, 0]]), 2),  # body: columns 0-1
        2: HeadLayout(torch.tensor([[1, 1, 1], [2, 1, 0]]), 1),
    }
    ids, out_lens = head_tables(read, lens, layouts, layers, hkv, BS)
    expected = _table_by_loop(read, lens, layouts, layers, hkv, BS)
    for (layer, r, h), (want_ids, want_len) in expected.items():
        row = r * hkv + h
        assert int(out_lens[layer, row]) == want_len, (layer, r, h)
        used = -(-want_len // BS)
        assert ids[layer, row, :used].tolist() == want_ids[:used], (layer, r, h)
    # Every head-block id a read uses is a block of its own request.
    for layer in range(layers):
        for r in range(3):
            rows = ids[layer, r * hkv : (r + 1) * hkv]
            assert set((rows // hkv).unique().tolist()) <= set(read[r].tolist())


def test_head_block_slots_hand_out_the_body_head_by_head():
    row = torch.tensor([0, 0, 7, 3, 9])  # two dead columns, then the body
    ids = head_block_slots([2, 3, 1], 2, 2, row)
    assert ids.tolist() == [21, 22, 23, 9, 10, 11]  # 7*3+0, 7*3+1, 7*3+2, 3*3+0, ...
    with pytest.raises(ValueError):
        head_block_slots([2, 2, 1], 2, 2, row)


def test_regrouped_queries_are_request_then_head_then_token():
    hkv, group, d = 3, 2, 1
    qsl = [0, 2, 3]  # request 0: tokens 0-1; request 1: token 2
    tokens = qsl[-1]
    query = torch.arange(tokens * hkv * group, dtype=torch.float32).view(tokens, hkv * group, d)
    index, starts = regroup_index(qsl, hkv)
    grouped = query.view(tokens, hkv, group, d).transpose(0, 1).reshape(hkv * tokens, group, d)
    regrouped = grouped.index_select(0, index)
    assert starts.tolist() == [0, 2, 4, 6, 7, 8, 9]
    for r, (first, last) in enumerate(zip(qsl, qsl[1:], strict=False)):
        for h in range(hkv):
            seq = r * hkv + h
            got = regrouped[starts[seq] : starts[seq + 1]]
            want = query[first:last].view(-1, hkv, group, d)[:, h]
            assert got.equal(want)
    # Back again: what the impl does with the kernel's output.
    back = torch.empty_like(regrouped).index_copy_(0, index, regrouped)
    assert back.view(hkv, tokens, group, d).transpose(0, 1).reshape_as(query).equal(query)


# -- a per-head layout evicted again (kv_decode): heads of different lengths --------------------
def _uneven(seed=0, lengths=(20, 12, 28), garbage=0.0):
    """Scores [3, 28] of heads holding ``lengths`` entries; the padding holds ``garbage``."""
    scores = _scores(3, max(lengths), seed)
    for h, n in enumerate(lengths):
        scores[h, n:] = garbage
    return scores, torch.tensor(lengths)


def _adaptive_keep_by_hand(scores, keep, lengths, sinks, recent, alpha=0.2):
    """AdaKV's rule over uneven heads, entry by entry: each head's own best min(floor, n_h)
    (its sinks and recent entries first), then the layer's best of the rest."""
    heads = scores.shape[0]
    floor = max(int(alpha * keep), sinks + recent)
    kept = torch.zeros(scores.shape, dtype=torch.bool)
    rest = []
    for h in range(heads):
        n = int(lengths[h])
        fixed = [i for i in range(n) if i < sinks or i >= n - recent]
        free = sorted((i for i in range(n) if i not in fixed), key=lambda i: (-scores[h, i], i))
        ranked = fixed + free
        for i in ranked[: min(floor, n)]:
            kept[h, i] = True
        rest += [(-float(scores[h, i]), h, i) for i in ranked[min(floor, n) :]]
    for _, h, i in sorted(rest)[: keep * heads - int(kept.sum())]:
        kept[h, i] = True
    return kept


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("sinks", "recent"), [(0, 0), (2, 3)])
def test_adakv_over_heads_of_different_lengths_is_its_rule_entry_by_entry(seed, sinks, recent):
    scores, lengths = _uneven(seed)
    for keep in (6, 12, 18):
        got = adaptive_keep(scores, keep, sinks=sinks, recent=recent, lengths=lengths)
        want = _adaptive_keep_by_hand(scores, keep, lengths, sinks, recent)
        assert got.equal(want), keep
        assert not got[0, 20:].any() and not got[1, 12:].any()  # never the padding
    # What the padding holds does not matter; equal lengths select as no lengths.
    noisy, _ = _uneven(seed, garbage=1e9)
    assert adaptive_keep(noisy, 12, lengths=lengths).equal(adaptive_keep(scores, 12,
                                                                         lengths=lengths))
    full = _scores(3, 28, seed)
    assert adaptive_keep(full, 12, lengths=torch.tensor([28] * 3)).equal(adaptive_keep(full, 12))


@pytest.mark.parametrize("seed", range(6))
def test_head_blocks_over_heads_of_different_lengths_keep_each_heads_tail_and_fill_the_body(
    seed,
):
    lengths = (22, 14, 30)  # each head: whole blocks of 4, then a tail of 2
    scores, lens = _uneven(seed, lengths=lengths)
    tail, body_blocks = 2, 4  # 12 head-blocks shared out; the heads' bodies hold 5 + 3 + 7
    kept = adaptive_head_blocks(scores, tail=tail, body_blocks=body_blocks, block_size=BS,
                                recent=3, sinks=1, lengths=lens)  # fmt: skip
    counts = [(len(k) - tail) // BS for k in kept]
    assert sum(counts) == body_blocks * 3
    for h, (index, n) in enumerate(zip(kept, lengths, strict=True)):
        assert index.tolist() == sorted(index.tolist()) and int(index.max()) < n
        assert index[-tail:].tolist() == [n - 2, n - 1]  # the tail block, where it is
        assert counts[h] * BS <= n - tail
        assert {0, n - 3} <= set(index.tolist())  # the sink and the recent entry
    garbage, _ = _uneven(seed, lengths=lengths, garbage=-1e9)
    again = adaptive_head_blocks(garbage, tail=tail, body_blocks=body_blocks, block_size=BS,
                                 recent=3, sinks=1, lengths=lens)  # fmt: skip
    assert [k.tolist() for k in again] == [k.tolist() for k in kept]
    full = _scores(3, 22, seed)
    assert [k.tolist() for k in adaptive_head_blocks(
        full, tail=2, body_blocks=3, block_size=BS, lengths=torch.tensor([22] * 3))] == [
        k.tolist() for k in adaptive_head_blocks(full, tail=2, body_blocks=3, block_size=BS)]


def test_head_residents_find_each_heads_entries_in_the_uniformly_gathered_cache():
    """A row's cache laid out per head (head-blocks of the body, head by head, then the stock
    columns each head's own), gathered slot by slot as every layer gathers it: the index
    gives back each head's entries in order."""
    hkv, body_blocks, counts, n = 3, 3, [5, 1, 3], 3 * BS + 6  # 3 body blocks, 6 stock slots
    gathered = torch.zeros((hkv, n), dtype=torch.int64)  # entry ids as the cache holds them
    want = [[] for _ in range(hkv)]
    slot = 0
    for h, count in enumerate(counts):  # body slot s: column s // Hkv, head part s % Hkv
        for _ in range(count):
            col, part = slot // hkv, slot % hkv
            ids = [1000 * h + len(want[h]) + i for i in range(BS)]
            gathered[part, col * BS : (col + 1) * BS] = torch.tensor(ids)
            want[h] += ids
            slot += 1
    for h in range(hkv):  # the stock columns: each head its own part
        ids = [1000 * h + 500 + j for j in range(n - body_blocks * BS)]
        gathered[h, body_blocks * BS :] = torch.tensor(ids)
        want[h] += ids
    index, lengths, in_body = head_residents(counts, body_blocks, n, BS)
    assert lengths.tolist() == [c * BS + 6 for c in counts]
    flat = gathered.reshape(-1)[index]
    for h in range(hkv):
        assert flat[h, : lengths[h]].tolist() == want[h]
        assert in_body[h].sum() == counts[h] * BS and in_body[h, : counts[h] * BS].all()
    with pytest.raises(ValueError):
        head_residents([5, 1, 2], body_blocks, n, BS)  # do not fill the body


def test_snapkv_scores_a_per_head_layout_as_each_head_alone():
    """``head_scores`` over heads padded to the longest (padding unseen by every query) is each
    head's own ``prefill_scores`` (one KV head, its query heads), pooled over its own entries."""
    from obcache_vllm.scoring import HeadGeometry, make_scorer

    gen = torch.Generator().manual_seed(3)
    geom, lengths = HeadGeometry(6, 3, 8, 8**-0.5), torch.tensor([20, 9, 14])
    width, window = int(lengths.max()), 5
    k, v = torch.randn((width, 3, 8), generator=gen), torch.randn((width, 3, 8), generator=gen)
    q = torch.randn((window, 6, 8), generator=gen)
    q_pos = torch.arange(100, 100 + window)
    k_pos = torch.arange(width).expand(3, -1).clone()
    k_pos[torch.arange(width) >= lengths.view(-1, 1)] = 1 << 62
    pipe = make_pipeline("adakv", window=4)
    for name in ("attn", "obcache_key"):
        scorer = make_scorer(name)
        got = pipe.head_scores(scorer, q, k, v, geom, q_pos, k_pos, lengths)
        one = HeadGeometry(2, 1, 8, 8**-0.5)
        for h, n in enumerate(lengths.tolist()):
            alone = pipe.prefill_scores(scorer, q[:, 2 * h : 2 * h + 2], k[:n, h : h + 1],
                                        v[:n, h : h + 1], one, q_pos, k_pos[h, :n])  # fmt: skip
            torch.testing.assert_close(got[h, :n], alone[0], rtol=1e-5, atol=1e-7)
            assert not got[h, n:].any()
