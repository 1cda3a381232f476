"""The symbolic worker: vLLM's worker as the scheduler sees it, without a model.

Per step, in the order vLLM's V1 runner does it (and obcache-vllm's ``EvictingRunnerMixin``
drives ``WorkerEviction``):

1. ``WorkerEviction.update_states`` (the KV oracle fingerprints new entries' donors);
2. the block tables: new requests take theirs, running ones append their new blocks, resumed
   ones replace theirs; each new or resumed request's *expected* cache is built (see
   :meth:`SymbolicWorker._expected_start`);
3. the step's block copies, one gather then one scatter (vLLM's ``copy_kv_cache_blocks_
   inplace``), then ``WorkerEviction.check_copies`` (the KV oracle);
4. ``WorkerEviction.make_plan`` over the batch;
5. the forward pass: each scheduled request writes its new tokens' KV at their logical slots
   and reads every resident slot through its block table shifted by the plan's dead count,
   compared with its expected cache; a request whose step ends its known tokens samples one;
6. the plan's orders: a content-based selection (:func:`.kv.select`) gathered from the
   physical slots and written right-aligned, the order's spare blocks filled first;
7. ``WorkerEviction.commit`` and the report, on the ``ModelRunnerOutput``.

Every disagreement is a :class:`Violation` appended to ``violations`` (the run goes on, so a
test can report the first one and a long run can count them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.v1.outputs import ModelRunnerOutput

from obcache_vllm.vllm_ext.wire import REPORT_ATTR, STARTS_ATTR
from obcache_vllm.vllm_ext.worker.lifecycle import BatchRows, WorkerEviction

from .kv import EMPTY, POISON, StockChain, content, fold, fold_all, sample, select

LAYER = "model.layers.0.self_attn.attn"
VOCAB = 97


@dataclass(frozen=True)
class Violation:
    """One broken invariant: which, the step, the request(s) involved, and what was seen."""

    kind: str
    step: int
    detail: str

    def __str__(self) -> str:
        return f"[step {self.step}] {self.kind}: {self.detail}"


@dataclass
class Cache:
    """A request's expected cache: logical slots ``[dead*bs, dead*bs + len(contents))``."""

    dead: int
    contents: list[int]
    sig: int


@dataclass(frozen=True)
class Snapshot:
    """A request's expected cache at a moment another request may adopt it: right after an
    eviction (a ``kv_compress_at`` entry) or when it finished (a session entry)."""

    tokens: tuple[int, ...]
    dead: int
    contents: tuple[int, ...]
    options: object  # the KvOptions it was made with


@dataclass
class WorkerRequest:
    req_id: str
    block_ids: list[int]
    cache: Cache
    options: object | None  # KvOptions (None: stock)
    computed: int = 0  # tokens computed before the current step (the scheduler's count)
    chain: StockChain = field(default_factory=StockChain)
    chosen: int | None = None  # an error target: the count it chose (its decode budget)


def shape(options) -> int:
    """What of a request's options shapes a selection (beside its counts)."""
    if options is None:
        return 0
    return hash((options.scorer, options.pipeline, options.window, options.per_head))


def session_shape(options) -> tuple:
    """What a session entry and its adopter must share (the harness's own rule)."""
    return (options.requested_budget, options.decode, options.scorer, options.pipeline,
            options.window, options.recent, options.sinks, options.per_head)  # fmt: skip


class SymbolicWorker:
    """See the module docstring. ``scheduler``: the scheduler whose steps it executes (its
    ``requests`` give the token ids; obcache's ledger, when there is one, says what a request
    adopted, which the worker then checks against its own snapshots)."""

    def __init__(self, scheduler, block_size: int, num_blocks: int, plugin: bool) -> None:
        self.scheduler = scheduler
        self.bs = block_size
        self.slots: list[list[int]] = [[POISON] * block_size for _ in range(num_blocks)]
        self.requests: dict[str, WorkerRequest] = {}
        self.eviction = WorkerEviction(block_size) if plugin else None
        self.snapshots: dict[tuple[str, int], Snapshot] = {}
        self.violations: list[Violation] = []
        self.step = 0
        self.fresh: list[int] = []  # blocks handed out since the last step's copies

    # -- helpers ----------------------------------------------------------------------------
    def violate(self, kind: str, detail: str) -> None:
        self.violations.append(Violation(kind, self.step, detail))

    def allocated(self, block_ids) -> None:
        """The pool handed these blocks out: their new owners write them from the next
        step's copies on. Poisoned then (after the copies read their sources: vLLM runs a
        step's copies before anything else of the step writes a block), not now."""
        self.fresh.extend(block_ids)

    def read_kv(self, layer: int, block_ids, num_tokens: int):
        """The KV oracle's reader: contents as [Hkv=1, N, D=1] tensors (keys, values)."""
        values = []
        for i in range(num_tokens):
            values.append(self.slots[block_ids[i // self.bs]][i % self.bs])
        t = torch.tensor(values, dtype=torch.int64).reshape(1, -1, 1)
        return t, t

    def _ledger(self, req_id: str):
        ledger = getattr(self.scheduler, "obcache_ledger", None)
        return None if ledger is None else ledger.get(req_id)

    # -- expected caches ----------------------------------------------------------------------
    def _expected_start(self, req, w: WorkerRequest, computed: int) -> Cache:
        """What a request admitted with ``computed`` tokens in its cache must read: an
        adopted entry's snapshot (checked against the adopter's tokens and options, and for
        a ``kv_compress_at`` entry against a recompute), else stock KV of its own tokens."""
        blocks = self._ledger(req.request_id)
        start = None if blocks is None else blocks.start
        tokens = req.all_token_ids
        if start is not None and start.compressed:
            snap = self.snapshots.get((start.donor, start.tokens))
            who = f"{req.request_id} adopted {start.kind} entry {start.entry_id} of {start.donor}"
            if start.tokens != computed:
                self.violate("adopt_length", f"{who}: {start.tokens} tokens, computed {computed}")
            if snap is None:
                self.violate("adopt_unknown", f"{who}: the donor left no such cache")
                return Cache(start.dead, [POISON] * (computed - start.dead * self.bs), EMPTY)
            if snap.tokens != tuple(tokens[: start.tokens]):
                self.violate("adopt_tokens", f"{who}: the entry's tokens differ from the prompt")
            if snap.dead != start.dead:
                self.violate("adopt_dead", f"{who}: entry dead {start.dead}, donor {snap.dead}")
            self._check_options(who, start.kind, snap, w.options, req, start.tokens)
            return Cache(snap.dead, list(snap.contents), fold_all(snap.contents))
        chain = w.chain = StockChain()  # tokens may have changed (a streaming continuation)
        contents = chain.upto(tokens, computed)
        return Cache(0, list(contents), chain.sigs[computed - 1] if computed else EMPTY)

    def _check_options(self, who, kind, snap: Snapshot, options, req, tokens: int) -> None:
        if options is None:
            self.violate("adopt_unbudgeted", f"{who}: a stock request adopted an entry")
            return
        if kind == "session":
            if session_shape(snap.options) != session_shape(options):
                self.violate("adopt_options", f"{who}: session options differ")
            return
        # compress_at: the entry must equal this request's own recompute of its first k
        mine = (options.budget, options.compress_at, shape(options), options.recent,
                options.sinks)  # fmt: skip
        theirs = (snap.options.budget, snap.options.compress_at, shape(snap.options),
                  snap.options.recent, snap.options.sinks)  # fmt: skip
        if mine != theirs:
            self.violate("adopt_options", f"{who}: compress_at options differ")
            return
        resident = StockChain().upto(req.all_token_ids, tokens)  # [0, k) as computed whole
        keep = select(resident, tokens - snap.dead * self.bs, options.sinks, options.recent,
                      shape(options))  # fmt: skip
        if tuple(resident[i] for i in keep) != snap.contents:
            self.violate("adopt_recompute", f"{who}: the entry is not what a recompute keeps")

    # -- one step -----------------------------------------------------------------------------
    def execute(self, out) -> ModelRunnerOutput:
        self.step += 1
        scheduler = self.scheduler
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        if self.eviction is not None:
            self.eviction.update_states(out, self.read_kv, 1)
        starts = getattr(out, STARTS_ATTR, None) or {}
        for new in out.scheduled_new_reqs:
            req = scheduler.requests[new.req_id]
            options = None
            if self.eviction is not None and new.req_id in self.eviction.states:
                options = self.eviction.states[new.req_id].options
            w = self.requests.get(new.req_id)
            if w is not None:  # a streaming-input continuation: the cache goes on
                w.block_ids = list(new.block_ids[0])
                w.options = options
            else:
                w = WorkerRequest(new.req_id, list(new.block_ids[0]), Cache(0, [], EMPTY), options)
                self.requests[new.req_id] = w
                w.cache = self._expected_start(req, w, new.num_computed_tokens)
            w.computed = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            w = self.requests[req_id]
            ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                w.block_ids = list(ids[0]) if ids is not None else []
                if self.eviction is not None and req_id in self.eviction.states:
                    w.options = self.eviction.states[req_id].options
                w.cache = self._expected_start(scheduler.requests[req_id], w,
                                               cached.num_computed_tokens[i])  # fmt: skip
            elif ids is not None:
                w.block_ids.extend(ids[0])
            w.computed = cached.num_computed_tokens[i]
        for req_id, (dead, _layout) in starts.items():
            w = self.requests.get(req_id)
            if w is not None and w.cache.dead != dead:
                self.violate("start_dead", f"{req_id}: starts with {dead} dead, expected "
                             f"{w.cache.dead}")  # fmt: skip
        tables = {r: (w.block_ids, w.computed) for r, w in self.requests.items()}
        self._copy(out.kv_cache_block_copies or ())
        if self.eviction is not None:
            self.eviction.check_copies(out, tables, self.read_kv)
        req_ids = list(out.num_scheduled_tokens)
        qsl = [0]
        for r in req_ids:
            qsl.append(qsl[-1] + out.num_scheduled_tokens[r])
        plan = None
        if self.eviction is not None:
            batch = BatchRows(
                req_ids=req_ids,
                query_start_loc=qsl,
                num_computed=[self.requests[r].computed for r in req_ids],
                prompt_lens={r: scheduler.requests[r].num_prompt_tokens for r in req_ids},
            )
            plan = self.eviction.make_plan(out, batch, {LAYER: 0}, "cpu")
        sampled = []
        for row, req_id in enumerate(req_ids):
            dead = plan.dead[row] if plan is not None else 0
            sampled.append(self._forward(req_id, out.num_scheduled_tokens[req_id], dead))
        if plan is not None:
            for row in plan.rows:
                if row.order is not None and row.outcome.failure is None:
                    self._compact(row)
            self.eviction.commit(1)
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        if self.eviction is not None:
            report = self.eviction.take_report()
            if report is not None:
                setattr(output, REPORT_ATTR, report)
        return output

    def _copy(self, copies) -> None:
        """vLLM's block copies: every source read, then every destination written (blocks
        handed out since the last step are poisoned in between)."""
        read = [list(self.slots[int(c[0])]) for c in copies]
        for b in self.fresh:
            self.slots[b] = [POISON] * self.bs
        self.fresh.clear()
        for c, values in zip(copies, read, strict=True):
            self.slots[int(c[1])] = values

    def _physical(self, w: WorkerRequest, position: int) -> tuple[int, int]:
        index = position // self.bs
        if index >= len(w.block_ids):
            return -1, POISON
        block = w.block_ids[index]
        return block, self.slots[block][position % self.bs]

    def _forward(self, req_id: str, n: int, dead: int) -> list[int]:
        """Write the step's ``n`` tokens, read the cache through the table shifted by
        ``dead`` (the plan's), sample when the step reaches the request's last token."""
        w = self.requests[req_id]
        req = self.scheduler.requests[req_id]
        cache, bs = w.cache, self.bs
        if cache.dead != dead:
            self.violate("dead_disagree", f"{req_id}: the worker reads past {dead} dead blocks, "
                         f"its cache has {cache.dead}")  # fmt: skip
        held = cache.dead * bs + len(cache.contents)
        if held != w.computed:
            self.violate("cache_length", f"{req_id}: cache holds up to {held}, "
                         f"computed {w.computed}")  # fmt: skip
        tokens = req.all_token_ids
        for p in range(w.computed, w.computed + n):
            index = p // bs
            if index >= len(w.block_ids):
                self.violate("no_block", f"{req_id}: position {p} has no block")
                continue
            block = w.block_ids[index]
            if block == 0:
                self.violate("write_null", f"{req_id}: position {p} lands in the null block")
                continue
            c = content(cache.sig, tokens[p], p)
            self.slots[block][p % bs] = c
            cache.contents.append(c)
            cache.sig = fold(cache.sig, c)
        self._read(req_id, w, dead)
        end = w.computed + n
        if end >= req.num_tokens:
            token = sample(cache.sig, VOCAB)
            return [token]
        return []

    def _read(self, req_id: str, w: WorkerRequest, dead: int) -> None:
        """Every resident slot the attention reads (through the table shifted by ``dead``)
        must hold what the request's cache holds; compared a block at a time."""
        bs, cache = self.bs, w.cache
        base = cache.dead * bs
        end = base + len(cache.contents)
        position = max(dead * bs, base)
        while position < end:
            index, offset = divmod(position, bs)
            n = min(bs - offset, end - position)
            block = w.block_ids[index] if index < len(w.block_ids) else -1
            got = self.slots[block][offset : offset + n] if block >= 0 else [POISON] * n
            want = cache.contents[position - base : position - base + n]
            if got != want:
                j = next(i for i in range(n) if got[i] != want[i])
                what = "poison" if got[j] == POISON else "other KV"
                self.violate("stale_read", f"{req_id} reads position {position + j} from block "
                             f"{block}: {what} (block held by {self._owner(block)})")  # fmt: skip
                return
            position += n

    def _owner(self, block: int) -> str:
        owners = [r for r, w in self.requests.items() if block in w.block_ids]
        return ",".join(owners) or "nobody"

    def _compact(self, row) -> None:
        """Apply one order of the plan (every layer: the harness has one)."""
        w = self.requests[row.req_id]
        order, bs, cache = row.order, self.bs, w.cache
        options = row.state.options
        if order.dead_before != cache.dead or order.logical_len != cache.dead * bs + len(
            cache.contents
        ):
            self.violate("order_mismatch", f"{row.req_id}: order {order} on a cache of dead "
                         f"{cache.dead}, {len(cache.contents)} resident")  # fmt: skip
            return
        dead_after = order.dead_after
        if order.max_error is not None:  # an error target: any whole-block count may win
            candidates = list(range(order.dead_after, order.dead_before - 1, -1))
            dead_after = candidates[cache.sig % len(candidates)]
        kept = order.logical_len - dead_after * bs
        for index, spare in order.preserve:
            self.slots[spare] = list(self.slots[w.block_ids[index]])
        if dead_after > order.dead_before:
            keep = select(cache.contents, kept, options.sinks, options.recent, shape(options))
            base = order.dead_before * bs
            gathered = [self._physical(w, base + i)[1] for i in keep]
            for m, value in enumerate(gathered):
                position = dead_after * bs + m
                block = w.block_ids[position // bs]
                if block == 0:
                    self.violate("write_null", f"{row.req_id}: compaction writes position "
                                 f"{position} into the null block")  # fmt: skip
                    continue
                self.slots[block][position % bs] = value
            contents = [cache.contents[i] for i in keep]
            w.cache = Cache(dead_after, contents, fold_all(contents))
        if order.max_error is not None:
            row.outcome.chosen = (dead_after, kept, 0.0)
            w.chosen = kept
        elif options.max_error is not None and w.chosen is not None and not (
            w.chosen <= kept < w.chosen + bs
        ):  # a target decodes as the fixed budget of the count it chose
            self.violate("target_decode", f"{row.req_id}: a decode-time order keeps {kept}, "
                         f"its target chose {w.chosen}")  # fmt: skip
        row.outcome.compacted_layers = 1
        req = self.scheduler.requests[row.req_id]
        self.snapshots[(row.req_id, order.logical_len)] = Snapshot(
            tuple(req.all_token_ids[: order.logical_len]), w.cache.dead,
            tuple(w.cache.contents), options,
        )  # fmt: skip

    def snapshot_finished(self, req_id: str, tokens) -> None:
        """A request finished: what it leaves (a session entry is its final cache)."""
        w = self.requests.get(req_id)
        if w is None or w.options is None:
            return
        n = w.cache.dead * self.bs + len(w.cache.contents)
        self.snapshots[(req_id, n)] = Snapshot(tuple(tokens[:n]), w.cache.dead,
                                               tuple(w.cache.contents), w.options)  # fmt: skip
