"""Write the reference pages from the code: docs/reference/cli.md (the command's argument
parsers), docs/reference/_options.md (the options table, a snippet of the user guide),
docs/reference/_seams.md (the seam registry, a snippet of the contributing guide),
docs/reference/_refusal_matrix.md (which pairs of options a request may combine) and
docs/reference/rest.md (the kv_* request fields of ``obcache_vllm.options``, their
built-in and shipped defaults, the ``usage.obcache`` keys of
``obcache_vllm.eviction.ledger.USAGE_FIELDS``, the config endpoint), and the block of
``obcache_vllm/options.py`` that declares ``KvRequest``'s and ``KvOptions``' fields for
readers and type checkers.

    .venv/bin/python scripts/gen_reference.py          # rewrite the pages
    .venv/bin/python scripts/gen_reference.py --check  # exit 1 if a page is stale

tests/unit/test_docs.py runs the check, so the pages cannot drift from the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = {name: ROOT / "docs" / "reference" / f"{name}.md"
         for name in ("cli", "rest", "_options", "_seams", "_refusal_matrix")}  # fmt: skip

HEADER = """# Command-line reference

Generated from the parsers of `obcache-vllm` by `scripts/gen_reference.py` (a docs test
fails when this page and the code disagree). Every command: `obcache-vllm <command> --help`.

`obcache-vllm serve` passes its arguments to vLLM's own `vllm serve` (`obcache-vllm serve
--help` prints vLLM's options) after these defaults, which any argument overrides:
`{serve_defaults}`; it also takes the server policy's flags, `--default-kv-<name> VALUE` for
any of {fields}, `--default-min-prompt-tokens N` and `--default-compress-at auto|null` (see
[The server](../user_guide/server.md)).
"""


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps no public list of subcommands
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def render_cli() -> str:
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


REST_HEADER = """# REST extension reference

Generated from the code by `scripts/gen_reference.py` (a docs test fails when this page and the
code disagree). The server is vLLM's OpenAI-compatible server; obcache-vllm adds request fields,
a usage field and one endpoint. The semantics in depth: [KV options](../user_guide/options.md),
[The KV outcome](../user_guide/usage.md), [The server](../user_guide/server.md).

## Request fields

On `/v1/completions` and `/v1/chat/completions`, as top-level JSON fields (`extra_body` in the
`openai` client) or inside `vllm_xargs` (top-level wins); offline, in `SamplingParams.extra_args`.
A request without `kv_budget` (and no server default budget) is served by stock vLLM. A bad
value is an HTTP 400 naming the field. "built-in": the option's own default (the offline
engine); "server": the shipped server default (`obcache_vllm/default.yaml`), which
`OBCACHE_VLLM_CONFIG`, `OBCACHE_KV_<NAME>` and `--default-kv-<name>` change.

"""


def _option_rows() -> dict[str, str]:
    """field -> meaning, from the options' table (``obcache_vllm.options.OPTIONS``)."""
    from obcache_vllm import options

    return {spec.field: spec.doc for spec in options.OPTIONS}


def _json(value) -> str:
    import json

    return "-" if value is None else f"`{json.dumps(value)}`"


OPTIONS_HEADER = """| field | meaning | built-in | server |
| --- | --- | --- | --- |
"""


def render_options() -> str:
    """The options table, one row per ``obcache_vllm.options.OPTIONS`` row: in the REST
    reference and, as the snippet docs/reference/_options.md, in the user guide's options page."""
    from obcache_vllm import config, options

    rows = _option_rows()
    shipped = config.load_defaults({})
    out = [OPTIONS_HEADER]
    for field in options.FIELDS:
        meaning = rows[field].replace("|", "\\|")
        builtin = config.BUILTIN_DEFAULTS[field]
        out.append(f"| `{field}` | {meaning} | {_json(builtin)} | {_json(shipped[field])} |\n")
    return "".join(out)


def render_rest() -> str:
    from obcache_vllm import config
    from obcache_vllm.eviction.ledger import KEPT_RULE, USAGE_FIELDS

    out = [REST_HEADER, render_options()]
    out.append(
        "\n## `usage.obcache`\n\nEvery budgeted response's `usage` carries `obcache` (in the "
        "final chunk of a stream with `stream_options.include_usage`); offline, "
        "`RequestOutput.kv_transfer_params[\"obcache\"]`. Keys:\n\n| key | meaning |\n"
        "| --- | --- |\n"
    )
    for key, meaning in USAGE_FIELDS.items():
        out.append(f"| `{key}` | {meaning.replace('|', chr(92) + '|')} |\n")
    out.append(f"\n{KEPT_RULE[0]}\n\n" + "".join(f"- {item}\n" for item in KEPT_RULE[1:]))
    out.append(render_usage_examples())
    out.append(
        "\n## `GET /v1/obcache/config`\n\nThe server's scorers, pipelines, request fields, "
        "active defaults and policy (`config_document()` in "
        "`obcache_vllm/vllm_ext/frontend/server.py`): keys `scorers`, `pipelines`, "
        "`request_fields`, `defaults`, `policy` (`default_budget`, `when`, "
        f"`{config.MIN_PROMPT_KEY}`, `{config.COMPRESS_AT_KEY}`, `{config.QUERY_AGNOSTIC_KEY}`, "
        "`model`: the served model's name, whose own selection `defaults` holds where "
        "`default.yaml`'s `models` has one, `opt_out`), `usage_field`.\n"
    )
    return "".join(out)


def render_usage_examples() -> str:
    """One ``usage.obcache`` per mode, as the engine reported it (results/usage/examples.json,
    compared with the engine by tests/engine/test_outcome.py)."""
    path = ROOT / "results" / "usage" / "examples.json"
    examples = json.loads(path.read_text())
    titles = {"fixed": "A fixed budget", "short": "A prompt shorter than its budget",
              "target": "An error target", "compress_at": "`kv_compress_at`",
              "adakv": "`kv_pipeline: adakv`"}  # fmt: skip
    n = next(iter(examples.values()))["prompt_tokens"]
    out = [f"\n### Examples\n\nThe same {n}-token prompt in each mode, on the offline `LLM` "
           "with the built-in defaults (`results/usage/examples.json`, which "
           "`tests/engine/test_outcome.py` compares with the engine's replies):\n"]  # fmt: skip
    for name, example in examples.items():
        fields = json.dumps(example["request"])
        out.append(f"\n{titles.get(name, name)}, `{fields[1:-1]}`:\n\n```json\n"
                   f"{json.dumps(example['obcache'])}\n```\n")  # fmt: skip
    return "".join(out)


def render_seams() -> str:
    """The seam registry (``obcache_vllm.vllm_ext.seams.REGISTRY``) as a table: the snippet
    docs/reference/_seams.md of the contributing guide's seams page."""
    from obcache_vllm.vllm_ext import seams

    out = ["| vLLM name | how | process | backend | parameters pinned | installed | why |\n",
           "| --- | --- | --- | --- | --- | --- | --- |\n"]
    for row in seams.REGISTRY:
        params = "" if row.params is None else ", ".join(row.params) or "(none)"
        if row.attrs:
            params = "attributes: " + ", ".join(row.attrs)
        installed = f"`{row.install}`" if row.install else ""
        cells = [f"`{row.module}:{row.qualname}`", row.how, row.process, row.backend, params,
                 installed, row.why]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |\n")
    return "".join(out)


# The option pairs of the refusal matrix: each pipeline, and each option that changes when or
# how often a request evicts or what it reuses, with a value that turns it on.
MATRIX_PIPELINES = ("snapkv", "tova", "h2o", "streaming", "adakv")
MATRIX_OPTIONS = {
    "kv_decode": {"kv_decode": True},
    "kv_prefill_evict": {"kv_prefill_evict": True},
    "kv_compress_at": {"kv_compress_at": 600},
    'kv_compress_at: "auto"': {"kv_compress_at": "auto"},
    "kv_session": {"kv_session": True},
    'kv_when: "pressure"': {"kv_when": "pressure"},
    "error target": {"kv_budget": {"max_error": 0.01}},
}


def refusal_matrix() -> dict[tuple[str, str], str | None]:
    """Every pair of :data:`MATRIX_PIPELINES` x :data:`MATRIX_OPTIONS` and of two options, on a
    1,000-token prompt with ``kv_budget: 128`` (and ``kv_scorer: attn``, which every pipeline
    and an error target take): None where a request may combine them, else the field its 400
    names."""
    from obcache_vllm.admission import parse_kv_options
    from obcache_vllm.options import KvOptionsError

    names = list(MATRIX_OPTIONS)
    pairs = [(f"kv_pipeline: {p}", o) for p in MATRIX_PIPELINES for o in names]
    pairs += [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
              if not (a.startswith("kv_compress_at") and b.startswith("kv_compress_at"))]
    out: dict[tuple[str, str], str | None] = {}
    for a, b in pairs:
        fields = {"kv_budget": 128, "kv_scorer": "attn"}
        for name in (a, b):
            if name.startswith("kv_pipeline: "):
                fields["kv_pipeline"] = name.removeprefix("kv_pipeline: ")
            else:
                fields.update(MATRIX_OPTIONS[name])
        try:
            parse_kv_options(fields, 1000)
            out[(a, b)] = None
        except KvOptionsError as exc:
            out[(a, b)] = exc.field
    return out


def render_refusal_matrix() -> str:
    """The refusal matrix as a table (rows: pipelines and options; columns: options), and how
    many pairs are refused: the snippet docs/reference/_refusal_matrix.md."""
    cells = refusal_matrix()
    names = list(MATRIX_OPTIONS)
    rows = [f"kv_pipeline: {p}" for p in MATRIX_PIPELINES] + names[:-1]
    refused = sum(v is not None for v in cells.values())
    out = [f"{refused} of {len(cells)} pairs refused (✓: served together; otherwise the field "
           "the 400 names).\n\n",
           "| | " + " | ".join(f"`{n}`" for n in names) + " |\n",
           "| --- |" + " --- |" * len(names) + "\n"]  # fmt: skip
    for row in rows:
        line = [f"`{row}`"]
        for col in names:
            cell = cells.get((row, col))
            line.append(("✓" if cell is None else f"`{cell}`") if (row, col) in cells else "")
        out.append("| " + " | ".join(line) + " |\n")
    return "".join(out)


# The block of obcache_vllm/options.py that declares KvRequest's and KvOptions' fields for
# readers and type checkers (at run time both classes are built from the options' table).
OPTIONS_SOURCE = ROOT / "obcache_vllm" / "options.py"
BEGIN = "# -- generated by scripts/gen_reference.py from OPTIONS: do not edit " + "-" * 27 + "\n"
END = "# -- end of the generated block " + "-" * 64 + "\n"


def _annotation(types: tuple[type, ...]) -> str:
    return " | ".join("None" if t is type(None) else t.__name__ for t in types)


_TYPE_DOCS = {
    "KvRequest": "What one request asked for, every kv_* field parsed (see :meth:`resolve`).",
    "KvOptions": "The resolved options of one request (what EngineCore and the worker see).",
}


def render_option_types() -> str:
    """``KvRequest`` and ``KvOptions`` as dataclass declarations under ``TYPE_CHECKING``, one
    field per row of ``OPTIONS`` (a request's parsed values are Any: an int or a fraction for
    the budget, "auto" for the point), then the fields only resolution makes."""
    from obcache_vllm import options as o

    def literal(value) -> str:
        return json.dumps(value) if isinstance(value, str) else repr(value)

    out = [BEGIN, "if TYPE_CHECKING:\n"]
    for cls, base, typed in ((o.TABLE.request_type, "_RequestMethods", False),
                             (o.TABLE.options_type, "_OptionsMethods", True)):  # fmt: skip
        out += ["\n", "    @dataclass(frozen=True)\n", f"    class {cls.__name__}({base}):\n",
                f'        """{_TYPE_DOCS[cls.__name__]}"""\n\n']  # fmt: skip
        for f in dataclasses.fields(cls):
            if f.name in o._RESOLVED_TYPES:
                extras = "".join(f", {k}={getattr(f, k)!r}" for k in ("compare", "kw_only")
                                 if getattr(f, k) is not (k == "compare"))  # fmt: skip
                line = (f"        {f.name}: {_annotation(o._RESOLVED_TYPES[f.name])} = "
                        f"field(default={literal(f.default)}{extras})\n")  # fmt: skip
                if len(line) > 101:  # the source's line length
                    head, args = line.split("(", 1)
                    line = f"{head}(\n            {args[:-2]}\n        )\n"
                out.append(line)
                continue
            spec = o.TABLE.spec("kv_" + f.name)
            kind = _annotation(spec.types) if typed else "Any"
            value = "" if f.default is dataclasses.MISSING else f" = {literal(f.default)}"
            out.append(f"        {f.name}: {kind}{value}\n")
    out += ["\nelse:\n", "    KvRequest = TABLE.request_type\n",
            "    KvOptions = TABLE.options_type\n", END]  # fmt: skip
    return "".join(out)


def _options_source(block: str) -> str:
    text = OPTIONS_SOURCE.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + block + text[end:]


def main() -> int:
    texts = {"cli": render_cli(), "rest": render_rest(), "_options": render_options(),
             "_seams": render_seams(), "_refusal_matrix": render_refusal_matrix()}
    stale = [p for name, p in PAGES.items() if not p.is_file() or p.read_text() != texts[name]]
    source = _options_source(render_option_types())
    if source != OPTIONS_SOURCE.read_text():
        stale.append(OPTIONS_SOURCE)
    if "--check" in sys.argv[1:]:
        for page in stale:
            print(f"{page.relative_to(ROOT)} is stale: run scripts/gen_reference.py")
        return 1 if stale else 0
    for name, page in PAGES.items():
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(texts[name])
        print(page.relative_to(ROOT))
    if OPTIONS_SOURCE in stale:
        OPTIONS_SOURCE.write_text(source)
        print(OPTIONS_SOURCE.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
