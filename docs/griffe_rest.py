"""Griffe extension for the API pages: render the package's reST-flavoured docstrings as Markdown.

The docstrings are prose with a few reStructuredText constructs that Markdown does not know:

* roles (``:class:`KvOptions```, ``:func:`~obcache_vllm.vllm_ext.install.install```): shown
  as code (``~`` keeps the last component only, as Sphinx does);
* literal blocks introduced by a trailing ``::``: the ``::`` becomes ``:`` (the indented block
  after it is already a Markdown code block);
* simple tables (``====  ====`` borders): kept as they are (minus their inline-literal
  marks), inside a fenced block.

Only the copy of each docstring that the docs render is changed; the source is not touched.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(
    r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const|type):`(~?)([^`]+)`", re.S
)
BORDER = re.compile(r"^\s*=+(?:\s+=+)+\s*$")


def _role(match: re.Match) -> str:
    target = re.sub(r"\s+", "", match.group(2))
    if match.group(1):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def _fence_tables(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        if not BORDER.match(lines[i]):
            out.append(lines[i])
            i += 1
            continue
        borders = [j for j in range(i, len(lines)) if BORDER.match(lines[j])][:3]
        end = borders[-1]
        indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
        out.append(indent + "```text")
        out.extend(line.replace("``", "") for line in lines[i : end + 1])
        out.append(indent + "```")
        i = end + 1
    return out


def rest_to_markdown(text: str) -> str:
    """The Markdown the API pages render for one docstring."""
    text = ROLE.sub(_role, text)
    lines = []
    for line in text.splitlines():
        if line.rstrip().endswith("::"):
            stripped = line.rstrip()[:-2].rstrip()
            line = stripped + ":" if stripped else ""
        lines.append(line)
    return "\n".join(_fence_tables(lines))


class RestDocstrings(griffe.Extension):
    """Rewrite every loaded object's docstring with :func:`rest_to_markdown`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rest_to_markdown(obj.docstring.value)
