"""Symbolic KV: contents, caches and the selection a compaction keeps (plain Python).

See the package docstring. Every value here is an ``int``; tuples of ints hash the same in
every process (no string hashing), so runs are reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence

POISON = -1  # a slot nothing wrote for its reader: a fresh block, the null block
_MASK = (1 << 62) - 1


def content(sig: int, token: int, position: int) -> int:
    """The KV of ``token`` at ``position`` computed on a cache whose contents fold to
    ``sig``."""
    return hash((0x4B56, sig, token, position)) & _MASK


def fold(sig: int, value: int) -> int:
    """``sig`` extended by one more resident content."""
    return hash((0x5349, sig, value)) & _MASK


EMPTY = 0x0B  # sig of an empty cache


def fold_all(values: Sequence[int]) -> int:
    sig = EMPTY
    for v in values:
        sig = fold(sig, v)
    return sig


def sample(sig: int, vocab: int) -> int:
    """The token sampled after a cache folding to ``sig`` (never 0)."""
    return 1 + (hash((0x544F, sig)) & _MASK) % (vocab - 1)


class StockChain:
    """The stock (never compressed) cache of a token sequence, extended on demand: contents
    and the sig after each position."""

    __slots__ = ("contents", "sigs")

    def __init__(self) -> None:
        self.contents: list[int] = []
        self.sigs: list[int] = []

    def upto(self, tokens: Sequence[int], n: int) -> list[int]:
        """Contents of positions ``[0, n)`` of ``tokens`` (which must extend what was seen)."""
        sig = self.sigs[-1] if self.sigs else EMPTY
        for p in range(len(self.contents), n):
            c = content(sig, tokens[p], p)
            sig = fold(sig, c)
            self.contents.append(c)
            self.sigs.append(sig)
        return self.contents[:n]


def select(resident: Sequence[int], kept: int, sinks: int, recent: int, shape: int) -> list[int]:
    """Indices (sorted) of the ``kept`` resident entries a compaction keeps: the first
    ``sinks``, the last ``recent``, then the highest ``hash(content, shape)``. A function of
    the contents and the options' shape only: a recompute keeps the same set."""
    n = len(resident)
    if kept >= n:
        return list(range(n))
    forced = set(range(min(sinks, n))) | set(range(max(0, n - recent), n))
    if len(forced) >= kept:
        return sorted(forced)[:kept] if len(forced) > kept else sorted(forced)
    rest = sorted(
        (i for i in range(n) if i not in forced),
        key=lambda i: hash((0x5345, resident[i], shape)) & _MASK,
        reverse=True,
    )
    return sorted(forced | set(rest[: kept - len(forced)]))
