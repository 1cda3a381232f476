"""Operations on a simulated engine, as data, their generation and their runner.

A test case is a :class:`Case`: an engine configuration and a list of operations. Operations
are frozen dataclasses (printed as they are written), so a shrunk counterexample is pasted
into a named regression test as it is. :func:`generate` draws one case from any source of
choices (:class:`Draw`): hypothesis's ``data.draw`` in the suite (it shrinks), a seeded
``random.Random`` in the long run (``scripts/sim.py``).

Prompts come from three shared documents (so prefixes are shared, registered, hit and
compressed once) and a request's own tokens; a :class:`Turn` is a chat's next turn: the
previous turn's prompt, its answer and new tokens. Every feature that meets in the
scheduler can be drawn: every pipeline, ``kv_decode``, ``kv_compress_at`` (a position, a
negative one, ``"auto"``), ``kv_session`` and vLLM's ``session_id``, tentative sessions,
``kv_when: "pressure"``, ``kv_prefill_evict``, error targets, ``cache_salt``, streaming
inputs, aborts, ``reset_prefix_cache``, and a pool small enough that requests are preempted.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from . import checks
from .engine import Sim, SimConfig

DOC_TOKENS = 320
TURN_WAIT = 400  # steps a Turn waits, at most, for the previous turn to finish


@functools.cache
def _document(index: int) -> tuple[int, ...]:
    rng = random.Random(1000 + index)
    return tuple(rng.randrange(1, 97) for _ in range(DOC_TOKENS))


def document(index: int) -> list[int]:
    return list(_document(index))


def own_tokens(rid: int, n: int) -> list[int]:
    rng = random.Random(rid * 7919 + 17)
    return [rng.randrange(1, 97) for _ in range(n)]


@dataclass(frozen=True)
class Add:
    """A request: ``shared`` tokens of document ``doc``, then ``own`` of its own."""

    rid: int
    doc: int
    shared: int
    own: int
    max_tokens: int
    fields: tuple = ()  # kv_* fields as sorted (key, value) pairs; () is a stock request
    session_id: str | None = None
    salt: str | None = None
    stream: bool = False  # a streaming-input request (its first chunk)


@dataclass(frozen=True)
class Turn:
    """A chat's next turn: request ``prev``'s prompt and answer, then ``own`` new tokens
    (sent once ``prev`` has finished: the engine steps until then, as a client waits)."""

    rid: int
    prev: int
    own: int
    max_tokens: int
    fields: tuple = ()
    session_id: str | None = None


@dataclass(frozen=True)
class Step:
    n: int = 1


@dataclass(frozen=True)
class Abort:
    rid: int


@dataclass(frozen=True)
class Reset:
    pass


@dataclass(frozen=True)
class Stream:
    """The next chunk of streaming request ``rid`` (``own`` new tokens; 0: the input ends)."""

    rid: int
    own: int


Op = Add | Turn | Step | Abort | Reset | Stream


@dataclass(frozen=True)
class Case:
    config: SimConfig
    ops: tuple = ()


def rid_name(rid: int) -> str:
    return f"r{rid}"


@dataclass
class Runner:
    """Applies operations to one engine; ``stock``: strip every kv_* field (the same
    traffic on a stock engine)."""

    sim: Sim
    stock: bool = False
    prompts: dict = field(default_factory=dict)
    skip: frozenset = frozenset()  # request names not to add (refused in the paired run)

    def apply(self, op: Op) -> None:
        sim = self.sim
        if isinstance(op, Add):
            prompt = document(op.doc)[: op.shared] + own_tokens(op.rid, op.own)
            self._add(op.rid, prompt, op.max_tokens, op.fields, op.session_id, op.salt,
                      op.stream)  # fmt: skip
        elif isinstance(op, Turn):  # the client waits for the previous turn's answer
            prev = sim.results.get(rid_name(op.prev))
            for _ in range(TURN_WAIT):
                if rid_name(op.prev) not in sim.scheduler.requests:
                    break
                sim.step()
            if op.prev not in self.prompts or prev is None or prev.finish is None:
                return
            prompt = self.prompts[op.prev] + prev.tokens + own_tokens(op.rid, op.own)
            self._add(op.rid, prompt, op.max_tokens, op.fields, op.session_id, None, False)
        elif isinstance(op, Step):
            for _ in range(op.n):
                sim.step()
        elif isinstance(op, Abort):
            sim.abort(rid_name(op.rid))
        elif isinstance(op, Reset):
            sim.reset()
        elif isinstance(op, Stream):
            name = rid_name(op.rid)
            request = sim.scheduler.requests.get(name)
            if request is None or not request.resumable or op.rid not in self.prompts:
                return
            fields = self.stream_fields.get(op.rid, ())
            if op.own == 0:  # vLLM's end-of-input request: not resumable
                sim.add(name, [0], 1, dict(fields) if not self.stock else None)
            else:
                chunk = own_tokens(op.rid * 31 + len(self.prompts[op.rid]), op.own)
                self.prompts[op.rid] = self.prompts[op.rid] + chunk
                sim.add(name, chunk, 4, dict(fields) if not self.stock else None,
                        resumable=True)  # fmt: skip

    @property
    def stream_fields(self) -> dict:
        return self.__dict__.setdefault("_stream_fields", {})

    def _add(self, rid, prompt, max_tokens, fields, session_id, salt, stream) -> None:
        name = rid_name(rid)
        if name in self.sim.results or name in self.sim.scheduler.requests or name in self.skip:
            return  # ids are not reused within a case
        fields = {} if self.stock else dict(fields)
        self.prompts[rid] = list(prompt)
        if stream:
            self.stream_fields[rid] = tuple(fields.items())
        self.sim.add(name, prompt, max_tokens, fields or None, session_id=session_id,
                     cache_salt=salt, resumable=stream)  # fmt: skip


def run(case: Case, *, end: bool = True, stock: bool = False, skip=frozenset()) -> Sim:
    """Run ``case`` on a fresh engine (its plugin setting unless ``stock``), with every
    check; ``end``: also stop everything and check the drain and leaks; ``skip``: requests
    not to add (those admission refused in the run this one is compared with)."""
    config = replace(case.config, plugin=False) if stock else case.config
    runner = Runner(Sim(config), stock=stock, skip=frozenset(skip))
    for op in case.ops:
        runner.apply(op)
    if end:
        checks.check_end(runner.sim)
    return runner.sim


# -- generation ---------------------------------------------------------------------------------
class Draw(Protocol):
    """A source of choices (hypothesis's ``data.draw`` wrapped, or a seeded Random)."""

    def int(self, lo: int, hi: int) -> int: ...  # inclusive

    def pick(self, options: Sequence[Any]) -> Any: ...


class RandomDraw:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def pick(self, options):
        return options[self.rng.randrange(len(options))]


def _flag(d: Draw, percent: int) -> bool:
    return d.int(0, 99) < percent


PIPELINES = ("snapkv", "tova", "h2o", "streaming", "adakv")


def _common(d: Draw) -> dict[str, Any]:
    return {
        "kv_pipeline": d.pick(("snapkv", "tova", "streaming")),
        "kv_scorer": d.pick(("obcache_key", "attn")),
        "kv_window": d.pick((1, 8, 16)),
        "kv_recent": d.pick((0, 4)),
        "kv_sinks": d.pick((0, 4)),
    }


# A profile is what a client sends on every request of one kind; a case draws a few and its
# requests share them, as a server's clients do (so entries are made and adopted, sessions
# continued, shared prefixes registered and hit).
PROFILES = ("plain", "decode", "compress_at", "session", "auto", "pressure", "prefill_evict",
            "target", "adakv", "h2o", "random")  # fmt: skip


def draw_profile(d: Draw, kind: str) -> dict[str, Any]:
    """The kv_* fields of one profile (``random``: any combination, often refused)."""
    if kind == "random":
        return dict(draw_fields(d, stock_percent=0))
    f = {"kv_budget": d.pick((24, 40, 64, 0.25, 0.5)), **_common(d)}
    if kind == "decode":
        f["kv_decode"] = True
    elif kind == "compress_at":
        f["kv_compress_at"] = d.pick((64, 96, 160, -8, -24))
    elif kind == "session":
        f["kv_session"] = True
        f["kv_decode"] = _flag(d, 30)
    elif kind == "auto":
        f["kv_compress_at"] = "auto"
    elif kind == "pressure":
        f["kv_when"] = "pressure"
    elif kind == "prefill_evict":
        f["kv_prefill_evict"] = True
        f["kv_decode"] = _flag(d, 50)
    elif kind == "target":
        f["kv_budget"] = {"max_error": d.pick((0.01, 0.2))}
        f["kv_pipeline"] = d.pick(("snapkv", "tova"))
    elif kind == "adakv":
        f["kv_pipeline"] = "adakv"
    elif kind == "h2o":
        f["kv_pipeline"] = "h2o"
        f["kv_scorer"] = d.pick(("obcache_key", "attn"))
    return f


def _sorted(fields: dict) -> tuple:
    return tuple(sorted(fields.items(), key=lambda kv: kv[0]))


def draw_fields(d: Draw, *, stock_percent: int = 30, only_pressure: bool = False) -> tuple:
    """kv_* fields of one request drawn field by field (``()``: a stock request). Many
    combinations are refused by admission, as they would be on a server."""
    if _flag(d, stock_percent):
        return ()
    f: dict[str, Any] = {}
    kind = d.int(0, 9)
    if kind < 6:
        f["kv_budget"] = d.int(24, 120)
    elif kind < 9:
        f["kv_budget"] = d.pick((0.25, 0.5))
    else:
        f["kv_budget"] = {"max_error": d.pick((0.01, 0.2))}
    f["kv_pipeline"] = d.pick(PIPELINES)
    f["kv_scorer"] = d.pick(("obcache_key", "attn"))
    f["kv_window"] = d.pick((1, 8, 16))
    f["kv_recent"] = d.pick((0, 4, 16))
    f["kv_sinks"] = d.pick((0, 4))
    if only_pressure:
        f["kv_when"] = "pressure"
        f["kv_pipeline"] = d.pick(("snapkv", "tova", "streaming"))
        if isinstance(f["kv_budget"], dict):
            f["kv_budget"] = 48
        return _sorted(f)
    if _flag(d, 30):
        f["kv_decode"] = True
    at = d.int(0, 9)
    if at == 6:
        f["kv_compress_at"] = d.int(16, 160)
    elif at == 7:
        f["kv_compress_at"] = -d.int(4, 40)
    elif at >= 8:
        f["kv_compress_at"] = "auto"
    if _flag(d, 20):
        f["kv_session"] = True
    if _flag(d, 20):
        f["kv_when"] = "pressure"
    if _flag(d, 15):
        f["kv_prefill_evict"] = True
    return _sorted(f)


def _max_tokens(d: Draw) -> int:
    """Mostly short answers; now and then a long one (a pool held by a long generation)."""
    return d.int(40, 180) if _flag(d, 25) else d.int(1, 24)


def draw_config(d: Draw) -> SimConfig:
    share, share_max = d.pick(((0.25, 0.5), (0.5, 0.5), (0.0, 0.0), (0.25, 0.75)))
    return SimConfig(
        num_blocks=d.pick((24, 40, 64)),
        block_size=8,
        max_num_seqs=d.pick((2, 4)),
        max_batched_tokens=d.pick((32, 48, 96)),
        prefix_caching=d.pick((True, True, True, False)),
        share=share,
        share_max=share_max,
    )


PREFIXES = (0, 24, 64, 96, 96, 160, 160, 240)  # tokens of a document a prompt starts with


def draw_ops(d: Draw, n: int, *, config: SimConfig | None = None, stock_only: bool = False,
             only_pressure: bool = False) -> list:  # fmt: skip
    """``n`` operations (see the module docstring): requests drawn from a few profiles of
    options (or stock), chats' next turns with their previous turn's options, steps, aborts,
    resets, streaming chunks; prompts mostly sized to ``config``'s pool."""
    config = config or SimConfig()
    if stock_only:
        profiles: list[tuple] = [()]
    elif only_pressure:
        profiles = [(), *(draw_fields(d, stock_percent=0, only_pressure=True) for _ in range(2))]
    else:
        kinds = [d.pick(PROFILES) for _ in range(d.int(1, 3))]
        profiles = [(), *(_sorted(draw_profile(d, kind)) for kind in kinds)]
    ops: list = []
    rid = 0
    added: dict[int, tuple] = {}  # rid -> its fields
    docs: list[tuple[int, int]] = []  # (document, shared tokens) already sent
    for _ in range(n):
        k = d.int(0, 99)
        if k < 34:
            rid += 1
            fields = d.pick(profiles)
            session = None if only_pressure else d.pick((None, None, None, "s1", "s2"))
            stream = not only_pressure and _flag(d, 6)
            if docs and _flag(d, 50):  # another question over a document already sent
                doc, doc_prefix = d.pick(docs)
            else:  # mostly prompts that fit the pool well; now and then one that does not
                fits = [n for n in PREFIXES if n <= 0.6 * (config.num_blocks - 1) * 8]
                doc, doc_prefix = d.int(0, 2), d.pick(PREFIXES if _flag(d, 10) else fits)
                docs.append((doc, doc_prefix))
            ops.append(Add(rid, doc, doc_prefix, d.int(1, 80), _max_tokens(d), fields, session,
                           d.pick((None, None, "salt")), stream))  # fmt: skip
            added[rid] = fields
        elif k < 46 and added:
            rid += 1
            prev = d.pick(tuple(added))
            fields = added[prev] if _flag(d, 80) else d.pick(profiles)
            ops.append(Turn(rid, prev, d.int(1, 40), d.int(1, 16), fields,
                            d.pick((None, "s1"))))  # fmt: skip
            added[rid] = fields
        elif k < 82:
            ops.append(Step(d.pick((1, 1, 2, 3, 5, 8, 20))))
        elif k < 88 and added:
            ops.append(Abort(d.pick(tuple(added))))
        elif k < 91:
            ops.append(Reset())
        elif added:
            ops.append(Stream(d.pick(tuple(added)), d.pick((0, 4, 12, 30))))
    return ops


def generate(d: Draw, n_ops: int | None = None, **kwargs) -> Case:
    config = draw_config(d)
    return Case(config, tuple(draw_ops(d, n_ops or d.int(4, 30), config=config, **kwargs)))


# -- running a case the way a mode checks it ----------------------------------------------------
MODES = ("stock", "pressure", "all", "all", "all")  # seed % 5 -> mode (scripts/sim.py)


def case_for(seed: int) -> tuple[Case, str]:
    """The seeded case and its mode: one in five without budgets (compared with vLLM's own
    scheduler), one in five with ``kv_when: pressure`` budgets only (compared with the same
    traffic unbudgeted up to the first compression under pressure), the rest with every
    feature."""
    mode = MODES[seed % len(MODES)]
    case = generate(RandomDraw(seed), stock_only=mode == "stock",
                    only_pressure=mode == "pressure")  # fmt: skip
    return case, mode


def findings(case: Case, mode: str = "all") -> list[str]:
    """Every violation of ``case`` run as ``mode`` checks it, as text (``[step n] kind:
    ...``); a crash of the engine is a finding too."""
    try:
        if mode == "all":
            sim = run(case)
            return [str(v) for v in sim.violations]
        ours, stock = paired(case, end=mode == "stock")
    except Exception as exc:
        return [f"crash: {type(exc).__name__}: {exc}"]
    found = [str(v) for v in ours.violations + stock.violations]
    first = len(ours.trace)
    if mode == "pressure":
        first = next((i for i, n in enumerate(ours.pressure) if n), len(ours.trace))
    for i in range(min(first, len(ours.trace), len(stock.trace))):
        if ours.trace[i] != stock.trace[i]:
            found.append(f"[step {i + 1}] {mode}_equivalence: {ours.trace[i]} != {stock.trace[i]}")
            break
    if mode == "stock" and tokens(ours) != tokens(stock):
        found.append("stock_equivalence: the requests' tokens differ")
    return found


def kind_of(finding: str) -> str:
    return finding.split("] ", 1)[-1].split(":", 1)[0]


def shrink_finding(case: Case, mode: str, kind: str, budget: int = 400) -> Case:
    """:func:`shrink` for a finding of ``mode`` (a pressure case keeps its ``kv_when``)."""
    keep = ("kv_budget", "kv_when") if mode == "pressure" else ("kv_budget",)
    return shrink(case, kind, budget, kinds=lambda c: {kind_of(f) for f in findings(c, mode)},
                  keep=keep)  # fmt: skip


def pasteable(case: Case) -> str:
    ops = ",\n    ".join(repr(op) for op in case.ops)
    return f"Case({case.config!r}, (\n    {ops},\n))"


# -- shrinking ----------------------------------------------------------------------------------
def refused(sim: Sim) -> frozenset:
    """Names of the requests admission refused in ``sim``."""
    return frozenset(name for name, r in sim.results.items() if r.refused)


def paired(case: Case, *, end: bool = True) -> tuple[Sim, Sim]:
    """``case`` on its engine and, with every kv_* field stripped, on vLLM's own scheduler,
    each without the requests either one's admission refused (a budget may let a request
    in that stock refuses, and the reverse): the same traffic, to compare step by step."""
    ours = run(case, end=end)
    stock = run(case, stock=True, end=end, skip=refused(ours))
    if refused(stock) - refused(ours):
        skip = refused(stock) | refused(ours)
        ours = run(case, end=end, skip=skip)
        stock = run(case, stock=True, end=end, skip=skip)
    return ours, stock


def tokens(sim: Sim) -> dict:
    """Every admitted request's tokens."""
    return {name: r.tokens for name, r in sim.results.items() if not r.refused}


def violation_kinds(case: Case) -> set[str]:
    try:
        sim = run(case)
    except Exception as exc:  # a crash of the engine is a finding of its own
        return {f"crash:{type(exc).__name__}"}
    return {v.kind for v in sim.violations}


def shrink(case: Case, kind: str, budget: int = 400, kinds=None,
           keep: tuple[str, ...] = ("kv_budget",)) -> Case:  # fmt: skip
    """A smaller case that still shows ``kind`` (greedy: drop operations, drop kv fields
    but those in ``keep``, shorten prompts and outputs), within ``budget`` runs. ``kinds``:
    what a case shows (default :func:`violation_kinds`; a paired comparison's for the
    equivalences). For pasting into a regression."""
    runs = 0
    kinds = kinds or violation_kinds

    def still(candidate: Case) -> bool:
        nonlocal runs
        runs += 1
        return kind in kinds(candidate)

    changed = True
    while changed and runs < budget:
        changed = False
        ops = list(case.ops)
        i = 0
        while i < len(ops) and runs < budget:  # drop one operation
            candidate = replace(case, ops=tuple(ops[:i] + ops[i + 1 :]))
            if still(candidate):
                case, ops, changed = candidate, ops[:i] + ops[i + 1 :], True
            else:
                i += 1
        for i, op in enumerate(ops):  # simpler operations
            for simpler in _simpler(op, keep):
                if runs >= budget:
                    break
                candidate = replace(case, ops=tuple(ops[:i] + [simpler] + ops[i + 1 :]))
                if still(candidate):
                    case, changed = candidate, True
                    ops = list(case.ops)
                    op = simpler
    return case


def _simpler(op, keep):
    if isinstance(op, Step) and op.n > 1:
        yield replace(op, n=op.n // 2)
        yield replace(op, n=op.n - 1)
    if isinstance(op, Add | Turn):
        for i in range(len(op.fields)):
            if op.fields[i][0] not in keep:
                yield replace(op, fields=op.fields[:i] + op.fields[i + 1 :])
        if op.session_id is not None:
            yield replace(op, session_id=None)
        if op.max_tokens > 1:
            yield replace(op, max_tokens=max(1, op.max_tokens // 2))
        if op.own > 1:
            yield replace(op, own=max(1, op.own // 2))
    if isinstance(op, Add):
        if op.salt is not None:
            yield replace(op, salt=None)
        if op.stream:
            yield replace(op, stream=False)
        if op.shared:
            yield replace(op, shared=0)
