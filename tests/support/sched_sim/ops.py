"""Operations on a simulated engine, as data, and their runner.

A test case is a :class:`Case`: an engine configuration and a list of operations. Operations
are frozen dataclasses (printed as they are written), so a shrunk counterexample is pasted
into a named regression test as it is. Cases are drawn by :mod:`.gen` and what they show is
found and shrunk by :mod:`.shrink`.

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
from dataclasses import dataclass, field, replace

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
