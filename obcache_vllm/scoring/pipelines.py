"""Eviction pipelines: which queries feed the score, how it is post-processed, how it is kept.

A pipeline never computes a score itself: it calls whatever scorer it is given (paper's claim:
``h2o`` + ``attn`` is H2O, ``h2o`` + ``obcache_key`` is H2O+OBCache-K).

  snapkv     the last ``window`` queries (default 64), then 1-D pooling over positions
  h2o        all the queries given (all prompt queries at prefill); a running sum at decode
  tova       the last query only; at decode, the newest query's score replaces the old one
  streaming  no score: the first ``sinks`` and the most recent entries (StreamingLLM)
  adakv      snapkv's scores; the layer's total spread over its KV heads (AdaKV), each head
             in memory of its own (``heads_own_memory``)

Glossary: W queries given, T resident entries, Hq/Hkv heads, D head dim, K kept per head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from obcache_vllm.scoring.attention import compute_dtype, heads_first, resolve_positions
from obcache_vllm.scoring.geometry import HeadGeometry
from obcache_vllm.scoring.running import RunningScores
from obcache_vllm.scoring.scores import Scorer
from obcache_vllm.scoring.selection import select_keep, share_across_heads


@dataclass(frozen=True)
class Pipeline:
    """Base: prefill scores, then ``select``. ``per_head=False`` shares one ranking per layer."""

    name: ClassVar[str]
    # Decode-time accumulation of per-step scores: "sum", "last", or None (no decode scoring).
    running_mode: ClassVar[Literal["sum", "last"] | None]
    # False: the pipeline never calls its scorer (its selection ignores scores).
    scored: ClassVar[bool] = True
    # Request options (``KvOptions`` field names) passed to the constructor: snapkv's window.
    takes_options: ClassVar[tuple[str, ...]] = ()
    # Its scores sum every query it has seen, prompt and decode: that state would have to
    # travel with a continued cache (``kv_session``) and could not start late (``kv_when``
    # "pressure"), so both are refused for it.
    sums_every_query: ClassVar[bool] = False
    # Its heads keep different numbers of entries, each in head-blocks of its own
    # (``select_heads``): the engine lays the request's cache out per head after its one
    # eviction, so nothing that assumes one block table for all heads may follow it.
    heads_own_memory: ClassVar[bool] = False
    # The uniform pipeline whose scores it reallocates (evaluations pair it with that host at
    # the same scorer and budget), or None.
    host: ClassVar[str | None] = None

    per_head: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.per_head, bool):
            raise ValueError(f"per_head must be a bool, got {self.per_head!r}")

    def select_heads(self, scores: Tensor, *, tail: int, body_blocks: int, block_size: int,
                     recent: int, sinks: int, lengths: Tensor | None = None
                     ) -> list[Tensor]:  # fmt: skip
        """A pipeline whose heads own their memory (``heads_own_memory``): each KV head's kept
        indices, in whole head-blocks of the body and the ``tail`` whole. ``lengths`` [Hkv]:
        how many of the T columns each head holds (its layout after an earlier eviction)."""
        raise NotImplementedError(f"{self.name}: its heads share one layout (no select_heads)")

    def head_scores(self, scorer: Scorer, q: Tensor, k: Tensor, v: Tensor, geom: HeadGeometry,
                    q_pos: Tensor, k_pos: Tensor, lengths: Tensor) -> Tensor:  # fmt: skip
        """``prefill_scores`` of a cache whose heads hold different numbers of entries.

        k, v [T, Hkv, D]: head h's entries are its first ``lengths[h]`` columns, the rest
        padding whose ``k_pos`` [Hkv, T] no query reaches; any pooling runs over each head's
        own entries. Returns [Hkv, T], 0 past each head's length.
        """
        raise NotImplementedError(f"{self.name}: its heads share one layout (no head_scores)")

    @property
    def window(self) -> int | None:
        """How many LAST queries the pipeline wants at prefill; None = all of them."""
        raise NotImplementedError

    def prefill_scores(
        self,
        scorer: Scorer,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        geom: HeadGeometry,
        q_pos: Tensor | None = None,
        k_pos: Tensor | None = None,
    ) -> Tensor:
        """Scores [Hkv, T] from q [W, Hq, D] and k, v [T, Hkv, D] (fp32, fp64 for fp64 inputs)."""
        raise NotImplementedError

    def select(
        self, scores: Tensor, keep: int, recent: int = 0, sinks: int = 0,
        reduce: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor:  # fmt: skip
        """Sorted kept indices LongTensor [Hkv, K] (see ``select_keep``).

        ``reduce``: with ``per_head=False``, sums the layer ranking across the holders of the
        other heads (see ``share_across_heads``); per-head selection never needs it.
        """
        if not self.per_head:
            scores = share_across_heads(scores, reduce)
        return select_keep(scores, keep=keep, recent=recent, sinks=sinks)

    def select_batch(self, scores: Tensor, keep: int, recent: int = 0, sinks: int = 0) -> Tensor:
        """``select`` of R requests at once: scores [R, Hkv, T] -> kept indices [R, Hkv, K].

        Equal to ``select`` of each request (the shared ranking sums each request's own heads).
        """
        rows, heads, num_t = scores.shape
        if not self.per_head:
            scores = scores.sum(dim=1, keepdim=True).expand(rows, heads, num_t)
        kept = select_keep(scores.reshape(rows * heads, num_t), keep=keep, recent=recent,
                           sinks=sinks)  # fmt: skip
        return kept.view(rows, heads, keep)

    def make_running(
        self, num_kv_heads: int, dtype: torch.dtype = torch.float32
    ) -> RunningScores | None:
        """Decode-time running scores for one request and layer, or None if not scored."""
        if self.running_mode is None:
            return None
        return RunningScores(num_kv_heads, mode=self.running_mode, dtype=dtype)


def _last_queries(
    count: int, q: Tensor, k: Tensor, q_pos: Tensor | None, k_pos: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """The last ``count`` queries with their resolved positions."""
    q_pos, k_pos = resolve_positions(q.shape[0], k.shape[0], q_pos, k_pos, k.device)
    return q[-count:], q_pos[-count:], k_pos


@dataclass(frozen=True)
class SnapKV(Pipeline):
    """SnapKV: score of the last ``window`` queries (all of them if fewer are given), pooled over
    positions (stride 1).

    Pooling (``max``, ``avg`` or ``none``) runs after the window sum, over all T positions, with
    padding ``kernel // 2`` so the length is kept (avg counts the padding, as kvpress does).
    Prefill-only by definition, so no decode-time running score.
    """

    name = "snapkv"
    running_mode = None
    takes_options = ("window",)

    window: int = 64  # a field here, a read-only property in the other pipelines
    pooling: Literal["max", "avg", "none"] = "max"
    kernel: int = 7

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"snapkv window must be an int >= 1, got {self.window!r}")
        if self.pooling not in ("max", "avg", "none"):
            raise ValueError(f"snapkv pooling must be 'max', 'avg' or 'none', got {self.pooling!r}")
        if not isinstance(self.kernel, int) or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"snapkv kernel must be a positive odd int, got {self.kernel}")

    def prefill_scores(self, scorer, q, k, v, geom, q_pos=None, k_pos=None) -> Tensor:
        q, q_pos, k_pos = _last_queries(self.window, q, k, q_pos, k_pos)
        scores = scorer(q, k, v, geom, q_pos, k_pos)  # [Hkv, T]
        return pool_positions(scores, self.pooling, self.kernel)

    def head_scores(self, scorer, q, k, v, geom, q_pos, k_pos, lengths) -> Tensor:
        q, q_pos, k_pos = _last_queries(self.window, q, k, q_pos, k_pos)
        scores = scorer(q, k, v, geom, q_pos, k_pos)  # [Hkv, T]
        out = torch.zeros_like(scores)
        for head, length in enumerate(lengths.tolist()):  # each head pooled over its own
            out[head, :length] = pool_positions(scores[head : head + 1, :length], self.pooling,
                                                self.kernel)[0]  # fmt: skip
        return out


def pool_positions(scores: Tensor, pooling: str, kernel: int) -> Tensor:
    """1-D pooling over positions, stride 1, padding kernel // 2: [Hkv, T] -> [Hkv, T]."""
    if pooling == "none" or kernel == 1 or scores.shape[-1] == 0:
        return scores
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    return pool(scores.unsqueeze(0), kernel, stride=1, padding=kernel // 2).squeeze(0)


@dataclass(frozen=True)
class H2O(Pipeline):
    """H2O: the score summed over ALL queries given; at decode, a running sum over steps.

    The queries are processed in chunks of at most ``chunk_elements`` attention entries
    (chunk rows x Hq x visible keys), so prefilling a long prompt never holds a [T, T] matrix per
    head. Keys after the chunk's last query are skipped when k_pos is sorted (they get no
    attention). Query-free scores (key_norm, random) are computed once, not once per query.
    """

    name = "h2o"
    running_mode = "sum"
    sums_every_query = True

    chunk_elements: int = 1 << 23

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.chunk_elements, int) or self.chunk_elements < 1:
            raise ValueError(f"h2o chunk_elements must be >= 1, got {self.chunk_elements}")

    @property
    def window(self) -> None:
        return None

    def prefill_scores(self, scorer, q, k, v, geom, q_pos=None, k_pos=None) -> Tensor:
        if not getattr(scorer, "needs_attention", True):
            return scorer(q, k, v, geom, q_pos, k_pos)
        num_w, num_t = q.shape[0], k.shape[0]
        q_pos, k_pos = resolve_positions(num_w, num_t, q_pos, k_pos, k.device)
        dtype = compute_dtype(q, k, v)
        scores = k.new_zeros((geom.num_kv_heads, num_t), dtype=dtype)  # [Hkv, T]
        # Lay K/V out per head once; each chunk then reads a T-slice of it without copying.
        keys = heads_first(k, dtype)  # [Hkv, T, D]
        values = heads_first(v, dtype)  # [Hkv, T, Dv]
        sorted_keys = k_pos.dim() == 1 and bool((k_pos[1:] >= k_pos[:-1]).all())
        rows = max(1, self.chunk_elements // max(1, geom.num_q_heads * num_t))
        for start in range(0, num_w, rows):
            stop = min(num_w, start + rows)
            visible = num_t
            if sorted_keys:  # keys past the chunk's last query are invisible to all of it
                last = q_pos[start:stop].max()
                visible = int(torch.searchsorted(k_pos, last, right=True))
            if visible == 0:
                continue
            part = scorer(
                q[start:stop],
                keys[:, :visible].transpose(0, 1),
                values[:, :visible].transpose(0, 1),
                geom,
                q_pos[start:stop],
                k_pos[..., :visible],
            )  # [Hkv, visible]
            scores[:, :visible] += part
        return scores


@dataclass(frozen=True)
class TOVA(Pipeline):
    """TOVA: the score of the last query only; at decode, each step's score replaces the last."""

    name = "tova"
    running_mode = "last"

    @property
    def window(self) -> int:
        return 1

    def prefill_scores(self, scorer, q, k, v, geom, q_pos=None, k_pos=None) -> Tensor:
        q, q_pos, k_pos = _last_queries(1, q, k, q_pos, k_pos)
        return scorer(q, k, v, geom, q_pos, k_pos)  # [Hkv, T]


@dataclass(frozen=True)
class Streaming(Pipeline):
    """StreamingLLM: the first ``sinks`` entries and the most recent ones; no score.

    ``prefill_scores`` returns zeros [Hkv, T] (the scorer is not called) so the hand-off stays
    uniform. ``select`` keeps the first S and the last K - S entries: the recent window grows to
    fill the budget, ``recent`` is only a lower bound.
    """

    name = "streaming"
    running_mode = None
    scored = False

    @property
    def window(self) -> int:
        return 0

    def prefill_scores(self, scorer, q, k, v, geom, q_pos=None, k_pos=None) -> Tensor:
        return k.new_zeros((geom.num_kv_heads, k.shape[0]), dtype=compute_dtype(k, v))

    def select(self, scores, keep, recent=0, sinks=0, reduce=None) -> Tensor:
        recency = torch.arange(scores.shape[-1], device=scores.device)  # [T]  newer = higher
        return select_keep(recency.expand(scores.shape), keep=keep, recent=recent, sinks=sinks)

    def select_batch(self, scores: Tensor, keep: int, recent: int = 0, sinks: int = 0) -> Tensor:
        rows, heads, num_t = scores.shape
        kept = self.select(scores.reshape(rows * heads, num_t), keep, recent, sinks)
        return kept.view(rows, heads, keep)


@dataclass(frozen=True)
class AdaKV(SnapKV):
    """AdaKV (Feng et al.) hosted on SnapKV's scores: a layer keeps as many entries as a uniform
    selection, spread over its KV heads by their scores (kvpress's ``AdaKVPress`` rule, see
    :func:`~obcache_vllm.scoring.allocation.adaptive_keep`), in whole head-blocks
    (:func:`~obcache_vllm.scoring.allocation.adaptive_head_blocks`) so that every head's entries
    fill memory of their own and the request's blocks follow the sum of the heads' counts.
    """

    name = "adakv"
    heads_own_memory = True
    host = "snapkv"
    # ``per_head`` is not read: each head ranks its own entries by definition (a server whose
    # default is one ranking per layer still serves adakv as AdaKV).

    def select_heads(self, scores: Tensor, *, tail: int, body_blocks: int, block_size: int,
                     recent: int = 0, sinks: int = 0, lengths: Tensor | None = None
                     ) -> list[Tensor]:  # fmt: skip
        """Sorted kept indices per KV head (``adaptive_head_blocks``)."""
        from obcache_vllm.scoring.allocation import adaptive_head_blocks

        return adaptive_head_blocks(scores, tail=tail, body_blocks=body_blocks,
                                    block_size=block_size, recent=recent, sinks=sinks,
                                    lengths=lengths)  # fmt: skip


_PIPELINES: dict[str, type[Pipeline]] = {
    cls.name: cls for cls in (SnapKV, H2O, TOVA, Streaming, AdaKV)
}
# The built-in pipelines; ``pipeline_names()`` also lists the ones registered since.
PIPELINE_NAMES: tuple[str, ...] = tuple(_PIPELINES)


def register_pipeline(cls: type[Pipeline]) -> type[Pipeline]:
    """Make ``cls`` (a ``Pipeline`` subclass with a new ``name``) a ``kv_pipeline`` value.

    Nothing else is needed: options validation, the eviction core, the HF reference and the
    evaluation ask the class (``window``, ``running_mode``, ``scored``, ``takes_options``,
    ``sums_every_query``), never its name. Usable as a class decorator.
    """
    if not (isinstance(cls, type) and issubclass(cls, Pipeline)):
        raise TypeError(f"{cls!r} is not a Pipeline subclass")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or name in _PIPELINES and _PIPELINES[name] is not cls:
        raise ValueError(f"pipeline name {name!r} is missing or taken")
    _PIPELINES[name] = cls
    return cls


def unregister_pipeline(name: str) -> None:
    """Remove a pipeline registered with :func:`register_pipeline` (tests, plugins)."""
    if name in PIPELINE_NAMES:
        raise ValueError(f"{name!r} is built in")
    _PIPELINES.pop(name, None)


def pipeline_names() -> tuple[str, ...]:
    """Every ``kv_pipeline`` value: the built-ins, then the registered ones."""
    return tuple(_PIPELINES)


def pipeline_class(name: str) -> type[Pipeline]:
    """The class of the pipeline called ``name`` (ValueError naming the known ones)."""
    try:
        return _PIPELINES[name]
    except KeyError:
        known = ", ".join(_PIPELINES)
        raise ValueError(f"unknown pipeline {name!r}; known: {known}") from None


def make_pipeline(name: str, **kwargs) -> Pipeline:
    """The pipeline called ``name`` (one of PIPELINE_NAMES) with its options.

    Options: all take ``per_head`` (default True); snapkv ``window`` (64), ``pooling``
    ("max" | "avg" | "none"), ``kernel`` (7, odd); h2o ``chunk_elements``.
    """
    cls = pipeline_class(name)
    known = sorted(f.name for f in dataclasses.fields(cls))
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise ValueError(f"unknown options {unknown} for pipeline {name!r}; known: {known}")
    return cls(**kwargs)
