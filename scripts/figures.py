"""Figures on the documentation pages, tied to the results file they come from.

A figure quoted on a page carries its source in an HTML comment right after it (invisible on
the site and on GitHub)::

    the top-20 estimate recovers 91<!--fig results/fidelity-topk/fidelity.json
    topk_check|ratio .0f x100--> % of the KL

``PATH`` is a JSON file under ``results/``, ``KEYS`` the ``|``-separated keys and list indices
down to the number (arm names may hold dots and slashes, so neither separates), ``SPEC`` a
Python format spec for the number (``.3f``, ``,.0f``, ``+.3f``), and an optional ``xN`` scales
it first (``x100`` for a percentage). The figure is the number written just before the comment.

In a list of records a key ``field=value&field=value`` picks the one record whose fields hold
those values (``results/eval/results.json method=tova/attn/shared&budget=0.2|accuracy``); it
must match exactly one (``summary.arm=stock`` looks inside a record's ``summary``). A ``.md``
results file is addressed as ``TABLE|ROW|COLUMN[|N]``: the
table's index in the file, the row by its first cell and the column by its header (or either
by a 0-based index; ``_`` stands for a space), and the N-th number in that cell (first if left
out), so ``results/bench/long_prefill.md 0|stock|prefill_s .2f``. In a JSON object too ``_``
stands for a space in a key the file spells with one. ``KEYS::KEYS`` is the ratio of two
numbers of the same file (``1.97x`` from two throughputs). In a markdown table row write each
``|`` of KEYS as ``\\|``, or the row splits there.

    .venv/bin/python scripts/figures.py --check    # every figure equals its source (exit 1 if not)
    .venv/bin/python scripts/figures.py --write    # rewrite every figure from its source

``--write`` is what a rerun benchmark needs: the pages follow the new results. The suite runs
``--check`` (``tests/unit/test_docs.py``).
"""

from __future__ import annotations

import argparse
import json
import re
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


def md_value(tables: list, keys: str) -> float:
    """The number at ``TABLE|ROW|COLUMN[|N]`` of a markdown file's tables."""
    table, row, col, *nth = keys.split("|")
    header, *body = tables[int(table)]
    cell = body[_pick([r[0] for r in body], row)][_pick(header, col)]
    number = NUMBER.findall(cell)[int(nth[0]) if nth else 0].replace(",", "")
    return float(number) if "." in number else int(number)


def source_value(root: Path, path: str, keys: str, cache: dict) -> int | float:
    """The number at ``keys`` in the results file ``path`` (relative to ``root``)."""
    keys = keys.replace("\\|", "|")  # "\|" inside a markdown table row, where "|" splits cells
    if "::" in keys:  # a ratio of two numbers of the same file
        top, bottom = keys.split("::")
        return source_value(root, path, top, cache) / source_value(root, path, bottom, cache)
    if path not in cache:
        text = (root / path).read_text()
        cache[path] = md_tables(text) if path.endswith(".md") else json.loads(text)
    if path.endswith(".md"):
        return md_value(cache[path], keys)
    value = cache[path]
    for key in keys.split("|"):
        value = _item(value, key)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{path} {keys}: {value!r} is not a number")
    return value


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
        except (OSError, KeyError, IndexError, ValueError) as exc:
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
