"""Checks of the tensor code on any torch device, without vLLM (pure torch).

Shared by the unit tests (CPU tensors) and ``scripts/gpu_kernels_check.sh`` (a bare GPU machine
with PyTorch but no vLLM): each check returns :class:`Row` results, a test asserts ``ok`` and
the script prints them as one table.

* :mod:`.paged` - FlashAttention's paged layout (vLLM 0.32): gather/scatter round trips on every
  KV cache layout, and the in-place read shift against a pure-torch paged-attention reference.
* :mod:`.scorers` - the scorers on the device against fp64 on CPU, and their cost against a
  same-shape ``scaled_dot_product_attention`` prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Row:
    """One measured line. ``bound``: an upper limit (``limit="max"``) or a lower one
    (``"min"``); None = information only (always ok)."""

    check: str
    case: str
    metric: str
    value: float
    bound: float | None = None
    limit: Literal["max", "min"] = "max"
    note: str = ""

    @property
    def ok(self) -> bool:
        if self.bound is None:
            return True
        if self.limit == "max":
            return self.value <= self.bound  # NaN fails
        return self.value >= self.bound


def within(check: str, case: str, metric: str, value, bound: float, note="") -> Row:
    """A row that passes when ``value <= bound``."""
    return Row(check, case, metric, float(value), bound, "max", note)


def at_least(check: str, case: str, metric: str, value, bound: float, note="") -> Row:
    """A row that passes when ``value >= bound`` (e.g. a negative control's error)."""
    return Row(check, case, metric, float(value), bound, "min", note)


def worst_by(rows: list[Row], key) -> list[Row]:
    """One row per ``key(row)`` (first-seen order): the one furthest from passing, i.e. the
    largest value under an upper limit, the smallest under a lower one."""
    groups: dict = {}
    for r in rows:
        k = key(r)
        best = groups.get(k)
        if best is None:
            groups[k] = r
            continue
        worse = r.value > best.value if r.limit == "max" else r.value < best.value
        if (not r.ok and best.ok) or (r.ok == best.ok and worse):
            groups[k] = r
    return list(groups.values())


def format_table(rows: list[Row]) -> str:
    """The rows as one Markdown table."""
    lines = [
        "| check | case | metric | value | bound | ok | note |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        bound = "" if r.bound is None else ("<= " if r.limit == "max" else ">= ") + f"{r.bound:.3g}"
        verdict = "ok" if r.ok else "FAIL"
        lines.append(
            f"| {r.check} | {r.case} | {r.metric} | {r.value:.4g} | {bound} | {verdict} "
            f"| {r.note} |"
        )
    return "\n".join(lines)
