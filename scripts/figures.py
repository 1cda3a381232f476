"""Figures on the documentation pages, tied to the results file they come from.

A figure quoted on a page carries its source in an HTML comment right after it (invisible on
the site and on GitHub)::

    the top-20 estimate recovers 91<!--fig results/fidelity-topk/fidelity.json
    topk_check|ratio .0f x100--> % of the KL

``PATH`` is a JSON file under ``results/`` (or a generated one such as
``deploy/grafana/obcache.json``), ``KEYS`` the ``|``-separated keys and list indices
down to the number (arm names may hold dots and slashes, so neither separates), ``SPEC`` a
Python format spec for the number (``.3f``, ``,.0f``, ``+.3f``), and an optional ``xN`` scales
it first (``x100`` for a percentage). The figure is the number written just before the comment.

In a list of records a key ``field=value&field=value`` picks the one record whose fields hold
those values (``results/eval/results.json method=tova/attn/shared&budget=0.2|accuracy``); it
must match exactly one (``summary.arm=stock`` looks inside a record's ``summary``). A ``.md``
results file (or a ``.txt`` one holding markdown tables) is addressed as ``TABLE|ROW|COLUMN[|N]``:
the table's index in the file, the row by its first cell and the column by its header (or either
by a 0-based index; ``_`` stands for a space), and the N-th number in that cell (first if left
out), so ``results/bench/long_prefill.md 0|stock|prefill_s .2f``. In a JSON object too ``_``
stands for a space in a key the file spells with one. ``KEYS::KEYS`` is the ratio of two
numbers (``1.97x`` from two throughputs) and ``KEYS:-:KEYS`` their difference; either side may
name another file as ``results/other.json#KEYS``. In a markdown table row write each ``|`` of
KEYS as ``\\|``, or the row splits there.

A figure from an earlier run (a "before" beside an "after") names that run's file as it was
committed then, kept under ``results/earlier/<commit>/`` (``git show <commit>:results/...``), so
a shallow clone checks it too: ``results/earlier/ebee2da/bench-vllm-serve/serve.md``.

Derived figures (a range, a median) take an aggregate in front of KEYS: ``min:``, ``max:``,
``median:``, ``mean:``, ``sum:``, ``count:``, or ``count<X:`` / ``count>X:`` (how many are
below or above X). Under one, ``*`` stands for every item of a list
or object (every row or column of a markdown table) and a ``field=value`` record filter may match
several records; a key holding ``*`` is a pattern (``adakv+obcache_*``, ``[ab]*``) over an
object's keys or a table's first cells and headers, and ``!`` leaves a pattern out
(``*@*!h2o*``: every arm but h2o's). With a ratio or difference the two sides
pair up by what each ``*`` matched and the aggregate takes the paired results:
``median:a.json#arms|*|kl::b.json#arms|*|kl`` is the median of the arm-for-arm ratios (a side
with no ``*`` pairs with every item of the other).

    .venv/bin/python scripts/figures.py --check    # every figure equals its source (exit 1 if not)
    .venv/bin/python scripts/figures.py --write    # rewrite every figure from its source

``--write`` is what a rerun benchmark needs: the pages follow the new results. The suite runs
``--check`` (``tests/unit/test_docs.py``).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import operator
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The number, then its annotation (which may wrap over lines inside the comment). A sign right
# after a digit or another annotation is a range's dash ("1.0-2.5"), not the number's.
FIGURE = re.compile(r"(?P<num>(?:(?<![\d>])[-+])?\d[\d,]*(?:\.\d+)?)"
                    r"<!--fig\s+(?P<path>\S+)\s+(?P<keys>\S+)"
                    r"\s+(?P<spec>\S+)(?:\s+x(?P<scale>[\d.]+))?\s*-->")  # fmt: skip


NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def _holds(record, key: str) -> bool:
    """Whether the dict ``record`` matches every ``field=value`` of ``key``."""
    for cond in key.split("&"):
        field, _, want = cond.partition("=")
        have = record
        for part in [field] if isinstance(record, dict) and field in record else field.split("."):
            if not isinstance(have, dict) or part not in have:
                return False
            have = have[part]
        if want in (str(have), json.dumps(have)):
            continue
        if isinstance(have, int | float) and not isinstance(have, bool):
            try:
                if float(want) == have:
                    continue
            except ValueError:
                pass
        return False
    return True


def _item(value, key: str):
    if isinstance(value, list) and "=" in key:
        hits = [r for r in value if _holds(r, key)]
        if len(hits) != 1:
            raise KeyError(f"{key} matches {len(hits)} records, not one")
        return hits[0]
    if isinstance(value, list):
        return value[int(key)]
    if key not in value:  # "_" for a space: "stock,_small_pool"
        key = next((k for k in value if k.replace(" ", "_") == key), key)
    return value[key]


def md_tables(text: str) -> list[list[list[str]]]:
    """The tables of a markdown file: rows of cells, the header first, the rule left out."""
    tables, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.lstrip().startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(cells)
        elif rows:
            tables.append(rows)
            rows = []
    return tables


def _pick(labels: list[str], key: str) -> int:
    hits = [i for i, label in enumerate(labels) if label.replace(" ", "_") == key]
    if len(hits) == 1:
        return hits[0]
    if not hits and key.isdigit():
        return int(key)
    raise KeyError(f"{key} matches {len(hits)} rows or columns, not one")


AGGREGATES = {
    "min": min,
    "max": max,
    "median": statistics.median,
    "mean": statistics.fmean,
    "sum": sum,
    "count": len,
}


OPERATORS = {"::": operator.truediv, ":-:": operator.sub}


def _load(root: Path, path: str, cache: dict):
    if path not in cache:
        text = (root / path).read_text()
        cache[path] = md_tables(text) if path.endswith((".md", ".txt")) else json.loads(text)
    return cache[path]


def _number(value, where: str) -> int | float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{where}: {value!r} is not a number")
    return value


def _expand(value, keys: list[str], label: tuple = ()):
    """``(label, item)`` for every item ``keys`` reach from ``value``; ``label`` holds what
    each ``*`` matched, so two sides of a ratio can pair up item for item."""
    if not keys:
        yield label, value
        return
    key, rest = keys[0], keys[1:]
    if "*" in key:  # every item, or every key or record name the pattern matches
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if _fits(str(k), key):
                yield from _expand(v, rest, (*label, k))
    elif isinstance(value, list) and "=" in key:
        hits = [(i, r) for i, r in enumerate(value) if _holds(r, key)]
        if not hits:
            raise KeyError(f"{key} matches no record")
        for i, r in hits:
            yield from _expand(r, rest, (*label, i) if len(hits) > 1 else label)
    else:
        yield from _expand(_item(value, key), rest, label)


def _fits(name: str, pattern: str) -> bool:
    """Whether ``name`` fits ``pattern``: an fnmatch pattern, then ``!pattern`` for each kind
    to leave out (``*@*!h2o*!full``: every arm but h2o's and the full cache). ``!`` rather than
    fnmatch's ``[!h]``, which the site's markdown would read as a link reference."""
    want, *without = pattern.split("!")
    return fnmatch.fnmatchcase(name, want) and not any(
        fnmatch.fnmatchcase(name, w) for w in without)


def _matching(labels: list[str], key: str) -> list[int]:
    """The indices ``key`` picks: one label, or every label its ``*`` pattern matches."""
    if "*" not in key:
        return [_pick(labels, key)]
    hits = [i for i, lab in enumerate(labels) if _fits(lab.replace(" ", "_"), key)]
    if not hits:
        raise KeyError(f"{key} matches no row or column")
    return hits


def _md_values(tables: list, keys: str):
    """``(label, number)`` for ``TABLE|ROW|COLUMN[|N]``, where ROW or COLUMN may be ``*``."""
    table, row, col, *nth = keys.split("|")
    header, *body = tables[int(table)]
    rows = _matching([r[0] for r in body], row)
    cols = _matching(header, col)
    for r in rows:
        for c in cols:
            numbers = NUMBER.findall(body[r][c])
            if not numbers and "*" in row + col:
                continue  # a label column, or a cell with no figure: not one of the items
            number = numbers[int(nth[0]) if nth else 0].replace(",", "")
            label = (body[r][0],) * ("*" in row) + (header[c],) * ("*" in col)
            yield label, float(number) if "." in number else int(number)


def _values(root: Path, path: str, keys: str, cache: dict) -> list[tuple[tuple, int | float]]:
    """Every ``(label, value)`` one side of an expression names (numbers, unless counted)."""
    if "#" in keys:  # another file: results/other.json#KEYS
        path, keys = keys.split("#", 1)
    data = _load(root, path, cache)
    if path.endswith((".md", ".txt")):
        return list(_md_values(data, keys))
    out = list(_expand(data, keys.split("|")))
    if not out:
        raise KeyError(f"{path} {keys} names no number")
    return out


def _combine(left: list, right: list, op) -> list[tuple[tuple, float]]:
    left = [(lab, _number(v, "a ratio's or difference's side")) for lab, v in left]
    right = [(lab, _number(v, "a ratio's or difference's side")) for lab, v in right]
    if len(right) == 1 and not right[0][0]:
        return [(lab, op(v, right[0][1])) for lab, v in left]
    if len(left) == 1 and not left[0][0]:
        return [(lab, op(left[0][1], v)) for lab, v in right]
    by_label = dict(right)
    if set(by_label) != {lab for lab, _ in left}:
        raise KeyError("the two sides do not match item for item")
    return [(lab, op(v, by_label[lab])) for lab, v in left]


def source_value(root: Path, path: str, keys: str, cache: dict) -> int | float:
    """The number ``keys`` names in the results file ``path`` (relative to ``root``)."""
    keys = keys.replace("\\|", "|")  # "\|" inside a markdown table row, where "|" splits cells
    agg, sep, rest = keys.partition(":")
    below = re.fullmatch(r"count([<>])(-?[\d.]+)", agg) if sep else None
    if sep and (agg in AGGREGATES or below):
        keys = rest
    else:
        agg = None
    op = next((o for o in OPERATORS if o in keys), None)
    if op:  # a ratio or a difference, item for item
        top, bottom = keys.split(op)
        items = _combine(_values(root, path, top, cache), _values(root, path, bottom, cache),
                         OPERATORS[op])  # fmt: skip
    else:
        items = _values(root, path, keys, cache)
    if agg == "count":  # how many items: a panel's queries, not only numbers
        return len(items)
    numbers = [_number(v, f"{path} {keys}") for _, v in items]
    if below:  # count<0: how many of the numbers are below 0 ("24 of 24 intervals below zero")
        bound = float(below[2])
        return sum(1 for v in numbers if (v < bound if below[1] == "<" else v > bound))
    if agg:
        return AGGREGATES[agg](numbers)
    if len(numbers) != 1:
        raise KeyError(f"{path} {keys} names {len(numbers)} numbers: give an aggregate (min:, ...)")
    return numbers[0]


def rendered(value: int | float, spec: str, scale: str | None) -> str:
    return format(value * float(scale) if scale else value, spec)


def figures(text: str, root: Path = ROOT, cache: dict | None = None):
    """``(match, expected text)`` for every annotated figure of ``text``."""
    cache = {} if cache is None else cache
    for m in FIGURE.finditer(text):
        value = source_value(root, m["path"], m["keys"], cache)
        yield m, rendered(value, m["spec"], m["scale"])


def rewrite(text: str, root: Path = ROOT) -> str:
    """``text`` with every annotated figure written from its source."""
    cache: dict = {}

    def one(m: re.Match) -> str:
        value = source_value(root, m["path"], m["keys"], cache)
        return rendered(value, m["spec"], m["scale"]) + m.group(0)[len(m["num"]) :]

    return FIGURE.sub(one, text)


def pages(root: Path = ROOT) -> list[Path]:
    return sorted([*(root / "docs").rglob("*.md"), root / "README.md"])


def check(root: Path = ROOT) -> list[str]:
    """One line per figure that differs from its source or whose source cannot be read."""
    bad, cache = [], {}
    for page in pages(root):
        text = page.read_text()
        try:
            for m, expected in figures(text, root, cache):
                if m["num"] != expected:
                    line = text.count("\n", 0, m.start()) + 1
                    bad.append(f"{page.relative_to(root)}:{line}: {m['num']} but {m['path']} "
                               f"{m['keys']} gives {expected}")  # fmt: skip
        except (OSError, KeyError, IndexError, ValueError, ZeroDivisionError) as exc:
            bad.append(f"{page.relative_to(root)}: {type(exc).__name__}: {exc}")
    return bad


def count(root: Path = ROOT) -> int:
    return sum(len(FIGURE.findall(p.read_text())) for p in pages(root))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--write", action="store_true")
    args = ap.parse_args()
    if args.write:
        for page in pages():
            text = page.read_text()
            new = rewrite(text)
            if new != text:
                page.write_text(new)
                print(f"updated {page.relative_to(ROOT)}")
        return 0
    bad = check()
    print("\n".join(bad) or f"{count()} figures match their sources")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
