"""Figures on the documentation pages, tied to the results file they come from.

A figure quoted on a page carries its source in an HTML comment right after it (invisible on
the site and on GitHub)::

    the top-20 estimate recovers 91<!--fig results/fidelity-topk/fidelity.json
    topk_check|ratio .0f x100--> % of the KL

``PATH`` is a JSON file under ``results/``, ``KEYS`` the ``|``-separated keys and list indices
down to the number (arm names may hold dots and slashes, so neither separates), ``SPEC`` a
Python format spec for the number (``.3f``, ``,.0f``, ``+.3f``), and an optional ``xN`` scales
it first (``x100`` for a percentage). The figure is the number written just before the comment.

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
# The number, then its annotation (which may wrap over lines inside the comment).
FIGURE = re.compile(r"(?P<num>[-+]?\d[\d,]*(?:\.\d+)?)<!--fig\s+(?P<path>\S+)\s+(?P<keys>\S+)"
                    r"\s+(?P<spec>\S+)(?:\s+x(?P<scale>[\d.]+))?\s*-->")  # fmt: skip


def source_value(root: Path, path: str, keys: str, cache: dict) -> int | float:
    """The number at ``keys`` in the JSON file ``path`` (relative to ``root``)."""
    if path not in cache:
        cache[path] = json.loads((root / path).read_text())
    value = cache[path]
    for key in keys.split("|"):
        value = value[int(key)] if isinstance(value, list) else value[key]
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
