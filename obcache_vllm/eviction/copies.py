"""A step's block copies: what vLLM runs, and what a copy may read (plain Python).

vLLM runs every block copy of a step (copy-on-write, and the copies into compressed entries)
in the worker before the step's forward pass, as one gather then one scatter
(``blocks[dst] = blocks[src]``): every source is read before any destination is written.
Two consequences, each a rule here:

* a copy whose source is the destination of another copy in the same batch reads the old
  contents of that block (:func:`resolve_copy_chains` rewrites the chain);
* a copy whose source is written by the same step's forward pass (a block registered in the
  prefix cache during this ``schedule()``) reads KV that does not exist yet, unless it needs
  only the slots computed before the step (a donor's partial last block, copied into its
  entry while the donor goes on prefilling the rest of that block)
  (:func:`copies_reading_unwritten` finds them; the scheduler never queues one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def resolve_copy_chains(copies: list) -> list:
    """Copies ``(src, dst)`` rewritten so that none reads a block another copy of the batch
    writes: ``a -> b, b -> c`` becomes ``a -> b, a -> c`` (equal to running them in order).
    Each item keeps its type (vLLM's ``KVCacheBlockCopy`` named tuple)."""
    if len(copies) < 2:
        return copies
    origin: dict[int, int] = {}  # destination block id -> the block it is a copy of
    resolved = []
    for copy in copies:
        src, dst = int(copy[0]), int(copy[1])
        first = origin.get(src, src)
        origin[dst] = first
        resolved.append(copy if first == src else type(copy)(first, dst))
    return resolved


def copies_reading_unwritten(
    copies: Sequence[Sequence[int]],
    written: Mapping[int, int],
    needs: Mapping[int, int],
    block_size: int,
) -> list[tuple[int, int, str]]:
    """The copies of one batch that read KV that is not there yet: ``(src, dst, why)`` with
    why ``"chained"`` (another copy of the batch writes the source) or ``"in_flight"`` (the
    step's forward pass writes the source from slot ``written[src]`` on, and the copy needs
    ``needs.get(dst, block_size)`` slots of it)."""
    destinations = {int(c[1]) for c in copies}
    bad = []
    for copy in copies:
        src, dst = int(copy[0]), int(copy[1])
        if src in destinations:
            bad.append((src, dst, "chained"))
        elif src in written and written[src] < needs.get(dst, block_size):
            bad.append((src, dst, "in_flight"))
    return bad
