"""Running a case as a mode checks it, and shrinking what it finds (see :mod:`.ops`).

:func:`findings` runs a case with every invariant (``"all"``) or paired with vLLM's own
scheduler (``"stock"``, ``"pressure"``); :func:`shrink` makes a violating case smaller while it
still shows the violation, and :func:`pasteable` prints it for a named regression.
"""

from __future__ import annotations

from dataclasses import replace

from .ops import Add, Case, Step, Turn, paired, run, tokens


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
