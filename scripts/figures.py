"""Figures on the documentation pages, tied to the results file they come from.

A figure quoted on a page is followed by a marker, a short HTML comment holding an id, and its
source (the definition) sits in one ``<!--figs`` comment block at the end of the paragraph,
list item or table::

    The top-20 estimate recovers 91<!--f1--> % of the KL, at 1.8<!--f2-->x the throughput.
    <!--figs
    f1: results/fidelity-topk/fidelity.json topk_check|ratio .0f x100
    f2: results/loadtest/compare/compare.json rows|metric=request_throughput|ratio_to_first|mix .1f
    -->

Neither the site nor GitHub shows a comment (``docs/hooks.py`` also strips markers and blocks
before the site renders a page), and read raw (an editor, a diff, GitHub's source view) the
sentence stays a sentence: the source's 50 to 150 characters sit under the prose, not inside
it. The marker follows the figure's last character with nothing between, so which number it
belongs to is never in doubt. The rules:

* an id is ``f`` and a number, unique in its file (``--convert`` numbers a page's figures in
  its order; a new figure takes any unused number);
* a block opens with a line ``<!--figs`` and closes with a line ``-->``; each line between is
  ``ID: PATH KEYS SPEC [xN]``; the block is indented like the text it closes (in a list item to
  the item's text, in an admonition by its four spaces);
* after a paragraph or a list item the block follows the last line with no blank line between
  (inside the item, so a list stays one list); after a table it follows a blank line (a
  comment line in or right under a table would become one of its rows). A table's definitions
  are outside its rows, so their KEYS are written plainly, ``|`` and all;
* every marker has one definition in its file and every definition one marker: ``--check``
  reports a marker without a definition, a definition without a marker, an id defined or
  marked twice, an unreadable definition line and a marker that follows no number;
* markers and blocks inside code (fenced blocks, inline code) are examples, not figures.

Why not another syntax: a footnote (``1.8[^f1]x``) or an attribute list renders on the site or
on GitHub; one block per page would put a source far from its figure, where whoever edits the
paragraph does not see it. A plain HTML comment is invisible everywhere with no tooling, and a
block per paragraph keeps each source next to its figure.

The older inline form, the whole source in the comment after the figure
(``91<!--fig results/fidelity-topk/fidelity.json topk_check|ratio .0f x100--> %``), is still
read, so a page mid-edit checks, and ``--convert`` rewrites it into markers and blocks (the
figures and the prose unchanged; running it again changes nothing). Inside a table row that
form has to write each ``|`` of KEYS as ``\\|``, or the row splits there; a definition may too.

``PATH`` is a JSON file under ``results/`` (or a generated one such as
``deploy/grafana/obcache.json``), ``KEYS`` the ``|``-separated keys and list indices
down to the number (arm names may hold dots and slashes, so neither separates), ``SPEC`` a
Python format spec for the number (``.3f``, ``,.0f``, ``+.3f``), and an optional ``xN`` scales
it first (``x100`` for a percentage). The figure is the number written just before the marker.

In a list of records a key ``field=value&field=value`` picks the one record whose fields hold
those values (``results/eval/results.json method=tova/attn/shared&budget=0.2|accuracy``); it
must match exactly one (``summary.arm=stock`` looks inside a record's ``summary``). A ``.md``
results file (or a ``.txt`` one holding markdown tables) is addressed as ``TABLE|ROW|COLUMN[|N]``:
the table's index in the file, the row by its first cell and the column by its header (or either
by a 0-based index; ``_`` stands for a space), and the N-th number in that cell (first if left
out), so ``results/bench/long_prefill.md 0|stock|prefill_s .2f``. In a JSON object too ``_``
stands for a space in a key the file spells with one. ``KEYS::KEYS`` is the ratio of two
numbers (``1.97x`` from two throughputs) and ``KEYS:-:KEYS`` their difference; either side may
name another file as ``results/other.json#KEYS``.

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
    .venv/bin/python scripts/figures.py --convert docs/evidence/accuracy.md  # inline form -> blocks

``--write`` is what a rerun benchmark needs: the pages follow the new results. ``--convert``
with no file converts every page (``docs/`` and ``README.md``). The suite runs ``--check``
(``tests/unit/test_docs.py``).
"""

from __future__ import annotations

import argparse
import bisect
import fnmatch
import json
import operator
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A figure: a sign right after a digit or another annotation is a range's dash ("1.0-2.5"),
# not the number's.
NUM = r"(?:(?<![\d>])[-+])?\d[\d,]*(?:\.\d+)?"
# The older inline form: the number, then its whole source (which may wrap over lines).
FIGURE = re.compile(rf"(?P<num>{NUM})"
                    r"<!--fig\s+(?P<path>\S+)\s+(?P<keys>\S+)"
                    r"\s+(?P<spec>\S+)(?:\s+x(?P<scale>[\d.]+))?\s*-->")  # fmt: skip
# A marker, right after its number (a marker after no number is an error, so it is optional).
MARKER = re.compile(rf"(?P<num>{NUM})?<!--(?P<id>f\d+)-->")
# A block of definitions: whole lines, from "<!--figs" to the first "-->".
BLOCK = re.compile(r"^[ \t]*<!--figs[ \t]*\n(?P<body>.*?)-->[ \t]*(?:\n|\Z)", re.M | re.S)
DEFINITION = re.compile(r"(?P<id>f\d+):\s+(?P<path>\S+)\s+(?P<keys>\S+)\s+(?P<spec>\S+)"
                        r"(?:\s+x(?P<scale>[\d.]+))?")  # fmt: skip
# Code, where annotations are examples: fenced blocks, then inline code within one paragraph.
FENCE = re.compile(r"^([ \t]*)(```|~~~).*?^\1\2[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(?:(?!\n[ \t]*\n).)+?(?<!`)\1(?!`)", re.S)


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


class Figure:
    """One annotated figure: its number (``None`` for a marker after no number) at
    ``text[start:end]``, its source, and its marker's id (``None`` in the inline form)."""

    def __init__(self, num, start, end, path, keys, spec, scale, id=None):  # noqa: A002
        self.num, self.start, self.end, self.id = num, start, end, id
        self.path, self.keys, self.spec, self.scale = path, keys, spec, scale

    def __getitem__(self, name: str):  # fig["num"], as for a match of the inline form
        return getattr(self, name)

    def __repr__(self) -> str:
        return f"Figure({self.num!r} {self.id or ''} {self.path} {self.keys} {self.spec})"


def _code(text: str) -> list[tuple[int, int]]:
    """The ``(start, end)`` spans of ``text`` that are code: fenced blocks and inline code."""
    spans = [m.span() for m in FENCE.finditer(text)]
    rest = FENCE.sub(lambda m: "\0" * len(m.group(0)), text)  # offsets kept, fences hidden
    return sorted(spans + [m.span() for m in CODE_SPAN.finditer(rest)])


def _outside(spans: list[tuple[int, int]]):
    """A filter: whether a match starts outside every span."""
    return lambda m: not any(a <= m.start() < b for a, b in spans)


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def parse(text: str) -> tuple[list[Figure], list[tuple[int, str]]]:
    """The annotated figures of ``text`` in page order (both forms), and ``(line, problem)``
    for every marker, definition or comment that does not make a figure."""
    outside = _outside(_code(text))
    found: list[Figure] = []
    errors: list[tuple[int, str]] = []
    for m in filter(outside, FIGURE.finditer(text)):
        found.append(Figure(m["num"], m.start("num"), m.end("num"), m["path"], m["keys"],
                            m["spec"], m["scale"]))  # fmt: skip
    defined: dict[str, tuple[int, re.Match]] = {}
    blocks = list(filter(outside, BLOCK.finditer(text)))
    for block in blocks:
        first = _line(text, block.start()) + 1
        for n, raw in enumerate(block["body"].split("\n"), start=first):
            line = raw.strip(" \t>")
            if not line:
                continue
            d = DEFINITION.fullmatch(line)
            if d is None:
                errors.append((n, f"not a definition (ID: PATH KEYS SPEC [xN]): {line}"))
            elif d["id"] in defined:
                errors.append((n, f"{d['id']} is defined twice (also line {defined[d['id']][0]})"))
            else:
                defined[d["id"]] = (n, d)
    marked: dict[str, int] = {}
    for m in filter(outside, MARKER.finditer(text)):
        n = _line(text, m.start())
        d = defined.get(m["id"])
        if m["id"] in marked:
            errors.append((n, f"{m['id']} marks two figures (also line {marked[m['id']]})"))
        elif m["num"] is None:
            errors.append((n, f"marker {m['id']} follows no number"))
        elif d is None:
            errors.append((n, f"marker {m['id']} has no definition in a <!--figs block"))
        else:
            d = d[1]
            found.append(Figure(m["num"], m.start("num"), m.end("num"), d["path"], d["keys"],
                                d["spec"], d["scale"], m["id"]))  # fmt: skip
        marked.setdefault(m["id"], n)
    errors += [(n, f"definition {i} marks no figure") for i, (n, _) in defined.items()
               if i not in marked]  # fmt: skip
    # A comment that starts like an annotation but is not one (a typo) is not silently skipped.
    taken = [m.span() for m in FIGURE.finditer(text)] + [m.span() for m in blocks]
    for m in filter(outside, re.finditer(r"<!--fig", text)):
        if not any(a <= m.start() < b for a, b in taken):
            errors.append((_line(text, m.start()), "unreadable annotation: "
                           + text[m.start() : m.start() + 60].split("\n")[0]))  # fmt: skip
    found.sort(key=lambda f: f.start)
    return found, sorted(errors)


def _parsed(text: str) -> list[Figure]:
    found, errors = parse(text)
    if errors:
        raise ValueError("; ".join(f"line {n}: {msg}" for n, msg in errors))
    return found


def figures(text: str, root: Path = ROOT, cache: dict | None = None):
    """``(figure, expected text)`` for every annotated figure of ``text`` (ValueError when a
    marker or a definition is missing)."""
    cache = {} if cache is None else cache
    for fig in _parsed(text):
        yield fig, rendered(source_value(root, fig.path, fig.keys, cache), fig.spec, fig.scale)


def rewrite(text: str, root: Path = ROOT) -> str:
    """``text`` with every annotated figure written from its source."""
    out, at = [], 0
    for fig, expected in figures(text, root):
        out += [text[at : fig.start], expected]
        at = fig.end
    return "".join(out) + text[at:]


def strip(text: str) -> str:
    """``text`` without its annotations (the figures stay): the page as a reader sees it.
    ``docs/hooks.py`` renders the site from this; code keeps its examples."""
    for pattern, keep in ((FIGURE, lambda m: m["num"]), (BLOCK, lambda m: ""),
                          (MARKER, lambda m: m["num"] or "")):  # fmt: skip
        outside = _outside(_code(text))
        text = pattern.sub(lambda m, keep=keep, outside=outside:
                           keep(m) if outside(m) else m.group(0), text)  # fmt: skip
    return text


LIST_ITEM = re.compile(r"[ \t]*(?:[-*+]|\d+[.)])[ \t]+(?=\S)")
ONE_LINE = re.compile(r"[ \t]*(?:#{1,6}[ \t]|!!!|\?\?\?|===[ \t])")  # heading, admonition, tab


class _Segment:
    """Lines ``first..last`` of a page: a paragraph, a list item, a table, a block of
    definitions, or one line (a heading, an admonition's title); ``indent``: where its text
    starts, so a block of definitions placed after it stays inside it."""

    def __init__(self, kind: str, first: int, last: int, indent: str):
        self.kind, self.first, self.last, self.indent = kind, first, last, indent


def _segments(lines: list[str]) -> list[_Segment]:
    segments: list[_Segment] = []
    cur: _Segment | None = None
    fence = block = None
    for i, line in enumerate(lines):
        s = line.strip()
        lead = line[: len(line) - len(line.lstrip())]
        if fence or block:  # inside a fenced code block or a block of definitions
            if fence and s.startswith(fence) or block and "-->" in line:
                if block:
                    block.last = i
                fence = block = None
            continue
        if s.startswith(("```", "~~~")):
            cur, fence = None, s[:3]
        elif not s:
            cur = None
        elif s.startswith("<!--figs"):
            cur, block = None, _Segment("figs", i, i, lead)
            segments.append(block)
        elif item := LIST_ITEM.match(line):
            cur = _Segment("item", i, i, " " * len(item.group(0).expandtabs(4)))
            segments.append(cur)
        elif s.startswith("|"):
            if cur is None or cur.kind != "table":
                cur = _Segment("table", i, i, lead)
                segments.append(cur)
            cur.last = i
        elif ONE_LINE.match(line):
            segments.append(_Segment("line", i, i, lead))
            cur = None
        elif cur is not None and cur.kind in ("paragraph", "item", "table"):
            cur.last = i  # a paragraph's next line (in a list item: also one not indented; right
            # under a table, a row of it for Python-Markdown and GitHub alike)
        else:
            cur = _Segment("paragraph", i, i, lead)
            segments.append(cur)
    return segments


def convert(text: str) -> str:
    """``text`` with every inline annotation turned into a marker and a definition in the
    block of its paragraph, list item or table (added, or the one already there). Figures and
    prose stay as they are; a page with nothing in the inline form comes back unchanged."""
    olds = list(filter(_outside(_code(text)), FIGURE.finditer(text)))
    if not olds:
        return text
    ids = re.findall(r"<!--f(\d+)-->|^[ \t>]*f(\d+):", text, re.M)  # the ids in use
    number = max((int(a or b) for a, b in ids), default=0)
    out, at, new = [], 0, []  # new: (offset of the marker in the result, definition)
    for m in olds:
        number += 1
        out.append(text[at : m.end("num")])
        keys = m["keys"].replace("\\|", "|")  # outside a table row "|" needs no escape
        scale = f" x{m['scale']}" if m["scale"] else ""
        new.append((sum(map(len, out)), f"f{number}: {m['path']} {keys} {m['spec']}{scale}"))
        out.append(f"<!--f{number}-->")
        at = m.end()
    text = "".join(out) + text[at:]
    lines = text.split("\n")
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line) + 1)
    segments = _segments(lines)
    by_line = {i: k for k, seg in enumerate(segments) for i in range(seg.first, seg.last + 1)}
    wanted: dict[int, list[str]] = {}  # segment index -> its new definitions
    for offset, definition in new:
        wanted.setdefault(by_line[bisect.bisect_right(starts, offset) - 1], []).append(definition)
    for k in sorted(wanted, reverse=True):  # from the end, so earlier line numbers hold
        seg, defs = segments[k], wanted[k]
        gap = 1 if seg.kind == "table" else 0
        after = segments[k + 1] if k + 1 < len(segments) else None
        joins = after and after.kind == "figs" and after.first == seg.last + 1 + gap
        if joins and not (gap and lines[seg.last + 1].strip()):
            lines[after.last : after.last] = [after.indent + d for d in defs]  # its "-->" line
            continue
        block = [seg.indent + "<!--figs", *(seg.indent + d for d in defs), seg.indent + "-->"]
        if gap:
            follows = seg.last + 1 < len(lines) and lines[seg.last + 1].strip()
            block = ["", *block, *([""] if follows else [])]
        lines[seg.last + 1 : seg.last + 1] = block
    return "\n".join(lines)


def pages(root: Path = ROOT) -> list[Path]:
    return sorted([*(root / "docs").rglob("*.md"), root / "README.md"])


def check(root: Path = ROOT) -> list[str]:
    """One line per figure that differs from its source or whose source cannot be read, and
    per marker or definition that has no counterpart."""
    bad, cache = [], {}
    for page in pages(root):
        text, name = page.read_text(), page.relative_to(root)
        found, errors = parse(text)
        bad += [f"{name}:{n}: {problem}" for n, problem in errors]
        for fig in found:
            if fig.num is None:
                continue
            where = f"{name}:{_line(text, fig.start)}"
            try:
                value = source_value(root, fig.path, fig.keys, cache)
            except (OSError, KeyError, IndexError, ValueError, ZeroDivisionError) as exc:
                bad.append(f"{where}: {type(exc).__name__}: {exc}")
                continue
            expected = rendered(value, fig.spec, fig.scale)
            if fig.num != expected:
                bad.append(f"{where}: {fig.num} but {fig.path} {fig.keys} gives {expected}")
    return bad


def count(root: Path = ROOT) -> int:
    return sum(len(parse(p.read_text())[0]) for p in pages(root))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--convert", nargs="*", metavar="FILE",
                      help="inline annotations to markers and blocks (no FILE: every page)")
    args = ap.parse_args()
    if args.check:
        bad = check()
        print("\n".join(bad) or f"{count()} figures match their sources")
        return 1 if bad else 0
    failed = False
    for page in [Path(f).resolve() for f in args.convert] if args.convert else pages():
        text = page.read_text()
        try:
            new = convert(text) if args.convert is not None else rewrite(text)
        except (OSError, KeyError, IndexError, ValueError, ZeroDivisionError) as exc:
            print(f"{page}: {type(exc).__name__}: {exc}")
            failed = True
            continue
        if new != text:
            page.write_text(new)
            print(f"{'converted' if args.convert is not None else 'updated'} {page}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
