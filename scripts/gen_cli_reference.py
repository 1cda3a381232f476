"""Write docs/reference/cli.md from the command's own argument parsers.

    .venv/bin/python scripts/gen_cli_reference.py          # rewrite the page
    .venv/bin/python scripts/gen_cli_reference.py --check  # exit 1 if the page is stale

tests/unit/test_docs.py runs the check, so the page cannot drift from the code.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "cli.md"

HEADER = """# Command-line reference

Generated from the parsers of `obcache-vllm` by `scripts/gen_cli_reference.py` (a docs test
fails when this page and the code disagree). Every command: `obcache-vllm <command> --help`.

`obcache-vllm serve` passes its arguments to vLLM's own `vllm serve` (`obcache-vllm serve
--help` prints vLLM's options) after these defaults, which any argument overrides:
`{serve_defaults}`; it also takes the server policy's flags, `--default-kv-<name> VALUE` for
any of {fields} and `--default-min-prompt-tokens N` (see [The server](../user_guide/server.md)).
"""


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps no public list of subcommands
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def render() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: a fixed width here
    from obcache_vllm import cli, config
    from obcache_vllm.evidence import perplexity

    parser = cli._parser()
    sections = [("obcache-vllm", parser)]
    for name, sub in _subparsers(parser).items():
        if name == "serve":
            continue  # vLLM's parser: described in the header
        if name == "ppl":
            sections.append(("obcache-vllm ppl", perplexity._parser()))
            continue
        sections.append((f"obcache-vllm {name}", sub))
        for child, subsub in _subparsers(sub).items():
            sections.append((f"obcache-vllm {name} {child}", subsub))
    names = [f.removeprefix("kv_").replace("_", "-") for f in config.BUILTIN_DEFAULTS
             if f not in config.PER_REQUEST_ONLY]  # fmt: skip
    fields = ", ".join(f"`{n}`" for n in names)
    out = [HEADER.format(serve_defaults=" ".join(cli.SERVE_DEFAULT_ARGS), fields=fields)]
    for title, sub in sections:
        sub.prog = title
        out.append(f"## `{title}`\n\n```text\n{sub.format_help().rstrip()}\n```\n")
    return "\n".join(out)


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run scripts/gen_cli_reference.py")
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(PAGE.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
