"""select_keep properties against a per-head Python oracle, and the pipelines on hand-made cases.

Glossary: W queries, T resident entries, Hq/Hkv heads, D head dim, K kept, S sinks, R recent.
"""

from __future__ import annotations

import pytest
import torch

from obcache_vllm.scoring import (
    PIPELINE_NAMES,
    HeadGeometry,
    make_pipeline,
    make_scorer,
    select_keep,
)

pytestmark = pytest.mark.unit

F64 = torch.float64


def oracle_keep(scores: torch.Tensor, keep: int, recent: int, sinks: int) -> list[list[int]]:
    """Per head: sinks + recent + the best (score desc, index asc) of the rest, sorted."""
    num_t = scores.shape[1]
    rows = []
    for row in scores.tolist():
        middle = sorted(range(sinks, num_t - recent), key=lambda p: (-row[p], p))
        chosen = (
            set(range(sinks))
            | set(range(num_t - recent, num_t))
            | set(middle[: keep - sinks - recent])
        )
        rows.append(sorted(chosen))
    return rows


# ---------------------------------------------------------------- select_keep

CASES = [
    pytest.param(3, 50, 20, 4, 2, id="T50-K20-R4-S2"),
    pytest.param(1, 7, 7, 3, 1, id="keep-all"),
    pytest.param(2, 9, 4, 4, 0, id="recent-only"),
    pytest.param(2, 9, 4, 0, 4, id="sinks-only"),
    pytest.param(4, 30, 5, 0, 0, id="scores-only"),
    pytest.param(3, 12, 0, 0, 0, id="keep-none"),
    pytest.param(8, 1000, 300, 64, 4, id="T1000-H8"),
]


@pytest.mark.parametrize("heads,num_t,keep,recent,sinks", CASES)
@pytest.mark.parametrize(
    "ties", [pytest.param(False, id="distinct"), pytest.param(True, id="many-ties")]
)
def test_select_keep_matches_oracle(heads, num_t, keep, recent, sinks, ties):
    gen = torch.Generator().manual_seed(num_t + keep)
    scores = torch.randn(heads, num_t, generator=gen)
    if ties:
        scores = scores.round()  # few distinct values: tie-breaking decides most slots
    got = select_keep(scores, keep=keep, recent=recent, sinks=sinks)
    assert got.dtype == torch.int64 and got.shape == (heads, keep)
    assert got.tolist() == oracle_keep(scores, keep, recent, sinks)
    if keep:
        assert (got[:, 1:] > got[:, :-1]).all()  # sorted, unique
    assert (got[:, :sinks] == torch.arange(sinks)).all()
    assert (got[:, keep - recent :] == torch.arange(num_t - recent, num_t)).all()
    assert torch.equal(got, select_keep(scores.clone(), keep=keep, recent=recent, sinks=sinks))


def test_ties_go_to_the_lower_index_and_nan_ranks_last():
    scores = torch.tensor(
        [[1.0, 2.0, 2.0, 2.0, 0.0, 2.0], [float("nan"), 0.0, float("nan"), -1.0, 5.0, 0.0]]
    )
    got = select_keep(scores, keep=3)
    assert got.tolist() == [[1, 2, 3], [1, 4, 5]]
    # +inf in the middle must not push out the recent window.
    inf = torch.tensor([[0.0, float("inf"), float("inf"), 0.0, 0.0]])
    assert select_keep(inf, keep=3, recent=2).tolist() == [[1, 3, 4]]
    flat = torch.tensor([[float("nan")] * 5, [float("-inf")] * 5, [7.0] * 5])
    assert select_keep(flat, keep=3, sinks=1).tolist() == [[0, 1, 2]] * 3


def test_heads_may_keep_different_tokens():
    scores = torch.tensor([[9.0, 1.0, 1.0, 9.0], [1.0, 9.0, 9.0, 1.0]])
    assert select_keep(scores, keep=2).tolist() == [[0, 3], [1, 2]]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        pytest.param(dict(keep=11), "cannot keep", id="keep>T"),
        pytest.param(dict(keep=5, recent=3, sinks=3), "exceed", id="S+R>K"),
        pytest.param(dict(keep=-1), "non-negative", id="negative"),
        pytest.param(dict(keep=4, recent=True), "non-negative int", id="bool"),
        pytest.param(dict(keep=4.0), "non-negative int", id="float"),
    ],
)
def test_select_keep_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        select_keep(torch.zeros(2, 10), **kwargs)
    with pytest.raises(ValueError, match="Hkv, T"):
        select_keep(torch.zeros(10), keep=1)


# ---------------------------------------------------------------- pipelines


class StubScorer:
    """Returns fixed scores and records what it was given."""

    name = "stub"
    needs_attention = True

    def __init__(self, scores):
        self.scores = scores
        self.calls = []

    def __call__(self, q, k, v, geom, q_pos=None, k_pos=None):
        self.calls.append((q, k, q_pos, k_pos))
        return self.scores[:, : k.shape[0]].clone()


def random_qkv(geom: HeadGeometry, num_w: int, num_t: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = 2.0 * torch.randn(num_w, geom.num_q_heads, geom.head_dim, generator=gen, dtype=F64)
    k = torch.randn(num_t, geom.num_kv_heads, geom.head_dim, generator=gen, dtype=F64)
    v = torch.randn(num_t, geom.num_kv_heads, geom.head_dim, generator=gen, dtype=F64)
    return q, k, v


GEOM = HeadGeometry(9, 3, 16)


def test_pipeline_registry_and_windows():
    assert PIPELINE_NAMES == ("snapkv", "h2o", "tova", "streaming", "adakv")
    windows = {name: make_pipeline(name).window for name in PIPELINE_NAMES}
    assert windows == {"snapkv": 64, "h2o": None, "tova": 1, "streaming": 0, "adakv": 64}
    owners = [n for n in PIPELINE_NAMES if make_pipeline(n).heads_own_memory]
    assert owners == ["adakv"]
    assert make_pipeline("snapkv", window=16).window == 16
    assert [make_pipeline(n).name for n in PIPELINE_NAMES] == list(PIPELINE_NAMES)
    with pytest.raises(ValueError, match="h2o"):
        make_pipeline("snap")
    with pytest.raises(ValueError, match="unknown options"):
        make_pipeline("tova", window=4)
    for bad in (dict(kernel=4), dict(pooling="median"), dict(window=0), dict(per_head="no")):
        with pytest.raises(ValueError):
            make_pipeline("snapkv", **bad)
    with pytest.raises(ValueError):
        make_pipeline("h2o", chunk_elements=0)


def test_snapkv_uses_the_last_window_queries_then_max_pools():
    scores = torch.tensor([[0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]]).expand(3, 10)
    stub = StubScorer(scores)
    q, k, v = random_qkv(GEOM, 6, 10, seed=0)
    pipe = make_pipeline("snapkv", window=4, pooling="max", kernel=3)
    got = pipe.prefill_scores(stub, q, k, v, GEOM)
    ((q_seen, k_seen, q_pos, k_pos),) = stub.calls
    assert torch.equal(q_seen, q[-4:]) and k_seen is k
    assert q_pos.tolist() == [6, 7, 8, 9] and k_pos.tolist() == list(range(10))
    assert got[0].tolist() == [0.0, 5.0, 5.0, 5.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "pooling,kernel,expected",
    [
        pytest.param("avg", 3, [2.0, 2.0, 3.0, 7 / 3, 7 / 3], id="avg3-counts-padding"),
        pytest.param("max", 5, [6.0, 6.0, 6.0, 6.0, 4.0], id="max5"),
        pytest.param("max", 1, [0.0, 6.0, 0.0, 3.0, 4.0], id="kernel1"),
        pytest.param("none", 7, [0.0, 6.0, 0.0, 3.0, 4.0], id="none"),
    ],
)
def test_snapkv_pooling_definitions(pooling, kernel, expected):
    stub = StubScorer(torch.tensor([[0.0, 6.0, 0.0, 3.0, 4.0]]).expand(3, 5))
    q, k, v = random_qkv(GEOM, 2, 5, seed=0)
    got = make_pipeline("snapkv", window=2, pooling=pooling, kernel=kernel).prefill_scores(
        stub, q, k, v, GEOM
    )
    torch.testing.assert_close(got[1], torch.tensor(expected))


def test_snapkv_with_attn_and_no_pooling_is_the_windowed_attention_mass():
    q, k, v = random_qkv(GEOM, 20, 40, seed=1)
    got = make_pipeline("snapkv", window=8, pooling="none").prefill_scores(
        make_scorer("attn"), q, k, v, GEOM
    )
    # Oracle: the attention rows of the last 8 positions (causal), summed per KV group.
    expected = torch.zeros(3, 40, dtype=F64)
    for h in range(9):
        logits = q[-8:, h] @ k[:, h // 3].T * GEOM.scale  # [8, T]
        causal = torch.arange(40)[None] <= torch.arange(32, 40)[:, None]
        expected[h // 3] += torch.softmax(logits.masked_fill(~causal, float("-inf")), -1).sum(0)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "name", [pytest.param(n, id=n) for n in ("attn", "obcache_key", "obcache_joint")]
)
@pytest.mark.parametrize(
    "chunk", [pytest.param(1 << 23, id="one-chunk"), pytest.param(300, id="chunks-of-2")]
)
def test_h2o_prefill_sums_every_query(name, chunk):
    """H2O = the sum over each prompt query of its own score (causal), chunking changes nothing."""
    q, k, v = random_qkv(GEOM, 13, 13, seed=2)
    scorer = make_scorer(name)
    got = make_pipeline("h2o", chunk_elements=chunk).prefill_scores(scorer, q, k, v, GEOM)
    expected = torch.zeros(3, 13, dtype=F64)
    for i in range(13):  # query i sees keys 0..i
        expected[:, : i + 1] += scorer(q[i : i + 1], k[: i + 1], v[: i + 1], GEOM)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    if name == "attn":  # each query row sums to 1 per query head: total mass = G * W per KV head
        torch.testing.assert_close(got.sum(-1), torch.full((3,), 3.0 * 13, dtype=F64))


def test_h2o_with_explicit_positions_and_query_free_scores():
    q, k, v = random_qkv(GEOM, 5, 12, seed=3)
    q_pos, k_pos = torch.tensor([3, 7, 9, 10, 11]), torch.arange(12)
    attn = make_scorer("attn")
    got = make_pipeline("h2o", chunk_elements=1).prefill_scores(attn, q, k, v, GEOM, q_pos, k_pos)
    torch.testing.assert_close(got, attn(q, k, v, GEOM, q_pos, k_pos), rtol=1e-12, atol=1e-14)
    key_norm = make_scorer("key_norm")  # query-free: computed once, not once per query
    torch.testing.assert_close(
        make_pipeline("h2o").prefill_scores(key_norm, q, k, v, GEOM, q_pos, k_pos),
        key_norm(q, k, v, GEOM),
    )


def test_tova_scores_the_last_query_only():
    q, k, v = random_qkv(GEOM, 6, 15, seed=4)
    scorer = make_scorer("obcache_key")
    got = make_pipeline("tova").prefill_scores(scorer, q, k, v, GEOM)
    torch.testing.assert_close(got, scorer(q[-1:], k, v, GEOM), rtol=0, atol=0)


def test_streaming_keeps_sinks_and_the_most_recent():
    stub = StubScorer(torch.randn(3, 20))
    q, k, v = random_qkv(GEOM, 4, 20, seed=5)
    pipe = make_pipeline("streaming")
    scores = pipe.prefill_scores(stub, q, k, v, GEOM)
    assert stub.calls == [] and torch.equal(scores, torch.zeros(3, 20, dtype=F64))
    keep = pipe.select(torch.randn(3, 20), keep=8, recent=2, sinks=3)
    assert keep.tolist() == [[0, 1, 2, 15, 16, 17, 18, 19]] * 3


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in ("snapkv", "h2o", "tova")])
def test_pipeline_select_per_head_or_shared(name):
    scores = torch.tensor(
        [[5.0, 0.0, 0.0, 3.0, 0.0], [0.0, 4.0, 0.0, 0.0, 0.0], [0.0, 0.0, 4.0, 0.0, 0.0]]
    )
    assert make_pipeline(name).select(scores, keep=3, recent=1).tolist() == [
        [0, 3, 4],
        [0, 1, 4],
        [0, 2, 4],
    ]
    shared = make_pipeline(name, per_head=False).select(scores, keep=3, recent=1)
    assert (
        shared.tolist() == [[0, 1, 4]] * 3
    )  # layer sums: [5, 4, 4, 3, 0] -> 0, then 1 (tie -> lower)


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in ("attn", "obcache_key")])
def test_swapping_the_score_changes_only_the_score(name):
    """h2o + X == select(sum of X over all queries): the pipeline is score-agnostic."""
    q, k, v = random_qkv(GEOM, 16, 16, seed=6)
    pipe, scorer = make_pipeline("h2o"), make_scorer(name)
    scores = pipe.prefill_scores(scorer, q, k, v, GEOM)
    expected = torch.zeros(3, 16, dtype=F64)
    for i in range(16):
        expected[:, : i + 1] += scorer(q[i : i + 1], k[: i + 1], v[: i + 1], GEOM)
    assert torch.equal(
        pipe.select(scores, keep=6, recent=2, sinks=1),
        select_keep(expected, keep=6, recent=2, sinks=1),
    )


@pytest.mark.parametrize("name", ["snapkv", "h2o", "tova", "streaming"])
@pytest.mark.parametrize("per_head", [True, False])
def test_select_batch_equals_select_of_each_request(name, per_head):
    from obcache_vllm.scoring import make_pipeline

    pipeline = make_pipeline(name, per_head=per_head)
    scores = torch.randn(5, 3, 40, generator=torch.Generator().manual_seed(1))
    scores[2, :, 7] = scores[2, :, 8]  # ties
    batch = pipeline.select_batch(scores, keep=17, recent=4, sinks=2)
    assert batch.shape == (5, 3, 17)
    for r in range(5):
        assert torch.equal(batch[r], pipeline.select(scores[r], keep=17, recent=4, sinks=2))
