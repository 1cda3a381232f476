"""Every command block of the README and the user guide runs against the suite's server, and
what the page shows it printing is what it prints.

Which blocks: in README.md, docs/getting_started/*.md and docs/user_guide/*.md, every fenced
block tagged ``bash``, ``sh``, ``shell`` or ``console``, every block of another tag that calls
``curl``, and every ``python`` block that calls the local server (``127.0.0.1:8000`` or
``localhost:8000``); one test per block, named ``page:line`` of its opening fence.

Each block is either run or marked. A block that cannot run against a test server (``make``,
``pip``, containers, a server or an evaluation of its own, the suite itself, a GPU) carries on
the line right before its opening fence, at the fence's indentation, an HTML comment (neither
the site nor GitHub shows it)::

    <!-- not-run: starts its own server -->

An unmarked block that looks unrunnable (``UNRUNNABLE`` in tests/support/doc_commands.py) fails,
naming its ``page:line`` and asking for the marker; a marker on no such block fails too.

How a block runs: from the repository's root, ``127.0.0.1:8000``/``localhost:8000`` rewritten
to the session's server (``server`` of tests/conftest.py, shared with the other server tests),
a shell block with ``bash -e -o pipefail`` (this venv's bin first on ``PATH``), a python block
with this venv's python; each within ``BLOCK_TIMEOUT_S``, its process group killed after it. A
prompt written ``...a long document...`` is sent as ``obcache_vllm.textgen.haystack(20, 0)``.
It must exit 0, and every curl call must get a 2xx, unless the page documents otherwise.

What a page documents a command prints, and how it is compared:

* a comment after a curl call: ``# HTTP 400: {json}`` (the status and the body) or
  ``# {json}`` (the body of a 2xx); continuation lines are comments indented by two spaces or
  more, joined with one space;
* a ``json`` block right after a block that calls curl (only prose between: no heading, tab
  or other block): the reply of its last curl call; it may be an object's members without
  their braces (``"usage": {...}``);
* ``# prog: ...`` where prog is a program the block runs: text it prints (stdout or stderr,
  whitespace runs as one space); ``prog: error: ...`` means the block must fail.

The rule for JSON: every key the page shows must be in the reply, with a value of the same JSON
type (boolean, number, string, null, array, object) that is equal; keys the page leaves out are
not compared. Numbers are compared exactly: a sample is a real reply of the same model with
greedy decoding (``"temperature": 0``), so it is reproduced to the token; a value that differs
from run to run (ids, timestamps, a sampled text) is written ``...``. ``...`` is a wildcard: a
bare ``...`` or the string ``"..."`` as a value matches any value, ``...`` among an object's
members stands for the members not shown, ``...`` among a list's items for any run of items
(``["kv_budget", ...]``: a list that starts with that item), and ``...`` inside a string for
any text. Python blocks are checked by their exit status only (their comments describe the
output, they do not quote it).

A sample that is stale today and being replaced is listed in ``STALE`` (page, a text of the
block or its sample): its test is an expected failure, strict, so it turns red again once the
page is fixed and the entry must go. A differing status, field or text raises
``SampleMismatch``; a block that does not run at all fails as any test does.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from support import doc_commands as dc

pytestmark = [pytest.mark.server]

# (page, text in the block or its documented output) -> what differs today.
STALE: dict[tuple[str, str], str] = {}

BLOCKS = dc.collect()


def _shown(block: dc.Block) -> str:
    return block.text + "".join(o.json or o.text or "" for o in block.outputs)


def _stale(block: dc.Block) -> str | None:
    found = [why for (page, text), why in STALE.items()
             if page == block.page and text in _shown(block)]  # fmt: skip
    return found[0] if found else None


def _param(block: dc.Block):
    why = _stale(block)
    marks = [pytest.mark.xfail(strict=True, raises=dc.SampleMismatch, reason=why)] if why else []
    return pytest.param(block, id=block.id, marks=marks)


def _unrunnable_message(block: dc.Block, why: list[str]) -> str:
    return (
        f"{block.id}: this {block.fence.tag or 'untagged'} block cannot run against the "
        f"suite's server ({'; '.join(why)}). Make it runnable, or put "
        "`<!-- not-run: REASON -->` on the line right before its opening fence (at the "
        "fence's indentation), saying why it cannot run (tests/server/test_doc_commands.py)"
    )


def check_block(block: dc.Block, request: pytest.FixtureRequest, workdir: Path) -> None:
    """The whole check of one block: marked with a reason, or run and compared."""
    if block.not_run is not None:
        assert block.not_run, f"{block.id}: `<!-- not-run: -->` without a reason"
        return
    why = block.unrunnable()
    if why:
        pytest.fail(_unrunnable_message(block, why))
    server = request.getfixturevalue("server")  # only blocks that run start it
    dc.check(block, dc.run(block, server.url, workdir))


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_command_block(block: dc.Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    check_block(block, request, tmp_path)


def test_the_pages_have_command_blocks_that_run_and_ones_that_are_marked() -> None:
    """The collection itself: a change of the parser that finds nothing must not pass."""
    run = [b for b in BLOCKS if b.not_run is None]
    assert len(BLOCKS) >= 30 and len(run) >= 8, [b.id for b in BLOCKS]
    assert any(b.kind == "python" for b in run) and any(b.outputs for b in run)
    ids = [b.id for b in BLOCKS]
    assert len(ids) == len(set(ids))


def test_every_marker_is_right_before_a_block_it_applies_to() -> None:
    stray = dc.stray_markers()
    assert not stray, ("`<!-- not-run: -->` markers that are not on the line right before a "
                       "command block:\n" + "\n".join(stray))  # fmt: skip


def test_every_stale_entry_names_a_block() -> None:
    named = {(page, text) for (page, text) in STALE for b in BLOCKS
             if b.page == page and text in _shown(b)}  # fmt: skip
    assert named == set(STALE), f"STALE entries matching no block: {set(STALE) - named}"


def test_markers_are_invisible_on_the_site() -> None:
    """Rendered with the site's Markdown extensions, a marker is an HTML comment: never text."""
    import markdown
    import yaml

    config = yaml.safe_load((dc.ROOT / "mkdocs.yml").read_text())
    names, options = [], {}
    for entry in config["markdown_extensions"]:
        name, opts = next(iter(entry.items())) if isinstance(entry, dict) else (entry, None)
        names.append(name)
        if opts:
            options[name] = dict(opts)
    if "pymdownx.snippets" in options:
        options["pymdownx.snippets"]["base_path"] = [str(dc.ROOT)]
    marked = {b.fence.page for b in BLOCKS if b.not_run is not None}
    assert marked
    for page in sorted(marked):
        html = markdown.markdown((dc.ROOT / page).read_text(), extensions=names,
                                 extension_configs=options)  # fmt: skip
        visible = re.sub(r"<!--.*?-->", "", html, flags=re.S)
        assert "not-run:" not in visible, f"{page}: a marker shows on the site"
        assert html.count("<!-- not-run:") == sum(
            b.page == page and b.not_run is not None for b in BLOCKS
        ), f"{page}: a marker is lost"


# --- the comparison itself -------------------------------------------------------------------


def test_documented_json_with_wildcards() -> None:
    doc = dc.parse_documented(
        '"choices": [{"text": "Paris...", "finish_reason": "length", ...}],\n'
        ' "usage": {"prompt_tokens": 767, "obcache": {"budget": 192, "pipeline": "tova"}},\n'
        ' "id": "...", "fields": ["kv_budget", ...], "created": ..., "ok": true'
    )
    reply = {"id": "cmpl-1", "created": 1796440747, "object": "text_completion", "ok": True,
             "choices": [{"index": 0, "text": "Paris is the capital", "finish_reason": "length"}],
             "usage": {"prompt_tokens": 767, "total_tokens": 783,
                       "obcache": {"budget": 192, "pipeline": "tova", "evictions": 1}},
             "fields": ["kv_budget", "kv_scorer"]}  # fmt: skip
    assert dc.differences(doc, reply) == []

    def differs(path: str, value: object) -> list[str]:
        changed = __import__("copy").deepcopy(reply)
        *parents, last = path.split(".")
        node = changed
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value
        return dc.differences(doc, changed)

    assert differs("usage.obcache.pipeline", "snapkv") == [
        'usage.obcache.pipeline: the page shows "tova", the server answers "snapkv"'
    ]
    assert differs("usage.prompt_tokens", 768)  # numbers exactly
    assert differs("usage.prompt_tokens", "767")  # and the same JSON type
    assert differs("ok", 1) and not differs("ok", True)
    assert differs("fields", ["kv_scorer", "kv_budget"])  # the items shown, in order
    assert not differs("fields", ["kv_budget"])  # "...": any run of items, none included
    assert differs("choices", [])  # a list without "..." has the items shown
    assert differs("choices.0.text", "London")  # "Paris...": text after it, none before
    assert not differs("created", None)  # a bare "...": any value
    assert "usage.obcache.budget: on the page, missing" in differs("usage.obcache", {})[0]
    # a list item and an object member written "..." inside a whole value, nested
    nested = dc.parse_documented('{"a": [1, ..., 4], "b": {"c": [...], ...}}')
    assert dc.differences(nested, {"a": [1, 2, 3, 4], "b": {"c": [], "d": 0}}) == []
    assert dc.differences(nested, {"a": [1, 4], "b": {"c": [5]}}) == []
    assert dc.differences(nested, {"a": [1, 2], "b": {"c": []}})
    # "..." inside a string is text, not a wildcard of the JSON
    assert dc.parse_documented('{"m": "known: a, ..."}') == {"m": "known: a, ..."}
    assert dc.text_matches(
        "prog: error: X: unknown name 'm'; known: a, ...",
        "log line\nprog: error: X: unknown name 'm';\n known: a, b, c\n",
    )
    assert not dc.text_matches("prog: error: Y", "prog: error: X")


def test_documented_outputs_are_read_from_the_block(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n"
        "```bash\n"
        "curl -s http://127.0.0.1:8000/a -d '{\n  \"x\": 1}'\n"
        '# HTTP 400: {"error": {"message": "x: bad\n#   value", "code": 400}}\n'
        "curl -s http://localhost:8000/b   # a note, not an output\n"
        "# the same through vllm_xargs: a note too\n"
        "```\n\n"
        "The reply of the second call:\n\n"
        '```json\n"usage": {"n": 1}\n```\n\n'
        "<!-- not-run: starts its own server -->\n"
        "```sh\nobcache-vllm serve\n```\n\n"
        "```bash\nmake serve\n```\n\n"
        "```bash\nOBCACHE_KV_SCORER=magic obcache-vllm serve\n"
        "# obcache-vllm: error: OBCACHE_KV_SCORER: ...\n```\n"
    )
    first, marked, unmarked, failing = dc.collect([page], tmp_path)
    assert [b.id for b in (first, marked)] == ["page.md:3", "page.md:19"]
    assert [(o.after_curls, o.status) for o in first.outputs] == [(1, 400), (2, None)]
    assert dc.parse_documented(first.outputs[0].json)["error"]["message"] == "x: bad value"
    assert dc.parse_documented(first.outputs[1].json) == {"usage": {"n": 1}}
    assert "127.0.0.1:8000" not in dc.prepare(first.text, "http://127.0.0.1:1234")
    assert marked.not_run == "starts its own server" and not dc.stray_markers([page], tmp_path)
    assert unmarked.not_run is None and unmarked.unrunnable()
    assert failing.expects_failure() and not failing.unrunnable()  # one command, refused at once
    # an unmarked block that cannot run fails, naming its place and what to do
    with pytest.raises(pytest.fail.Exception) as failed:
        check_block(unmarked, None, tmp_path)  # type: ignore[arg-type]
    assert "page.md:23" in str(failed.value) and "<!-- not-run: REASON -->" in str(failed.value)
    # a marker that precedes no command block is reported
    page.write_text("<!-- not-run: nothing -->\n```json\n{}\n```\n")
    assert dc.stray_markers([page], tmp_path) == ["page.md:1: <!-- not-run: nothing -->"]


def test_console_blocks_and_example_scripts(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```console\n$ obcache-vllm model path \\\n  --model x\n/cache/models/...\n```\n\n"
        "```bash\n.venv/bin/python examples/chat_client.py\n"
        ".venv/bin/python examples/metrics.py --url http://127.0.0.1:8000\n```\n\n"
        "```bash\n.venv/bin/python examples/offline.py --max-tokens 8\n```\n"
    )
    console, clients, offline = dc.collect([page], tmp_path)
    assert console.commands() == ["obcache-vllm model path    --model x"]
    assert [o.text for o in console.outputs] == ["/cache/models/..."]
    assert dc.text_matches(console.outputs[0].text, "/cache/models/SmolLM2-135M-Instruct\n")
    assert not clients.unrunnable() and offline.unrunnable()
    prepared = dc.prepare(clients.text, "http://127.0.0.1:1234")
    assert "examples/chat_client.py --base-url http://127.0.0.1:1234/v1\n" in prepared
    assert prepared.endswith("examples/metrics.py --url http://127.0.0.1:1234")


# Documented values changed in copies of real pages: each must fail as stale (the real pages'
# blocks run above). (page, text of the sample, replacement, what the failure names)
MUTATIONS = [
    ("README.md", '"pipeline": "snapkv"', '"pipeline": "tova"', "usage.obcache.pipeline"),
    ("docs/user_guide/server.md", '"kv_window":32,', '"kv_window":64,', "defaults.kv_window"),
    ("docs/user_guide/refusals.md", "# HTTP 400:", "# HTTP 422:", "HTTP 422"),
]


@pytest.mark.parametrize("page, old, new, named", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_stale_sample_in_a_copy_of_a_page_fails(page, old, new, named, request, tmp_path):
    copy = tmp_path / "root" / page
    copy.parent.mkdir(parents=True)
    shutil.copy(dc.ROOT / page, copy)
    text = copy.read_text()
    assert old in text, f"{page} no longer shows {old!r}: pick another value for this self-test"
    copy.write_text(text.replace(old, new, 1))
    [block] = [b for b in dc.collect([copy], tmp_path / "root")
               if any(new in (o.json or "") or (o.status and str(o.status) in new)
                      for o in b.outputs)]  # fmt: skip
    with pytest.raises(dc.SampleMismatch) as stale:
        check_block(block, request, tmp_path / "run")
    assert named in str(stale.value) and block.id in str(stale.value), stale.value
