"""Scorers against independent oracles: forward-mode JVP of the attention output, exact
perturbation of V, explicit [W, T, D] formulas per query head, and the GQA sum.

Glossary: W window queries, T resident entries, Hq/Hkv heads, G = Hq // Hkv, D head dim.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from obcache_vllm.scoring import SCORER_NAMES, HeadGeometry, make_scorer

pytestmark = [
    pytest.mark.unit,
    # torch.func's first use imports code that still calls torch.jit.script.
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning"),
]

F64 = torch.float64
ATTENTION_SCORERS = ("attn", "value_norm", "obcache_value", "obcache_key", "obcache_joint",
                     "dropkv")  # fmt: skip
OBCACHE_KINDS = ("obcache_value", "obcache_key", "obcache_joint")


# ---------------------------------------------------------------- inputs and oracles


def make_inputs(geom: HeadGeometry, num_w: int, num_t: int, seed: int, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_w, geom.num_q_heads, geom.head_dim, generator=gen, dtype=F64)
    k = torch.randn(num_t, geom.num_kv_heads, geom.head_dim, generator=gen, dtype=F64)
    v = torch.randn(num_t, geom.num_kv_heads, geom.head_dim, generator=gen, dtype=F64)
    # Spread the logits so that A and Z vary a lot between positions.
    return (2.0 * q).to(dtype), k.to(dtype), v.to(dtype)


def default_positions(num_w: int, num_t: int):
    return torch.arange(num_t - num_w, num_t), torch.arange(num_t)


def evicted_positions(geom: HeadGeometry, num_w: int, num_t: int, seed: int):
    """Heads holding different logical tokens (after an eviction), queries in the middle/end."""
    gen = torch.Generator().manual_seed(seed + 100)
    span = 3 * num_t
    k_pos = torch.stack(
        [
            torch.randperm(span, generator=gen)[:num_t].sort().values
            for _ in range(geom.num_kv_heads)
        ]
    )  # [Hkv, T]
    q_pos = torch.randint(span // 3, span, (num_w,), generator=gen)  # [W], unsorted on purpose
    return q_pos, k_pos


def visibility(q_pos, k_pos, kv_head):
    kp = k_pos if k_pos.dim() == 1 else k_pos[kv_head]
    return kp[None, :] <= q_pos[:, None]  # [W, T]


def attention_output(q, k, v, geom, q_pos, k_pos):
    """O(K, V) [..., W, Hq, D] for all query heads, causal by logical position.

    k, v may carry leading batch dims [..., T, Hkv, D] (one copy per JVP direction). The scale
    multiplies q, not the logits: a Python scalar times a forward-AD dual tensor imports
    torch._dynamo (seconds) in this torch version.
    """
    heads = []
    for h in range(geom.num_q_heads):
        kv = h // geom.group
        z = torch.matmul(q[:, h] * geom.scale, k[..., kv, :].transpose(-1, -2))  # [..., W, T]
        z = z.masked_fill(~visibility(q_pos, k_pos, kv), float("-inf"))
        heads.append(torch.softmax(z, dim=-1) @ v[..., kv, :])  # [..., W, D]
    return torch.stack(heads, dim=-2)  # [..., W, Hq, D]


def jvp_scores(kind, q, k, v, geom, q_pos, k_pos):
    """|J . (direction zeroing row p of K and/or V of one KV head)|^2, via torch.func.jvp.

    All Hkv * T directions in one jvp: the primal is repeated along a leading direction axis
    n = kv * T + p, whose tangent zeroes row p of head kv. (No vmap: under vmap, forward-mode
    AD of these ops imports torch._dynamo, seconds.)
    """
    num_t, h_kv = k.shape[0], geom.num_kv_heads
    rows = torch.arange(h_kv * num_t)
    one_hot = torch.zeros(h_kv * num_t, num_t, h_kv, 1, dtype=F64)  # [N, T, Hkv, 1]
    one_hot[rows, rows % num_t, rows // num_t] = 1.0
    zero = torch.zeros_like(one_hot)
    dk = -one_hot * k if kind in ("obcache_key", "obcache_joint") else zero * k  # [N, T, Hkv, D]
    dv = -one_hot * v if kind in ("obcache_value", "obcache_joint") else zero * v
    primal = (k.expand_as(dk).clone(), v.expand_as(dv).clone())

    def fn(keys, values):
        return attention_output(q, keys, values, geom, q_pos, k_pos)  # [N, W, Hq, D]

    _, d_out = torch.func.jvp(fn, primal, (dk, dv))
    return d_out.square().sum(dim=(1, 2, 3)).view(h_kv, num_t)


def explicit_scores(kind, q, k, v, geom, q_pos, k_pos):
    """The paper's per-(i, p) formulas with an explicit [W, T, D] difference, per query head."""
    out = torch.zeros(geom.num_kv_heads, k.shape[0], dtype=F64)
    for h in range(geom.num_q_heads):
        kv = h // geom.group
        vis = visibility(q_pos, k_pos, kv)  # [W, T]
        z = (q[:, h].double() @ k[:, kv].double().T) * geom.scale  # [W, T]
        a = torch.softmax(z.masked_fill(~vis, float("-inf")), dim=-1)  # [W, T]
        z = z.masked_fill(~vis, 0.0)
        vals = v[:, kv].double()  # [T, D]
        o = a @ vals  # [W, D]
        diff = vals[None, :, :] - o[:, None, :]  # [W, T, D]
        if kind == "attn":
            term = a
        elif kind == "value_norm":
            term = a * vals.abs().sum(-1)[None]
        elif kind == "obcache_value":
            term = a.square() * vals.square().sum(-1)[None]
        elif kind == "obcache_key":
            term = (a * z).square() * diff.square().sum(-1)
        elif kind == "dropkv":
            term = (a / (1 - a)).square() * diff.square().sum(-1)
        else:  # joint: |A (1 + Z) v_p - A Z o_i|^2
            term = (
                ((a * (1 + z))[..., None] * vals[None] - (a * z)[..., None] * o[:, None])
                .square()
                .sum(-1)
            )
        out[kv] += term.sum(0)
    return out


def assert_rel_close(actual, expected, rel):
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * scale)


GEOMETRIES = [
    pytest.param(HeadGeometry(9, 3, 16), id="gqa-9q-3kv"),
    pytest.param(HeadGeometry(4, 4, 8), id="mha-4"),
    pytest.param(HeadGeometry(6, 1, 8, scale=0.3), id="mqa-6q-scale0.3"),
]
POSITIONS = [pytest.param("default", id="causal-tail"), pytest.param("evicted", id="per-head-kpos")]


def case_inputs(geom, positions, seed, num_w=5, num_t=17):
    q, k, v = make_inputs(geom, num_w, num_t, seed)
    if positions == "default":
        q_pos, k_pos = default_positions(num_w, num_t)
        call_pos = (None, None)
    else:
        q_pos, k_pos = evicted_positions(geom, num_w, num_t, seed)
        call_pos = (q_pos, k_pos)
    return q, k, v, q_pos, k_pos, call_pos


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("kind", [pytest.param(k, id=k) for k in OBCACHE_KINDS])
@pytest.mark.parametrize("geom", GEOMETRIES)
@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_obcache_score_equals_squared_jvp(kind, geom, positions, seed):
    q, k, v, q_pos, k_pos, call_pos = case_inputs(geom, positions, seed)
    got = make_scorer(kind)(q, k, v, geom, *call_pos)
    assert got.dtype == F64 and got.shape == (geom.num_kv_heads, k.shape[0])
    assert_rel_close(got, jvp_scores(kind, q, k, v, geom, q_pos, k_pos), rel=1e-9)


@pytest.mark.parametrize("kind", [pytest.param(k, id=k) for k in ATTENTION_SCORERS])
@pytest.mark.parametrize("geom", GEOMETRIES)
@pytest.mark.parametrize("positions", POSITIONS)
def test_score_equals_explicit_formula(kind, geom, positions):
    q, k, v, q_pos, k_pos, call_pos = case_inputs(geom, positions, seed=7, num_w=6, num_t=23)
    got = make_scorer(kind)(q, k, v, geom, *call_pos)
    assert_rel_close(got, explicit_scores(kind, q, k, v, geom, q_pos, k_pos), rel=1e-10)


@pytest.mark.parametrize("positions", POSITIONS)
def test_obcache_value_is_exact_output_change_of_zeroing_v(positions):
    geom = HeadGeometry(9, 3, 16)
    q, k, v, q_pos, k_pos, call_pos = case_inputs(geom, positions, seed=3)
    got = make_scorer("obcache_value")(q, k, v, geom, *call_pos)
    base = attention_output(q, k, v, geom, q_pos, k_pos)
    for kv in range(geom.num_kv_heads):
        for p in range(k.shape[0]):
            v_cut = v.clone()
            v_cut[p, kv] = 0.0
            delta = attention_output(q, k, v_cut, geom, q_pos, k_pos) - base
            assert got[kv, p].item() == pytest.approx(
                delta.square().sum().item(), rel=1e-10, abs=1e-14
            )


@pytest.mark.parametrize("positions", POSITIONS)
def test_dropkv_is_exact_output_change_of_evicting_one_token(positions):
    """Each token's score is the window outputs' squared change when that token alone is
    evicted (its key hidden, the softmax renormalised over the rest), summed over the rows and
    the KV head's query heads."""
    geom = HeadGeometry(9, 3, 16)
    q, k, v, q_pos, k_pos, call_pos = case_inputs(geom, positions, seed=4)
    got = make_scorer("dropkv")(q, k, v, geom, *call_pos)
    base = attention_output(q, k, v, geom, q_pos, k_pos)
    kp = k_pos if k_pos.dim() == 2 else k_pos.expand(geom.num_kv_heads, -1)
    for kv in range(geom.num_kv_heads):
        for p in range(k.shape[0]):
            hidden = kp.clone()
            hidden[kv, p] = 10**9  # after every query: never visible
            cut = attention_output(q, k, v, geom, q_pos, hidden)
            heads = slice(kv * geom.group, (kv + 1) * geom.group)
            delta = (cut - base)[:, heads].nan_to_num()  # a row left with nothing: no output
            assert got[kv, p].item() == pytest.approx(
                delta.square().sum().item(), rel=1e-9, abs=1e-12
            ), (kv, p)


def test_dropkv_stays_finite_where_one_token_holds_a_rows_attention():
    """A row whose only visible token holds all its attention (A = 1, the formula inf * 0)
    adds nothing: the scores are the other rows' alone."""
    geom = HeadGeometry(2, 1, 8)
    q, k, v = make_inputs(geom, 2, 6, seed=9)
    q_pos, k_pos = torch.tensor([0, 5]), torch.arange(6)  # query 0 sees token 0 alone
    got = make_scorer("dropkv")(q, k, v, geom, q_pos, k_pos)
    others = make_scorer("dropkv")(q[1:], k, v, geom, q_pos[1:], k_pos)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, others, rtol=1e-12, atol=1e-12)


def test_dropkv_near_a_saturated_row_is_as_exact_from_float32_inputs():
    """One token takes all but ~1e-4 of a row's attention: float32 inputs score as the fp64
    computation does (a float32 computation's |v - o|^2 there is mostly rounding)."""
    geom = HeadGeometry(1, 1, 8)
    q, k, v = make_inputs(geom, 3, 12, seed=11)
    k[0, 0] = q[-1, 0] * 2.0  # the last query's logit on token 0 towers over the rest
    wide = make_scorer("dropkv")(q, k, v, geom)
    narrow = make_scorer("dropkv")(q.float(), k.float(), v.float(), geom)
    assert narrow.dtype == torch.float32
    torch.testing.assert_close(narrow.double(), wide, rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("kind", [pytest.param(k, id=k) for k in ATTENTION_SCORERS])
def test_gqa_score_is_sum_over_query_heads(kind):
    """A KV head's score == sum of the single-head scores of its G query heads."""
    geom = HeadGeometry(9, 3, 16)
    q, k, v, q_pos, k_pos, _ = case_inputs(geom, "evicted", seed=5, num_w=4, num_t=19)
    scorer = make_scorer(kind)
    got = scorer(q, k, v, geom, q_pos, k_pos)
    single = HeadGeometry(1, 1, 16)
    for kv in range(geom.num_kv_heads):
        expected = sum(
            scorer(q[:, h : h + 1], k[:, kv : kv + 1], v[:, kv : kv + 1], single, q_pos, k_pos[kv])[
                0
            ]
            for h in range(kv * geom.group, (kv + 1) * geom.group)
        )
        torch.testing.assert_close(got[kv], expected, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------- masking, dtypes, baselines


@pytest.mark.parametrize("kind", [pytest.param(k, id=k) for k in ATTENTION_SCORERS])
def test_hidden_keys_score_zero_and_blind_queries_are_ignored(kind):
    geom = HeadGeometry(4, 2, 8)
    q, k, v = make_inputs(geom, 3, 10, seed=11)
    k_pos = torch.arange(10, 20)
    q_pos = torch.tensor([5, 14, 16])  # query 0 sees no key at all; keys 17.. are seen by none
    got = make_scorer(kind)(q, k, v, geom, q_pos, k_pos)
    assert torch.isfinite(got).all()
    assert (got[:, 7:] == 0).all() and (got[:, :5] > 0).all()
    expected = make_scorer(kind)(q[1:], k, v, geom, q_pos[1:], k_pos)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("kind", [pytest.param(k, id=k) for k in SCORER_NAMES])
@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(torch.bfloat16, id="bf16"),
        pytest.param(torch.float16, id="fp16"),
        pytest.param(torch.float32, id="fp32"),
    ],
)
def test_low_precision_inputs_give_fp32_scores(kind, dtype):
    geom = HeadGeometry(9, 3, 16)
    q, k, v = make_inputs(geom, 4, 33, seed=2, dtype=dtype)
    got = make_scorer(kind)(q, k, v, geom)
    assert got.dtype == torch.float32 and got.shape == (3, 33)
    # Same inputs, upcast to fp64 first: only fp32 rounding separates the two.
    expected = make_scorer(kind)(q.double(), k.double(), v.double(), geom)
    assert expected.dtype == F64
    assert_rel_close(got.double(), expected, rel=1e-4)


def test_key_norm_keeps_low_key_norms():
    geom = HeadGeometry(4, 2, 8)
    q, k, v = make_inputs(geom, 2, 9, seed=0)
    got = make_scorer("key_norm")(q, k, v, geom)
    torch.testing.assert_close(got, -k.norm(dim=-1).T)
    assert torch.equal(got, make_scorer("key_norm")(q[:0], k, v, geom))  # query-free


def test_random_is_deterministic_per_seed():
    geom = HeadGeometry(4, 2, 8)
    q, k, v = make_inputs(geom, 2, 50, seed=0, dtype=torch.float32)
    first = make_scorer("random", seed=3)(q, k, v, geom)
    assert torch.equal(first, make_scorer("random", seed=3)(q, k, v, geom))
    assert not torch.equal(first, make_scorer("random", seed=4)(q, k, v, geom))
    assert first.shape == (2, 50) and ((first >= 0) & (first < 1)).all()


def test_registry_names_and_errors():
    assert SCORER_NAMES == (
        "attn",
        "value_norm",
        "obcache_value",
        "obcache_key",
        "obcache_joint",
        "dropkv",
        "key_norm",
        "random",
    )
    for name in SCORER_NAMES:
        scorer = make_scorer(name)
        assert scorer.name == name
        assert scorer.needs_attention == (name not in ("key_norm", "random"))
    with pytest.raises(ValueError, match="obcache_joint"):
        make_scorer("obcache")
    with pytest.raises(ValueError, match="bad options"):
        make_scorer("attn", seed=1)


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(dict(num_q_heads=9, num_kv_heads=2, head_dim=8), id="not-a-multiple"),
        pytest.param(dict(num_q_heads=0, num_kv_heads=1, head_dim=8), id="zero-heads"),
        pytest.param(dict(num_q_heads=2, num_kv_heads=1, head_dim=8, scale=-1.0), id="neg-scale"),
    ],
)
def test_geometry_validation(args):
    with pytest.raises(ValueError):
        HeadGeometry(**args)


def test_geometry_defaults():
    geom = HeadGeometry(9, 3, 64)
    assert (geom.group, geom.scale) == (3, 0.125)
    assert HeadGeometry(9, 3, 64, scale=0.5).scale == 0.5


def test_shape_errors():
    geom = HeadGeometry(4, 2, 8)
    q, k, v = make_inputs(geom, 3, 10, seed=0)
    scorer = make_scorer("obcache_key")
    with pytest.raises(ValueError, match="q must be"):
        scorer(q[:, :3], k, v, geom)
    with pytest.raises(ValueError, match="k must be"):
        scorer(q, k[:, :1], v, geom)
    with pytest.raises(ValueError, match="last positions"):
        scorer(torch.cat([q] * 4), k, v, geom)  # 12 queries cannot be the last of 10 keys
    with pytest.raises(ValueError, match="q_pos is required"):
        scorer(q, k, v, geom, None, torch.arange(10))


def test_empty_window_or_cache_scores_zero():
    geom = HeadGeometry(4, 2, 8)
    q, k, v = make_inputs(geom, 3, 10, seed=0)
    for name in SCORER_NAMES:
        assert make_scorer(name)(q, k[:0], v[:0], geom).shape == (2, 0)
    assert torch.equal(
        make_scorer("obcache_joint")(q[:0], k, v, geom), torch.zeros(2, 10, dtype=F64)
    )


# ---------------------------------------------------------------- no [W, T, D] temporary


class _LargestOutput(TorchFunctionMode):
    """Records the largest tensor returned by any torch call made from Python.

    (A TorchDispatchMode would see aten ops too, but imports torch._dynamo: seconds.)
    """

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return result


@pytest.mark.parametrize("kind", [pytest.param(k, id=k) for k in ATTENTION_SCORERS])
def test_no_window_by_positions_by_dim_temporary(kind):
    geom = HeadGeometry(4, 2, 64)
    num_w, num_t = 16, 128
    q, k, v = make_inputs(geom, num_w, num_t, seed=0, dtype=torch.float32)
    with _LargestOutput() as probe:
        make_scorer(kind)(q, k, v, geom)
    # Legit: logits [Hkv, G*W, T] = 8192, per-position sums [Hkv, T, D+2] = 16896.
    assert probe.largest <= geom.num_kv_heads * num_t * (geom.head_dim + 2)
    assert probe.largest < num_w * num_t * geom.head_dim  # one head's [W, T, D] = 131072


@pytest.mark.parametrize("kind", [pytest.param(k, id=k) for k in ATTENTION_SCORERS])
@pytest.mark.parametrize("positions", POSITIONS)
def test_query_chunking_changes_nothing(kind, positions):
    geom = HeadGeometry(9, 3, 16)
    q, k, v, _, _, call_pos = case_inputs(geom, positions, seed=9, num_w=7, num_t=21)
    whole = make_scorer(kind)(q, k, v, geom, *call_pos)
    chunked = make_scorer(kind)
    chunked.chunk_elements = 2 * geom.num_q_heads * k.shape[0]  # 2 queries per chunk: 4 chunks
    torch.testing.assert_close(chunked(q, k, v, geom, *call_pos), whole, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("kind", [pytest.param(k, id=k) for k in SCORER_NAMES])
def test_input_layout_does_not_matter(kind):
    """Interleaved [T, Hkv, D], per-head views and T-slices of them give the same scores."""
    geom = HeadGeometry(9, 3, 16)
    q, k, v = make_inputs(geom, 4, 30, seed=4)
    expected = make_scorer(kind)(q, k[:20], v[:20], geom)
    k_heads, v_heads = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    views = make_scorer(kind)(
        q, k_heads[:, :20].transpose(0, 1), v_heads[:, :20].transpose(0, 1), geom
    )
    torch.testing.assert_close(views, expected, rtol=1e-13, atol=0.0)
    bf16 = make_scorer(kind)(
        q.bfloat16(),
        k_heads[:, :20].bfloat16().transpose(0, 1),
        v_heads[:, :20].bfloat16().transpose(0, 1),
        geom,
    )
    torch.testing.assert_close(
        bf16, make_scorer(kind)(q.bfloat16(), k[:20].bfloat16(), v[:20].bfloat16(), geom)
    )
