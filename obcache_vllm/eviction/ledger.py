"""The block ledger: every budgeted request's block accounting on the scheduler side.

One :class:`RequestBlocks` per budgeted request, owned by the :class:`BlockLedger` (created
on add, reset on preemption, released on finish). The vLLM scheduler adapter
(:mod:`obcache_vllm.vllm_ext.engine.scheduler`) only translates: it asks the ledger what to do
and applies the answer to vLLM's block manager. Plain Python, no vLLM, no torch.

A request's blocks, by logical block index (``bs`` tokens each; see
:mod:`obcache_vllm.eviction.planning` for right-aligned compaction)::

    index      0 ....... dead-1 | dead ............ write_floor-1 | write_floor ........ n-1
    content    null (freed)     | live, stock KV until compacted | live: compaction writes
    prefix     may be shared with other requests (cache hits)     | must be this request's
    cache      may be registered (stock KV, addressable by tokens)| never registered

``write_floor = max(1, (C - budget) // bs)`` for the compress point ``C``: every order of the
request has ``dead_after >= write_floor`` (orders run at ``L >= C`` tokens, keep
``L - dead_after*bs >= budget`` and free at least one block), so compaction writes only
blocks at or above it; a request that never compacts (no ``kv_decode``, no pressure, and no
whole block over its budget at ``C``) writes none. Blocks
below it are never rewritten: they may come from the prefix cache, and the ones the request
computes itself hold exactly stock KV, so they may be registered. ``kv_prefill_evict`` orders
run before ``C`` and write lower: such requests neither read nor feed the cache.

Verbs, in the style of nano-vllm's ``BlockManager``:

==================  =================================================================
verb                what it decides
==================  =================================================================
``open`` / ``release`` / ``reset``  a request's record: on add, finish, preemption
``exact_hit``       how much of a prefix-cache hit the request may take (its pipeline's
                    queries at the compress point must all be computed)
``copy_on_write``   which hit blocks it must copy before it may write them
``registrable``     how many computed tokens may enter the prefix cache
``cut_at``          where this step's prefill chunk must end (the compress point)
``can_compact`` /   this step's order, and recording it
``compact``
``commit``          the worker compacted: the head blocks to free now
==================  =================================================================
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field

from obcache_vllm.eviction.messages import EvictionOrder, RowState
from obcache_vllm.eviction.planning import peak_blocks, plan_eviction
from obcache_vllm.options import KvOptions

# Finished records kept for readers (tests, the stats path drains its own copy).
FINISHED_KEPT = 4096
# The write floor of a request no order ever writes (a block index beyond any request's).
NEVER_WRITTEN = 1 << 40


@dataclass(frozen=True)
class CacheStart:
    """What a request's cache started from at admission (besides computing it itself).

    ``kind``: ``"hit"`` (an ordinary prefix-cache hit of ``tokens`` stock tokens), or the
    kind of a compressed entry it adopted (``"compress_at"``, ``"session"``: ``tokens``
    logical tokens, ``dead`` head blocks null, ``kept_prompt`` of its tokens kept by its
    eviction, ``depth`` session turns behind it, ``entry_id`` and ``donor``: the entry and
    the request whose KV it holds, ``chosen``: an error target's choice the entry was
    compressed to, its count and estimated error; ``error``: a session entry of an error
    target's, its cache's estimated error against the uncompressed conversation).
    """

    kind: str
    tokens: int
    dead: int = 0
    depth: int = 0
    kept_prompt: int | None = None
    entry_id: int | None = None
    donor: str | None = None
    chosen: tuple[int, float] | None = None
    error: float | None = None
    # A session entry of a pipeline whose heads own their memory: its per-head layout
    # (``HeadLayout.to_wire``), which the adopting turn's worker starts from.
    head_layout: tuple | None = None

    @property
    def compressed(self) -> bool:
        return self.kind != "hit"


@dataclass
class RequestBlocks:
    """One budgeted request's blocks and eviction history (see the module docstring)."""

    options: KvOptions
    prompt_len: int
    block_size: int
    dead: int = 0
    # The eviction at the compress point has been ordered (or was inherited from an entry).
    past_point: bool = False
    start: CacheStart | None = None
    evictions: int = 0
    tokens_evicted: int = 0
    blocks_freed: int = 0
    # Prompt tokens left after the prefill eviction (None: not evicted at prefill).
    kept_prompt: int | None = None
    # An error target's choice, as the worker reported it: (tokens kept, estimated error).
    chosen: tuple[int, float] | None = None
    # A pipeline whose heads own their memory: its per-head layout as last reported.
    head_layout: tuple | None = None
    # Tokens resident when its compress point was reached (before that order): what an error
    # target that chose nothing there keeps while it decodes.
    point_resident: int | None = None
    # Why eviction stopped for this request ("stage: reason"); it then runs uncompressed.
    disabled: str | None = None
    # False when vLLM itself skips the prefix cache for it (e.g. prompt logprobs requested).
    may_read: bool = True
    # kv_when "pressure": why and where it was compressed ("running": the pool was short while
    # it ran; "admission": its prompt fit only compressed, evicted while prefilled), or None.
    pressure: str | None = None
    pressure_at: int | None = None
    # What the last prefix lookup found, until the request is admitted: (entry kind, tokens
    # adopted or None for a miss); counted once per admission, not per lookup.
    lookup: tuple[str, int | None] | None = None
    # Its lookup was counted as a read of the entries (once, not again after a preemption).
    read_counted: bool = False

    @property
    def on_pressure(self) -> bool:
        """Compressed only under pressure (``kv_when: pressure``), and not yet."""
        return self.options.when == "pressure" and self.pressure is None

    @property
    def prefill_evicts(self) -> bool:
        """Evicts after every prefill chunk (``kv_prefill_evict``, or admitted under pressure
        because only its bounded peak fits)."""
        return self.options.prefill_evict or self.pressure == "admission"

    @property
    def point(self) -> int:
        """The compress point C: prompt tokens cached when the prefill eviction runs."""
        return self.options.compress_point(self.prompt_len)

    @property
    def may_compact(self) -> bool:
        """Whether any order can ever write this request's blocks: at its compress point when
        a whole block can go there, later with ``kv_decode`` or under pressure, after every
        prefill chunk, or for an error target (its floor may be low)."""
        o = self.options
        return (
            o.decode
            or o.when == "pressure"
            or self.prefill_evicts
            or o.max_error is not None
            or self.point - o.budget >= self.block_size
        )

    @property
    def write_floor(self) -> int:
        """The lowest block index any compaction of this request may write.

        An error target may keep its whole prompt, so it may write from its first block (it
        reads the prefix cache by copying and feeds it only through preserved copies), as
        a ``kv_prefill_evict`` request does. Any other order frees at least one block
        (:func:`~obcache_vllm.eviction.planning.plan_eviction`), so it never writes block 0,
        and none runs before the compress point: the floor is
        ``max(1, (C - budget) // bs)``; a request that never compacts writes nothing
        (:data:`NEVER_WRITTEN`: everything it computes is stock KV).
        """
        if self.prefill_evicts or self.options.max_error is not None:
            return 0
        if not self.may_compact:
            return NEVER_WRITTEN
        return max(1, (self.point - self.options.budget) // self.block_size)

    @property
    def reads_cache(self) -> bool:
        """Whether an exact prefix-cache hit exists for its pipeline at all."""
        return self.may_read and self.options.query_window >= 0 and not self.prefill_evicts

    @property
    def entry_kind(self) -> str | None:
        """The compressed entries it may adopt and leave behind (see ``eviction.entries``);
        a pipeline whose heads own their memory leaves and adopts session entries only (the
        entry carries its per-head layout to the next turn, see ``CacheStart.head_layout``)."""
        if not self.reads_cache:
            return None
        if self.options.session:
            return "session"
        if self.options.heads_own_memory:
            return None
        if self.options.compress_at is not None:
            return "compress_at"
        return None

    def may_continue(self, finished_normally: bool) -> bool:
        """Whether its final cache may be left for a session's next turn: finished (stopped
        or at its length limit, not aborted or in error), past its compress point, no fault."""
        return (
            self.entry_kind == "session"
            and finished_normally
            and self.past_point
            and self.disabled is None
        )

    def entry_options(self, kind: str) -> tuple:
        """The options an entry of ``kind`` must share with it: those that shape its cache."""
        o = self.options
        shape = (o.scorer, o.pipeline, o.window, o.recent, o.sinks, o.per_head)
        if kind == "compress_at":  # an error target's floor is not a fixed budget's count
            return (o.budget, o.max_error, o.compress_at, *shape)
        return (o.requested_budget, o.decode, *shape)

    def exact_hit(self, hit_tokens: int) -> int:
        """The longest block-aligned prefix of a ``hit_tokens`` hit this request may take.

        Exact means: the kept set after eviction equals a recompute's. The last
        ``query_window`` prompt queries before C (one for tova and streaming, whose order must
        run in a step that computes up to C) must be computed by the request itself.
        """
        if not self.reads_cache or self.past_point:
            return 0
        if self.on_pressure:  # as stock vLLM: it compresses only if the pool runs short
            return hit_tokens
        limit = self.point - max(1, self.options.query_window)
        return max(0, min(hit_tokens, limit)) // self.block_size * self.block_size

    def copy_on_write(self, num_hit_blocks: int) -> range:
        """Indices of the full hit blocks the request must copy before it can write them (a
        request past its compress point without ``kv_decode`` never compacts again)."""
        if self.past_point and not self.options.decode or self.on_pressure:
            # kv_when "pressure" admitted as stock: it copies nothing as stock copies nothing;
            # a compression under pressure writes only blocks no other request holds (the
            # planner checks), after dropping their hashes (PrefixAdapter.release_for_pressure)
            return range(0)
        return range(min(self.write_floor, num_hit_blocks), num_hit_blocks)

    @property
    def stock_kv(self) -> bool:
        """Whether its blocks hold stock KV until compacted (not after a compressed start, not
        with ``kv_prefill_evict``, whose later chunks attend to an evicted cache)."""
        compressed = self.start is not None and self.start.compressed
        return not compressed and not self.prefill_evicts

    def registrable(self, num_tokens: int) -> int:
        """How many of its first ``num_tokens`` computed tokens may enter the prefix cache.

        Before its compress point, at most the point: vLLM registers a step's blocks while
        allocating them, before the scheduler cuts the chunk at the point (:meth:`cut_at`),
        and a block registered but not computed would be a hit on KV no one wrote. A
        ``kv_when: pressure`` request not compressed yet holds stock KV: all of it, as stock
        vLLM registers it."""
        if not self.stock_kv:
            return 0
        if self.on_pressure:
            return num_tokens
        limit = self.write_floor * self.block_size
        if not self.past_point:
            limit = min(limit, self.point)
        return min(num_tokens, limit)

    def preservable(self, order: EvictionOrder) -> range:
        """Block indices whose stock KV the compress-point ``order`` overwrites and that the
        prefix cache does not hold yet: full blocks from the write floor up to C, minus the
        ones copied from a hit (their originals stay cached)."""
        if not self.stock_kv or order.logical_len != self.point:
            return range(0)
        hit = self.start.tokens // self.block_size if self.start is not None else 0
        return range(max(self.write_floor, hit, order.dead_after), self.point // self.block_size)

    def cut_at(self) -> int | None:
        """The token this step's prefill chunk must not run past (the compress point)."""
        return None if self.past_point or self.on_pressure else self.point

    def can_compact(self, logical_len: int, is_prefill_chunk: bool) -> EvictionOrder | None:
        """The order of a step that leaves ``logical_len`` tokens in the cache, or None.

        At the compress point (the step whose chunk reaches C; with ``kv_prefill_evict``,
        also every chunk before it) and, with ``kv_decode``, at decode steps: when a whole
        block can go. Records that the compress point was reached.
        """
        if self.disabled is not None or self.on_pressure:
            return None
        final = True  # the eviction at the compress point, or a decode-time one
        decoding = self.past_point
        if not self.past_point:
            if logical_len < self.point:
                if not self.prefill_evicts:
                    return None
                final = False  # kv_prefill_evict: after this chunk too
        elif not self.options.decode or is_prefill_chunk:
            return None
        order = plan_eviction(
            logical_len=logical_len,
            budget=self.decode_budget if decoding else self.options.budget,
            dead_blocks=self.dead,
            block_size=self.block_size,
        )
        if final and not decoding:
            self.point_resident = logical_len - self.dead * self.block_size
        self.past_point = self.past_point or final
        if order is not None and self.options.max_error is not None and not decoding:
            order = dataclasses.replace(order, max_error=self.error_allowance)
        return order

    @property
    def decode_budget(self) -> int:
        """The tokens a decode-time order keeps (``kv_decode``): the budget; for an error
        target, the count it chose at its compress point (its memory from then on, as a fixed
        budget of that count), or, where no whole block could go there and nothing was
        chosen, the tokens resident at the point (past an adopted entry's dead blocks)."""
        if self.options.max_error is None:
            return self.options.budget
        if self.chosen is not None:
            return self.chosen[0]
        if self.point_resident is not None:
            return max(self.point_resident, self.options.budget)
        return max(self.point, self.options.budget)

    @property
    def error_before(self) -> float:
        """An error target's session turn: the estimated error its adopted cache already has
        against the uncompressed conversation (0: the history was computed afresh)."""
        start = self.start
        if start is None or start.kind != "session" or start.error is None:
            return 0.0
        return start.error

    @property
    def error_allowance(self) -> float:
        """The error this request's eviction may add, so that the conversation's estimate
        stays within ``max_error``: the target itself for a cache computed afresh, else what
        the triangle inequality leaves, ``(sqrt(max_error) - sqrt(error_before))**2`` (the
        errors are relative squared norms of the window outputs; 0: keep everything)."""
        target, before = self.options.max_error, self.error_before
        if before == 0.0:
            return target
        return max(0.0, math.sqrt(target) - math.sqrt(before)) ** 2

    @property
    def conversation_error(self) -> float:
        """The estimated error of its cache against the uncompressed conversation: its own
        eviction's, added to the adopted cache's by the triangle inequality (an estimate:
        each turn measures its eviction on its own window of queries)."""
        before = self.error_before
        mine = self.chosen[1] if self.chosen is not None else 0.0
        if before == 0.0 or mine == 0.0:
            return before + mine
        return (math.sqrt(before) + math.sqrt(mine)) ** 2

    def pressure_order(self, logical_len: int) -> EvictionOrder | None:
        """The order a compression to its budget would give in a step ending at
        ``logical_len``, changing nothing (None before its prompt is complete: its queries at
        the compress point are not all computed yet)."""
        if self.options.when != "pressure" or self.disabled is not None:
            return None
        if self.prefill_evicts or logical_len < self.point:
            return None
        return plan_eviction(logical_len=logical_len, budget=self.options.budget,
                             dead_blocks=self.dead, block_size=self.block_size)  # fmt: skip

    def pressure_gain(self, logical_len: int) -> int:
        """Blocks a compression under pressure would free in a step ending at
        ``logical_len`` (see :meth:`pressure_order`)."""
        order = self.pressure_order(logical_len)
        return 0 if order is None else order.blocks_freed

    def compress_under_pressure(self, logical_len: int, reason: str) -> EvictionOrder | None:
        """The pool is short: compress to the budget now (again, if it grew back), then behave
        as ``kv_when: always`` would."""
        order = plan_eviction(logical_len=logical_len, budget=self.options.budget,
                              dead_blocks=self.dead, block_size=self.block_size)  # fmt: skip
        self.pressure, self.pressure_at = reason, logical_len
        self.past_point = self.past_point or logical_len >= self.point
        return None if order is None else dataclasses.replace(order, pressure=True)

    def admit_under_pressure(self) -> None:
        """Its whole prompt does not fit but its bounded peak may: evict while prefilling
        (tried; :meth:`withdraw_pressure_admission` if it is not admitted so)."""
        self.pressure, self.pressure_at = "admission", 0

    def withdraw_pressure_admission(self) -> None:
        """The admission under pressure did not happen: as stock again until the pool is
        short (a later step tries the stock allocation first, as for any request)."""
        if self.pressure == "admission":
            self.pressure = self.pressure_at = None

    def compressed_at_point(self, order: EvictionOrder | None) -> bool:
        """Whether ``order`` is the request's eviction at its compress point (the one that
        leaves the compressed first-C cache a ``kv_compress_at`` entry records)."""
        return order is not None and order.logical_len == self.point and (
            self.start is None or not self.start.compressed
        )

    def commit(self, row: RowState) -> tuple[int, int] | None:
        """Adopt the worker's cumulative state; the head blocks ``[first, last)`` to free now.

        The worker reports every budgeted row's state each step, so a lost report is made good
        by the next one: what it compacted away and was not freed yet is freed then.
        """
        freed = None
        if row.dead > self.dead:
            freed = (self.dead, row.dead)
            self.blocks_freed += row.dead - self.dead
        self.dead = row.dead
        self.evictions = row.evictions
        self.tokens_evicted = row.tokens_evicted
        if row.kept_prompt is not None:
            self.kept_prompt = row.kept_prompt
        if row.chosen is not None:
            self.chosen = row.chosen
        if row.head_layout is not None:
            self.head_layout = row.head_layout
        return freed

    def reset(self) -> None:
        """Preempted: vLLM freed its blocks; its KV is recomputed (or re-adopted) later."""
        self.dead = 0
        self.past_point = False
        self.kept_prompt = None
        self.chosen = None
        self.head_layout = None
        self.point_resident = None
        self.start = None
        if self.pressure == "running":  # recomputed: as stock again until the pool is short
            self.pressure = self.pressure_at = None

    def unadopt(self) -> None:
        """Forget an adoption whose allocation failed (vLLM looks the request up again)."""
        if self.start is not None:
            self.dead = 0
            self.past_point = False
            self.kept_prompt = None
            self.chosen = None
            self.head_layout = None
            self.point_resident = None
            self.start = None

    def adopt(self, start: CacheStart) -> None:
        """The request's cache starts from ``start`` (set at admission)."""
        self.start = start
        if start.compressed:
            self.dead = start.dead
            self.past_point = start.tokens >= self.point
            if start.kept_prompt is not None:  # until an eviction of its own prompt
                self.kept_prompt = start.kept_prompt + self.prompt_len - start.tokens
            if start.chosen is not None:  # the target's choice the adopted cache was made to
                self.chosen = start.chosen
            self.head_layout = start.head_layout

    def peak_blocks(self, max_tokens: int, chunk: int) -> int:
        """Worst-case blocks of the request over its life (see ``planning.peak_blocks``)."""
        return peak_blocks(
            prompt_len=self.prompt_len,
            max_tokens=max_tokens,
            block_size=self.block_size,
            chunk=chunk,
            # An error target may keep everything: its worst case is a stock request's.
            budget=None if self.options.max_error is not None else self.options.budget,
            decode=self.options.decode,
            prefill_evict=self.prefill_evicts or self.options.when == "pressure",
            point=self.point,
        )

    def resident(self, num_computed_tokens: int) -> int:
        """Tokens it holds in the cache (per layer and KV head)."""
        return num_computed_tokens - self.dead * self.block_size

    def outcome(self, resident: int) -> dict:
        """The request's KV outcome as reported to the client (``usage.obcache``); every key
        is one of :data:`USAGE_FIELDS`."""
        outcome = {
            "resident_tokens": resident,
            "evicted_tokens": self.tokens_evicted,
            "freed_blocks": self.blocks_freed,
            "evictions": self.evictions,
            "prompt_tokens_kept": self.prompt_len if self.kept_prompt is None else self.kept_prompt,
            "budget": self.options.budget,
            "scorer": self.options.scorer,
            "pipeline": self.options.pipeline,
        }
        if self.options.compress_at is not None:
            outcome["compress_at"] = self.options.compress_at
        if self.options.max_error is not None:
            # A target's budget is what it chose; its floor is named as such.
            outcome["budget_floor"] = outcome.pop("budget")
            kl = self.options.kl_target  # in nats: the model's calibration predicted it
            outcome["max_kl" if kl else "max_error"] = self.options.max_error
            if self.chosen is not None:
                estimated = "estimated_kl" if kl else "estimated_error"
                outcome["chosen_budget"], outcome[estimated] = self.chosen
                outcome["budget"] = outcome["chosen_budget"]
            if self.options.session:
                outcome["conversation_error"] = self.conversation_error
        start = self.start
        if start is not None and not start.compressed:
            outcome["cached_tokens"] = start.tokens
        elif start is not None:
            outcome["reused_tokens"] = start.tokens
            outcome["reused_from"] = start.kind
            if start.kind == "session":
                outcome["session_turn"] = start.depth + 1
        if self.pressure is not None:
            outcome["pressure"] = {"reason": self.pressure, "at_tokens": self.pressure_at}
        if self.disabled is not None:
            outcome["fault"] = self.disabled
        return outcome



# ``usage.obcache``: every key a response may carry, and what it means (the REST reference,
# docs/reference/rest.md, is generated from this table; the server tests check every key they
# see is here). The block size in the descriptions is the request's engine's (32 by default).
USAGE_FIELDS: dict[str, str] = {
    "resident_tokens": "KV tokens (per layer and KV head) in the cache when the request "
    "finished: the kept prompt plus the generated tokens but the last (whose KV is never "
    "computed)",
    "evicted_tokens": "tokens evicted, prefill and decode (`kv_decode`) together",
    "freed_blocks": "KV blocks returned to vLLM's pool (`evicted_tokens` / block size)",
    "evictions": "evictions applied (1 at the end of the prefill, plus one per freed block "
    "with `kv_decode`, one per prefill chunk with `kv_prefill_evict`)",
    "prompt_tokens_kept": "prompt tokens left by the prefill eviction (`budget <= kept < "
    "budget + block size`), per KV head (with `kv_pipeline: adakv`, the mean over the heads); "
    "the prompt's length when nothing was evicted",
    "budget": "the budget applied, in tokens per layer and KV head (a fractional `kv_budget` "
    "resolved against the prompt, or against `kv_compress_at`; for an error target, the "
    "budget it chose, absent when it chose none)",
    "budget_floor": "an error target's floor in tokens: its `min` (default `kv_sinks + "
    "kv_recent + 1`); it never keeps fewer",
    "max_error": "an error target's `max_error`",
    "chosen_budget": "an error target's choice: the tokens it kept per layer and KV head at the "
    "prompt's end (absent: no block could go, nothing was chosen)",
    "estimated_error": "an error target's estimate of its choice (mean over layers and KV "
    "heads; see Budgets by error target), at most `max_error`",
    "max_kl": "a KL target's `max_kl` (nats)",
    "estimated_kl": "a KL target's prediction for its choice: the KL (nats) of the next-token "
    "distributions from the full cache's that the model's calibration predicts from every "
    "layer's error, with the margin that held 90 % of its fitting prompts; at most `max_kl`",
    "conversation_error": "an error target with `kv_session`: the estimated error of the "
    "cache this turn leaves against the uncompressed conversation (the continued cache's and "
    "this turn's, added as norms), at most `max_error`: a turn chooses within what the earlier "
    "turns left of the target",
    "scorer": "the scorer used",
    "pipeline": "the pipeline used",
    "compress_at": "where the prompt was compressed, when not at its end: the request's "
    '`kv_compress_at`, or the point `"auto"` chose (a shared prefix, where a repeated prompt was '
    "compressed before, or all but the last token of a prompt it has not seen; absent: the "
    "whole prompt)",
    "cached_tokens": "prompt tokens read from vLLM's prefix cache (stock KV, exact)",
    "reused_tokens": "prompt tokens taken from a cached compressed context",
    "reused_from": 'which kind of compressed context: "compress_at" or "session"',
    "session_turn": "with `kv_session`: this turn's number in the session (2 for the first "
    "continuation)",
    "pressure": 'with `kv_when: "pressure"`: `{"reason": "running" | "admission", '
    '"at_tokens": L}`, why and at which length it was compressed',
    "fault": "only when an eviction fault was contained to this request: why it continued "
    "uncompressed (`stage: reason`)",
    "requests": "a completion with several prompts: how many (the counts above are summed)",
}

# How ``prompt_tokens_kept`` relates to ``budget`` (rendered with USAGE_FIELDS in the REST
# reference; tests/engine/test_outcome.py checks each case on the real engine).
KEPT_RULE = (
    "Only whole blocks are freed, so with a fixed budget `budget <= prompt_tokens_kept < budget "
    "+ block size` (32 tokens on `obcache-vllm serve`; the offline `LLM` defaults to vLLM's CPU "
    "block of 128). Exceptions:",
    "a prompt no longer than `budget` keeps all of it (`prompt_tokens_kept` = `prompt_tokens`, "
    "`evicted_tokens` 0);",
    "an error target: `budget` is the count it chose and `prompt_tokens_kept` equals it (whole "
    "blocks, from `budget_floor` up); no `budget` when no count met the target;",
    "`kv_compress_at`: the budget applies to the first `compress_at` tokens; the prompt's tokens "
    "after them are kept whole, so `budget <= prompt_tokens_kept - (prompt_tokens - compress_at)"
    " < budget + block size`;",
    "`kv_pipeline: adakv`: each KV head keeps its own count; `prompt_tokens_kept` is their "
    "mean, not any one head's count;",
    "a continued session or an adopted entry (`reused_tokens`): the kept count of the reused "
    "cache plus the new prompt tokens, compressed again at the prompt's end as above.",
)

@dataclass(frozen=True)
class FinishedKvRecord:
    """KV outcome of one finished budgeted request."""

    req_id: str
    resident_tokens: int
    tokens_evicted: int
    evictions: int
    prompt_len: int = 0
    kept_prompt: int = 0
    blocks_freed: int = 0
    scorer: str = ""
    pipeline: str = ""


@dataclass
class EvictionTotals:
    """Cumulative counters of this engine (read by metrics and tests)."""

    evictions: int = 0
    tokens_evicted: int = 0
    blocks_freed: int = 0
    orders_not_applied: int = 0
    scoring_seconds: float = 0.0
    # Contained faults: (stage, reason) -> count (vllm:obcache_eviction_failures_total).
    failures: dict[tuple[str, str], int] = field(default_factory=dict)
    # Requests finished with an error because their cache was torn.
    failed_requests: int = 0
    # Preemptions of requests that had evicted (vllm:obcache_compressed_preemptions_total).
    compressed_preemptions: int = 0
    # Cumulative [tokens evicted, blocks freed, evictions] per (scorer, pipeline).
    by_option: dict[tuple[str, str], list[int]] = field(default_factory=dict)

    def count_failure(self, stage: str, reason: str) -> None:
        self.failures[(stage, reason)] = self.failures.get((stage, reason), 0) + 1


class BlockLedger:
    """Every budgeted request's :class:`RequestBlocks`, and the engine's eviction totals."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.requests: dict[str, RequestBlocks] = {}
        self.totals = EvictionTotals()
        self.finished: deque[FinishedKvRecord] = deque(maxlen=FINISHED_KEPT)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.requests

    def get(self, req_id: str) -> RequestBlocks | None:
        return self.requests.get(req_id)

    def open(self, req_id: str, options: KvOptions, prompt_len: int) -> RequestBlocks:
        blocks = self.requests[req_id] = RequestBlocks(options, prompt_len, self.block_size)
        return blocks

    def commit(self, req_id: str, row: RowState) -> tuple[int, int] | None:
        """:meth:`RequestBlocks.commit`, plus the engine totals."""
        blocks = self.requests[req_id]
        before = (blocks.tokens_evicted, blocks.blocks_freed, blocks.evictions)
        freed = blocks.commit(row)
        gained = [
            now - was
            for now, was in zip(
                (blocks.tokens_evicted, blocks.blocks_freed, blocks.evictions), before, strict=True
            )
        ]
        if any(gained):
            key = (blocks.options.scorer, blocks.options.pipeline)
            per_option = self.totals.by_option.setdefault(key, [0, 0, 0])
            for i, amount in enumerate(gained):
                per_option[i] += amount
            self.totals.tokens_evicted += gained[0]
            self.totals.blocks_freed += gained[1]
            self.totals.evictions += gained[2]
        return freed

    def reset(self, req_id: str) -> bool:
        """Preemption; returns whether the request had evicted (its KV is recomputed)."""
        blocks = self.requests.get(req_id)
        if blocks is None:
            return False
        compressed = blocks.dead > 0 or blocks.past_point
        if compressed:
            self.totals.compressed_preemptions += 1
        blocks.reset()
        return compressed

    def release(self, req_id: str, num_computed_tokens: int) -> FinishedKvRecord | None:
        """Finished or aborted: drop its record, keep what it ended with."""
        blocks = self.requests.pop(req_id, None)
        if blocks is None:
            return None
        record = FinishedKvRecord(
            req_id,
            blocks.resident(num_computed_tokens),
            blocks.tokens_evicted,
            blocks.evictions,
            prompt_len=blocks.prompt_len,
            kept_prompt=blocks.prompt_len if blocks.kept_prompt is None else blocks.kept_prompt,
            blocks_freed=blocks.blocks_freed,
            scorer=blocks.options.scorer,
            pipeline=blocks.options.pipeline,
        )
        self.finished.append(record)
        return record
