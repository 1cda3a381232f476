"""MkDocs hook: serve the files of ``results/`` that the pages link to, without copying them.

The pages link to the committed evidence by its real path from the page (for example
``../../results/ppl/ppl_vs_position.png`` from ``docs/evidence/perplexity.md``), so the links
also work when the Markdown is read on GitHub. ``results/`` is outside ``docs_dir``, so:

* ``on_files`` adds every ``results/...`` file that some page links to as a virtual file of the
  site (``results/...`` under the site root; nothing is written into ``docs/``), and
* ``on_page_markdown`` rewrites those links to that virtual location before MkDocs resolves and
  validates them (a missing file is still a broken link: ``mkdocs build --strict`` fails).

Tables are included with ``pymdownx.snippets`` (``--8<-- "results/..."``) and need no hook.

``on_page_markdown`` also strips the figures' source annotations (``scripts/figures.py``: the
``<!--f1-->`` markers, the ``<!--figs ...-->`` blocks of definitions, the older inline
``<!--fig ...-->``) before the page renders: the HTML carries none of them, and a block inside a
list item does not turn a tight list loose (Python-Markdown would make it a raw HTML block).
"""

from __future__ import annotations

import importlib.util
import posixpath
import re
from functools import cache
from pathlib import Path

from mkdocs.structure.files import File

LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")


def _root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


@cache
def _figures(root: Path):
    """``scripts/figures.py``, the one place that knows the annotations' syntax."""
    path = root / "scripts" / "figures.py"
    spec = importlib.util.spec_from_file_location("obcache_docs_figures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _results_target(root: Path, page_src: str, target: str) -> str | None:
    """The repository path ``results/...`` that ``target`` (relative to the page) names."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return None
    page_dir = posixpath.dirname(posixpath.join("docs", page_src))
    path = posixpath.normpath(posixpath.join(page_dir, target))
    return path if path.startswith("results/") else None


def on_files(files, config):
    root = _root(config)
    docs = Path(config.docs_dir)
    wanted: set[str] = set()
    for md in docs.rglob("*.md"):
        page_src = md.relative_to(docs).as_posix()
        for match in LINK.finditer(md.read_text(encoding="utf-8")):
            target = _results_target(root, page_src, match.group(2))
            if target and (root / target).is_file():
                wanted.add(target)
    for target in sorted(wanted):
        if files.get_file_from_path(target) is None:
            files.append(File.generated(config, target, abs_src_path=str(root / target)))
    return files


def on_page_markdown(markdown, page, config, files):
    root = _root(config)
    page_src = page.file.src_uri
    page_dir = posixpath.dirname(page_src)

    def rewrite(match: re.Match) -> str:
        target = _results_target(root, page_src, match.group(2))
        if target is None:
            return match.group(0)
        return match.group(1) + posixpath.relpath(target, page_dir or ".") + match.group(3)

    return LINK.sub(rewrite, _figures(root).strip(markdown))
