"""Drawing cases: per-case option profiles, operations, engine settings (see :mod:`.ops`).

:func:`generate` draws one case from any source of choices (:class:`Draw`): hypothesis's
``data.draw`` in the suite (it shrinks), a seeded ``random.Random`` in the long run
(``scripts/sim.py``); :func:`case_for` is the long run's mix by seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol

from .engine import SimConfig
from .ops import Abort, Add, Case, Reset, Step, Stream, Turn


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
        if _flag(d, 50):  # a floor among the fixed budgets the other profiles draw
            f["kv_budget"]["min"] = d.pick((24, 40, 64))
        f["kv_pipeline"] = d.pick(("snapkv", "tova"))
        f["kv_decode"] = _flag(d, 30)  # decoding to the count it chose
        reuse = d.int(0, 9)
        if reuse < 4:  # at a compress point: its cache is left and adopted as an entry
            f["kv_compress_at"] = d.pick((64, 96, 160, -8, -24))
        elif reuse < 7:  # a session: each turn chooses within what the last ones left
            f["kv_session"] = True
    elif kind == "adakv":
        f["kv_pipeline"] = "adakv"
        f["kv_decode"] = _flag(d, 40)
        if _flag(d, 40):  # its per-head layout carried to the next turn
            f["kv_session"] = True
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
