"""Worker-side per-request eviction state and the per-step plan handed to the attention layers.

Lifecycle of :class:`RequestKvState` (one per budgeted request, in the worker process): created
when the request first reaches the worker, reset when it is resumed after preemption (its KV is
recomputed from scratch), dropped when it finishes or is aborted. After a contained fault
(:attr:`RequestKvState.disabled`) it is kept, but nothing scores or compacts it any more.

Glossary: ``W`` window queries, ``N`` resident tokens, ``Hq``/``Hkv`` heads, ``D`` head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from obcache_vllm.eviction.heads import HeadLayout
from obcache_vllm.eviction.messages import EvictionOrder
from obcache_vllm.options import KvOptions
from obcache_vllm.scoring import Pipeline, RunningScores, Scorer

# Decode queries buffered per layer before they are scored in one call (bounds the memory of a
# request whose budget is far away; evictions score the buffer anyway).
DECODE_BUFFER = 64


class DecodeQueryStore:
    """The decode queries of every budgeted request whose decode scores are summed, per layer.

    One tensor per layer, ``[slots, capacity, Hq, D]``: each such request owns a slot (taken
    when it is created, given back when it finishes) and its ``count`` buffered queries are
    ``[slot, :count]``. A decode step writes the queries of ALL those requests of the batch in
    one indexed copy per layer (:meth:`write`), instead of one small copy per request and layer;
    a request's buffer is scored when it is full or at an order, then emptied by its count.
    """

    def __init__(self, capacity: int = DECODE_BUFFER) -> None:
        self.capacity = capacity
        self._layers: dict[str, torch.Tensor] = {}  # layer -> [slots, capacity, Hq, D]
        self._free: list[int] = []
        self._num_slots = 0

    def acquire(self) -> int:
        if self._free:
            return self._free.pop()
        self._num_slots += 1
        return self._num_slots - 1

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def write(self, layer: str, slots: torch.Tensor, positions: torch.Tensor, q: torch.Tensor):
        """Store q [n, Hq, D] at ``[slots[i], positions[i]]`` of ``layer`` (one op)."""
        buf = self._layers.get(layer)
        if buf is None or buf.shape[0] < self._num_slots:
            grown = q.new_zeros((max(2 * self._num_slots, 8), self.capacity, *q.shape[1:]))
            if buf is not None:
                grown[: buf.shape[0]] = buf
            buf = self._layers[layer] = grown
        buf[slots, positions] = q

    def read(self, layer: str, slot: int, count: int) -> torch.Tensor:
        """The first ``count`` stored queries of ``slot`` [count, Hq, D] (a view)."""
        return self._layers[layer][slot, :count]

    def read_many(self, layer: str, slots: torch.Tensor, count: int) -> torch.Tensor:
        """The first ``count`` stored queries of each slot [R, count, Hq, D] (one op)."""
        return self._layers[layer].index_select(0, slots)[:, :count]


@dataclass
class RequestKvState:
    """What the worker remembers about one budgeted request between steps."""

    options: KvOptions
    scorer: Scorer
    pipeline: Pipeline
    # Dead head blocks committed after the last step that ran (worker's view of the scheduler's).
    dead: int = 0
    # Last prompt queries per layer [<= W, Hq, D], kept across prefill chunks (window pipelines).
    queries: dict[str, torch.Tensor] = field(default_factory=dict)
    # Running scores per layer (pipelines that score every prompt query; kv_decode at decode).
    running: dict[str, RunningScores] = field(default_factory=dict)
    # Summed decode scores: the request's slot in the runner's DecodeQueryStore (None: not
    # buffered) and how many decode queries it holds there, not yet folded into the scores.
    decode_slot: int | None = None
    decode_count: int = 0
    evictions: int = 0
    tokens_evicted: int = 0
    # Prompt tokens left by the prefill eviction (None: not evicted at prefill yet).
    kept_prompt: int | None = None
    # An error target's choice at the prompt's end: (tokens kept, estimated error).
    chosen: tuple[int, float] | None = None
    # Why eviction stopped for this request ("stage: reason"), after a contained fault.
    disabled: str | None = None
    # A pipeline whose heads own their memory, once its order is applied: where each KV
    # head's entries live (None: one block table for every head, as stock).
    head_layout: HeadLayout | None = None
    # kv_when "pressure" and not compressed yet: it runs as stock (no scoring, no buffers).
    pressure_pending: bool = False
    # Debug/verification only (OBCACHE_VLLM_RECORD_KEEP=1), see ``record_keep``: per layer
    # name the kept indices [Hkv, K] of the last eviction (relative to the resident tokens
    # before it), "<layer>:positions" the true prompt/output positions of those kept tokens,
    # "<layer>:window" the scored window, ":orders" [(logical_len, prefill)] per eviction.
    record: dict | None = None

    @classmethod
    def create(cls, options: KvOptions) -> RequestKvState:
        scorer, pipeline = options.build_scoring()
        return cls(options=options, scorer=scorer, pipeline=pipeline,
                   pressure_pending=options.when == "pressure")  # fmt: skip

    def reset(self) -> None:
        """Forget everything: the request's KV is being recomputed from position 0."""
        if self.record is not None:  # the positions described the cache now recomputed
            for key in [k for k in self.record if k.endswith(":positions")]:
                del self.record[key]
        self.dead = 0
        self.head_layout = None
        self.kept_prompt = None
        self.chosen = None
        self.queries.clear()
        self.running.clear()
        self.decode_count = 0

    def drop_scoring_state(self) -> None:
        """Free the buffers of a request that will not be scored again (after a fault)."""
        self.queries.clear()
        self.running.clear()
        self.decode_count = 0

    @property
    def decode_mode(self) -> str:
        """How running scores accumulate: "last" (the newest query's) or "sum" (every
        query's; window pipelines sum their decode scores as H2O does).

        A query-free score (``key_norm``, ``random``) is the same whichever queries are given,
        so it is replaced, never summed: summed once per prefill chunk or per scoring of the
        decode buffer, its ranking would depend on how the prompt was chunked.
        """
        if not getattr(self.scorer, "needs_attention", True):
            return "last"
        return self.pipeline.running_mode or "sum"

    @property
    def buffers_decode_queries(self) -> bool:
        """Whether every decode query must be kept until it is scored (summed scores)."""
        if self.pressure_pending:
            return False
        return self.options.decode and self.pipeline.scored and self.decode_mode == "sum"

    def record_keep(self, layer: str, keep: torch.Tensor, block_size: int) -> None:
        """Record one layer's eviction (verification mode only; ``record`` is None otherwise).

        Resident j's true position: the recorded position of kept entry j of the previous
        eviction for j below its count, else ``dead * block_size + j`` (written since, at its
        logical slot). A request that started from an adopted cache (dead blocks but no
        previous record) gets no positions: they were decided in another request.
        """
        self.record[layer] = keep.clone()
        key = layer + ":positions"
        prev = self.record.get(key)
        if prev is None and self.dead:
            return
        heads = keep.shape[0]
        start = 0 if prev is None else prev.shape[1]
        width = max(int(keep.max()) + 1, start) if keep.numel() else start
        fresh = self.dead * block_size + torch.arange(start, width, device=keep.device)
        resident = fresh.expand(heads, -1)
        if prev is not None:
            resident = torch.cat([prev.to(keep.device), resident], dim=1)  # [Hkv, >= N]
        self.record[key] = resident.gather(1, keep).cpu()

    def remember_queries(self, layer: str, q: torch.Tensor, window: int) -> None:
        """Keep the last ``window`` queries of the prompt seen so far (q [n, Hq, D])."""
        prev = self.queries.get(layer)
        q = q.detach()
        if prev is not None and q.shape[0] < window:
            q = torch.cat([prev, q], dim=0)
        self.queries[layer] = q[-window:].clone()


@dataclass
class RowOutcome:
    """What happened to one budgeted row during the step (filled by the attention layers).

    ``compacted_layers`` counts the layers that wrote the order's kept tokens; an order is
    applied only when it equals the number of attention layers (none: the cache is as before;
    some but not all: the request's cache is torn). ``failure`` is the first contained fault
    ``(stage, reason, detail)``.
    """

    compacted_layers: int = 0
    failure: tuple[str, str, str] | None = None
    # True while one layer writes the order's kept tokens (a fault then tears that layer).
    writing: bool = False
    # A fault struck while a layer was being written: that layer may be half-written.
    touched: bool = False
    # An error target's order (``EvictionOrder.max_error``): each layer's scores, kept here
    # until every layer has scored (layer name -> eviction.layer.DeferredLayer), then the
    # choice made from all of them: (dead_after, tokens kept, estimated error).
    deferred: dict = field(default_factory=dict)
    chosen: tuple[int, int, float] | None = None
    # A pipeline whose heads own their memory: per layer index, (head-blocks per KV head,
    # body blocks) as written (see :mod:`obcache_vllm.eviction.heads`).
    head_blocks: dict[int, tuple[list[int], int]] = field(default_factory=dict)

    def fail(self, stage: str, exc: Exception, where: str) -> None:
        """Record the row's first contained fault (``reason``: the exception's type, or its
        ``fault_reason``: ``injected`` for a test's injected fault)."""
        reason = getattr(exc, "fault_reason", None) or type(exc).__name__
        if self.failure is None:
            self.failure = (stage, reason, f"{where}: {exc}")
        self.touched = self.touched or self.writing
        self.writing = False

    def torn(self, num_layers: int) -> bool:
        """Whether the request's cache is neither as before (no layer written) nor compacted
        in every layer: it cannot be attended to any more."""
        written = self.compacted_layers + (1 if self.touched else 0)
        return 0 < written and self.compacted_layers < num_layers


@dataclass(frozen=True)
class RowPlan:
    """One budgeted request in this step: where its queries are and what to do after attention.

    ``logical_len`` is the request's token count in the cache at the end of the step;
    ``prefill`` is True while prompt tokens are being computed (also the prompt's last chunk).
    """

    row: int
    req_id: str
    block_size: int
    state: RequestKvState
    q_start: int
    q_end: int
    logical_len: int
    prompt_len: int
    prefill: bool
    order: EvictionOrder | None
    # Decode rows whose scores are summed: where this step's query is stored in the runner's
    # DecodeQueryStore (None: not stored), and whether the stored queries are scored now.
    decode_position: int | None = None
    # A decode-time row of several queries (a preempted request recomputing its output,
    # summed scores): how many queries were stored before it; all of them and every query of
    # the row are scored in this step (None: not such a row).
    decode_stored: int | None = None
    score_decode: bool = False
    # False: nothing to do for this row in any layer this step (its query, if stored, is
    # written by the batched store write).
    active: bool = True
    # True: handled with the other rows of its RowGroup (batched), not one by one.
    grouped: bool = False
    outcome: RowOutcome = field(default_factory=RowOutcome)

    @property
    def num_resident(self) -> int:
        """Tokens of the request in the cache at the end of the step (before any compaction)."""
        return self.logical_len - self.state.dead * self.block_size


@dataclass(frozen=True)
class RowGroup:
    """Decode-time orders of several requests that are processed together, batched: the same
    options, resident count, query count ``num_queries``, kept count and block shift."""

    rows: tuple[RowPlan, ...]
    num_queries: int
    shift: int  # dead_after - dead_before, the same for all


@dataclass
class StepPlan:
    """Everything the attention path of one step needs; built by the model runner.

    ``dead`` [num_reqs] is each row's dead-block count *before* the step (the read shift).
    ``read_block_table`` is set by the metadata builder: the block table the attention of this
    step reads (each row already shifted past its dead blocks), in the backend's device memory.
    """

    dead: tuple[int, ...]
    rows: tuple[RowPlan, ...]
    block_size: int
    # Filled by the attention layers: seconds spent scoring and compacting in this step.
    timings: list[float] = field(default_factory=list)
    read_block_table: torch.Tensor | None = None
    # Attention layer name -> index in the model (recording, fault injection by layer).
    layer_index: dict[str, int] = field(default_factory=dict)
    # This step's decode queries to store, for every layer: (slots, positions, token index).
    decode_store: DecodeQueryStore | None = None
    decode_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    groups: tuple[RowGroup, ...] = ()
    # Tensor parallelism (> 1 rank): sums a [1, N] layer ranking over the TP group, for rows
    # with one ranking per layer (kv_per_head=false). None on a single rank.
    head_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Set by an adapter that shifts the persistent read buffers in place (FlashAttention), so
    # a second metadata build of the same step does not shift them twice.
    reads_shifted: bool = False
    # Rows (batch index) whose heads own their memory: their layouts (the reads go per head).
    head_layouts: dict[int, HeadLayout] = field(default_factory=dict)

    @property
    def shifts_reads(self) -> bool:
        return any(self.dead)

    def ranking_reduction(self, row: RowPlan) -> RankingReduction | None:
        """The cross-rank reduction ``row`` must join in each layer, or None.

        Decided from what every rank holds identically (the order, the options), never from
        a rank-local fault, so all ranks enter the same collectives in the same order.
        """
        pipeline = row.state.pipeline
        if self.head_reduce is None or row.order is None:
            return None
        if pipeline.per_head or not pipeline.scored:
            return None
        return RankingReduction(self.head_reduce)


class RankingReduction:
    """One (row, layer)'s all-reduce of the layer ranking: entered exactly once per rank.

    ``pipeline.select(..., reduce=reduction)`` enters it with this rank's summed scores; a rank
    that gave the row up in this layer (a contained fault) enters it with zeros through
    :meth:`join`, so the other ranks are not left waiting in the collective.
    """

    def __init__(self, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.all_reduce = all_reduce
        self.entered = False

    def __call__(self, summed: torch.Tensor) -> torch.Tensor:
        """[1, N] scores summed over this rank's heads -> summed over every rank's."""
        self.entered = True
        return self.all_reduce(summed)

    def join(self, num_resident: int, device: torch.device) -> None:
        """Enter the collective with zeros unless this rank already did."""
        if not self.entered:
            self(torch.zeros((1, num_resident), dtype=torch.float32, device=device))


def agree_across_ranks(rows: tuple[RowPlan, ...], num_layers: int, group) -> None:
    """Make every tensor-parallel rank's row outcomes identical (one host all-reduce).

    Each rank compacts only its own KV heads, and only rank 0's report reaches the scheduler:
    without agreement a fault on another rank would let the scheduler free blocks that rank
    never compacted. Agreed per row: failed anywhere -> failed everywhere (reason
    ``tp_peer`` where the fault was not local); the fewest layers compacted on any rank, and a
    row some rank wrote more of than another is torn everywhere. ``group``: a
    ``torch.distributed`` process group on host tensors (vLLM's ``get_tp_group().cpu_group``).
    """
    if not rows:
        return
    local = [
        (int(r.outcome.failure is not None), num_layers - r.outcome.compacted_layers,
         r.outcome.compacted_layers)
        for r in rows
    ]  # fmt: skip
    agreed = torch.tensor(local, dtype=torch.int64)  # [rows, 3] failed, L - compacted, compacted
    torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=group)
    for row, (failed, deficit, most) in zip(rows, agreed.tolist(), strict=True):
        least = num_layers - deficit
        outcome = row.outcome
        if least != most:  # some rank wrote layers another did not: torn on every rank
            outcome.compacted_layers = min(max(least, 1), num_layers - 1)
        else:
            outcome.compacted_layers = least
        if (failed or least != most) and outcome.failure is None:
            stage = "compact" if most else "score"
            outcome.failure = (stage, "tp_peer", "failed on another tensor-parallel rank")
