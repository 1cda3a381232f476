"""The command blocks of the user-facing pages, run as a reader runs them, and what the pages
say they print (used by tests/server/test_doc_commands.py, whose docstring states the rules).

No vLLM import: parsing Markdown, running a block in a subprocess, comparing JSON.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELL_TAGS = frozenset({"bash", "sh", "shell", "console"})
PYTHON_TAGS = frozenset({"python", "py", "python3"})
# The address the pages use for the server `make serve` starts.
LOCAL_SERVER = re.compile(r"(?P<scheme>https?://)?(?:127\.0\.0\.1|localhost):8000\b")
# The markers, each one line right before a block's opening fence (HTML comments: neither the
# site nor GitHub shows them).
NOT_RUN = re.compile(r"^<!--\s*not-run:(?P<reason>.*?)-->\s*$")
ANY_MARKER = re.compile(r"^[ \t]*<!--\s*not-run\b.*$", re.M)
# The document a page's prompt placeholder stands for: the one its samples name.
PLACEHOLDER = "...a long document..."
PLACEHOLDER_DOC = ("obcache_vllm.textgen.haystack", 20, 0)
BLOCK_TIMEOUT_S = 180

# What a block must not do against the suite's server (or at all in a test), checked on its
# code lines: an unmarked block doing one of these fails and asks for a `not-run` marker.
UNRUNNABLE = (
    (re.compile(r"(?:^|[\s;&|(])make(?:\s|$)", re.M), "runs a make target"),
    (re.compile(r"\b(?:pip3?|uv pip|apt-get|apt)\s+install\b"), "installs packages"),
    (re.compile(r"\b(?:docker|podman|kubectl|helm|kind)\s"), "needs containers or a cluster"),
    (re.compile(r"\bserve\b"), "starts a server of its own"),
    (re.compile(r"\bpytest\b"), "runs tests of the suite"),
    (re.compile(r"(?:^|[\s/])(?:scripts|benchmarks|loadtest)/|-m loadtest\b"),
     "runs a script of the repository (long, or writes results/)"),
    (re.compile(r"\blm_eval\b|obcache-vllm\s+(?:eval|ppl)\b"), "runs an evaluation"),
    (re.compile(r"\bmodel\s+pull\b"), "(re)builds the model cache the server reads"),
    (re.compile(r"\bnvidia-smi\b|\bcuda\b|FLASH_ATTN", re.I), "needs a GPU"),
)  # fmt: skip


class SampleMismatch(AssertionError):
    """What a page documents a command prints differs from what it prints."""


# --- pages and their fenced blocks -----------------------------------------------------------


def pages(root: Path = ROOT) -> list[Path]:
    """The README and the user guide: the pages whose commands a reader copies."""
    return [root / "README.md", *sorted((root / "docs" / "getting_started").glob("*.md")),
            *sorted((root / "docs" / "user_guide").glob("*.md"))]  # fmt: skip


@dataclass(frozen=True)
class Fence:
    page: str  # the path shown in ids and messages (relative to the root it was read from)
    line: int  # 1-based line of the opening fence
    end: int  # 1-based line of the closing fence
    tag: str
    text: str  # the body, the fence's indentation removed
    marker: str  # the line right before the opening fence (stripped), "" if blank
    before: str  # the lines between the previous fence's end and this fence's start

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")


def fences(path: Path, root: Path = ROOT) -> list[Fence]:
    lines = path.read_text(encoding="utf-8").splitlines()
    try:
        page = path.relative_to(root).as_posix()
    except ValueError:
        page = path.as_posix()
    found: list[Fence] = []
    i, last_end = 0, 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        body = [x[len(indent) :] if x.startswith(indent) else x.lstrip() for x in lines[i + 1 : j]]
        tag = (m["info"].split() or [""])[0].lstrip(".{").rstrip("}").lower()
        marker = lines[i - 1].strip() if i > 0 else ""
        found.append(Fence(page, i + 1, j + 1, tag, "\n".join(body), marker,
                           "\n".join(lines[last_end:i])))  # fmt: skip
        last_end = j + 1
        i = j + 1
    return found


# --- what a block documents it prints --------------------------------------------------------


@dataclass(frozen=True)
class Output:
    """A documented output: a ``# ...`` comment after a command, or a reply block."""

    line: int  # where the page shows it
    after_curls: int  # how many curl calls of the block precede it (0: not a curl's)
    status: int | None = None  # an HTTP status (``# HTTP 400: ...``)
    json: str | None = None  # a JSON body (``...`` wildcards allowed)
    text: str | None = None  # text the command prints (``...`` wildcards allowed)


@dataclass(frozen=True)
class Block:
    fence: Fence
    kind: str  # "shell" or "python"
    not_run: str | None  # the marker's reason, None without a marker
    outputs: tuple[Output, ...] = field(default=())

    @property
    def id(self) -> str:
        return self.fence.id

    @property
    def page(self) -> str:
        return self.fence.page

    @property
    def text(self) -> str:
        return self.fence.text

    def code(self) -> str:
        """The block without its comments (shell) or as it is (python)."""
        if self.kind != "shell":
            return self.text
        return "\n".join(x for x in _shell_lines(self.fence) if not x.lstrip().startswith("#"))

    def expects_failure(self) -> bool:
        """A block documented to exit with an error (``# prog: error: ...``)."""
        return any(o.text is not None and re.search(r"\berror:", o.text) for o in self.outputs)

    def commands(self) -> list[str]:
        """The block's commands (lines joined where they end with a backslash)."""
        joined = re.sub(r"\\\n", " ", self.code())
        return [x.strip() for x in joined.splitlines() if x.strip()]

    def unrunnable(self) -> list[str]:
        """Why this block cannot run in a test. A block of one command documented to fail
        (``# prog: error: ...``, e.g. a server start its configuration refuses) may run."""
        code = self.code()
        why = [reason for pattern, reason in UNRUNNABLE if pattern.search(code)]
        if any(_example_option(m["name"]) is None for m in _EXAMPLE.finditer(code)):
            why.append("runs an engine of its own (an examples/ script without a server)")
        if self.expects_failure() and len(self.commands()) == 1:
            why = [w for w in why if w != "starts a server of its own"]
        return why


_CURL = re.compile(r"(?:^|[\s;&|(])curl\s", re.M)
_HTTP = re.compile(r"^HTTP (?P<status>\d{3}):\s*(?P<rest>.*)$", re.S)
_PROG = re.compile(r"^(?P<prog>[\w.-]+): ")


def _shell_lines(fence: Fence, text: str | None = None) -> list[str]:
    """The lines of a shell block (``text``: its prepared text). In a ``console`` block the
    commands are the ``$ `` lines (and their continuations) and what they print becomes
    ``#> `` comments."""
    lines = (fence.text if text is None else text).splitlines()
    if fence.tag != "console":
        return lines
    out, continued = [], False
    for x in lines:
        if x.startswith("$ ") or continued:
            out.append(x[2:] if x.startswith("$ ") else x)
            continued = x.rstrip().endswith("\\")
        else:
            out.append("#> " + x)
    return out


def _documented_outputs(fence: Fence) -> list[Output]:
    """The ``# ...`` comments of a shell block that show what the command before them prints:
    ``# HTTP 400: {...}``, ``# {...}``/``# [...]`` (a JSON reply) or ``# prog: ...`` where prog is
    a program the block runs; continuation lines are comments indented by two spaces or more.
    In a ``console`` block, the lines after a command are text it prints."""
    lines = _shell_lines(fence)
    code = "\n".join(x for x in lines if not x.lstrip().startswith("#"))
    outputs, k = [], 0
    while k < len(lines):
        line = lines[k]
        stripped = line.lstrip()
        if line.startswith("#> "):
            n = k
            while n < len(lines) and lines[n].startswith("#> "):
                n += 1
            printed = "\n".join(x[3:] for x in lines[k:n]).strip()
            if printed:
                outputs.append(Output(fence.line + 1 + k, 0, None, None, printed))
            k = n
            continue
        if not stripped.startswith("#"):
            k += 1
            continue
        content = stripped[1:].strip()
        parts, n = [content], k + 1
        while n < len(lines) and re.match(r"^\s*#\s{2,}\S", lines[n]):
            parts.append(lines[n].lstrip()[1:].strip())
            n += 1
        whole = " ".join(parts)
        before = "\n".join(x for x in lines[:k] if not x.lstrip().startswith("#"))
        curls = len(_CURL.findall(before))
        line_no = fence.line + 1 + k
        if m := _HTTP.match(whole):
            outputs.append(Output(line_no, curls, int(m["status"]), m["rest"] or None))
        elif whole.startswith(("{", "[")):
            outputs.append(Output(line_no, curls, None, whole))
        elif (m := _PROG.match(whole)) and re.search(
            rf"(?:^|[\s/]){re.escape(m['prog'])}(?:\s|$)", code, re.M
        ):
            outputs.append(Output(line_no, 0, None, None, whole))
        k = n
    return outputs


def _following_reply(fence: Fence, after: Fence | None) -> Output | None:
    """A ``json`` block right after a block that calls curl (nothing but prose between: no
    heading, no tab, no other block) is the reply of its last curl."""
    if after is None or after.tag != "json":
        return None
    if re.search(r"^\s*(?:#{1,6}\s|===\s|!!!\s|\?\?\?)", after.before, re.M):
        return None
    curls = len(
        _CURL.findall("\n".join(x for x in _shell_lines(fence) if not x.lstrip().startswith("#")))
    )
    return Output(after.line, curls, None, after.text) if curls else None


def collect(paths: list[Path] | None = None, root: Path = ROOT) -> list[Block]:
    """Every shell block (bash, sh, shell, console), every block of any tag that runs curl, and
    every python block that calls the local server, of ``paths`` (default: :func:`pages`)."""
    blocks = []
    for path in paths or pages(root):
        found = fences(path, root)
        for i, fence in enumerate(found):
            code = fence.text
            if fence.tag in SHELL_TAGS or (_CURL.search(code) and fence.tag not in PYTHON_TAGS):
                kind = "shell"
            elif fence.tag in PYTHON_TAGS and LOCAL_SERVER.search(code):
                kind = "python"
            else:
                continue
            m = NOT_RUN.match(fence.marker)
            outputs = _documented_outputs(fence) if kind == "shell" else []
            after = found[i + 1] if i + 1 < len(found) else None
            reply = _following_reply(fence, after) if kind == "shell" else None
            if reply is not None and not any(o.after_curls == reply.after_curls and o.json
                                             for o in outputs):  # fmt: skip
                outputs.append(reply)
            blocks.append(Block(fence, kind, m["reason"].strip() if m else None, tuple(outputs)))
    return blocks


def stray_markers(paths: list[Path] | None = None, root: Path = ROOT) -> list[str]:
    """Markers that are not on the line right before a block they apply to."""
    bad = []
    for path in paths or pages(root):
        text = path.read_text(encoding="utf-8")
        used = {b.fence.line - 1 for b in collect([path], root) if b.not_run is not None}
        for m in ANY_MARKER.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            if line not in used:
                bad.append(f"{path.relative_to(root).as_posix()}:{line}: {m.group(0).strip()}")
    return bad


# --- running a block -------------------------------------------------------------------------


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    timed_out: bool
    curls: list[tuple[int, str]]  # (HTTP status, body) of each curl call, in order

    def tail(self, chars: int = 3000) -> str:
        timed_out = " (timed out)" if self.timed_out else ""
        return (f"exit status {self.rc}{timed_out}\n--- stdout\n{self.stdout[-chars:]}\n"
                f"--- stderr\n{self.stderr[-chars:]}")  # fmt: skip


def placeholder_text() -> str:
    """The placeholder's document, escaped for a JSON (or Python) string literal."""
    from obcache_vllm.textgen import haystack

    _, n, seed = PLACEHOLDER_DOC
    escaped = json.dumps(haystack(n, seed))[1:-1]
    assert "'" not in escaped, "the document must fit in a shell single-quoted string"
    return escaped


_EXAMPLE = re.compile(r"(?P<script>\bexamples/(?P<name>\w+)\.py)(?P<args>[^\n#;&|]*)")


def _example_option(name: str) -> tuple[str, str] | None:
    """How the examples folder's script ``name`` takes the server's address: (its option,
    "base" for the address with /v1, "root" without), None if it takes none."""
    path = ROOT / "examples" / f"{name}.py"
    source = path.read_text() if path.is_file() else ""
    for option, kind in (("--base-url", "base"), ("--url", "root")):
        if f'"{option}"' in source:
            return option, kind
    return None


def prepare(text: str, url: str) -> str:
    """``text`` pointed at ``url`` (for 127.0.0.1:8000; an ``examples/`` script that takes the
    server's address and is not given one gets it), its placeholder document filled in."""
    hostport = url.split("://", 1)[-1].rstrip("/")
    text = LOCAL_SERVER.sub(lambda m: (m["scheme"] or "") + hostport, text)

    def point(m: re.Match) -> str:
        taken = _example_option(m["name"])
        if taken is None or taken[0] in m["args"]:
            return m.group(0)
        option, kind = taken
        return f"{m['script']} {option} {url + '/v1' if kind == 'base' else url}{m['args']}"

    text = _EXAMPLE.sub(point, text)
    return text.replace(PLACEHOLDER, placeholder_text()) if PLACEHOLDER in text else text


# Each curl call's status and body go to files (its output is printed as curl prints it).
_CURL_SHIM = r"""
__doc_curl_n=0
curl() {
  __doc_curl_n=$((__doc_curl_n + 1))
  local rc=0
  command curl -o "$DOC_OUT/body.$__doc_curl_n" -w '%{http_code}' "$@" \
    > "$DOC_OUT/status.$__doc_curl_n" || rc=$?
  cat "$DOC_OUT/body.$__doc_curl_n" 2>/dev/null || true
  return $rc
}
"""


def _env(workdir: Path) -> dict[str, str]:
    from support.server import production_env

    env = production_env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["DOC_OUT"] = str(workdir)
    return env


def _run(cmd: list[str], workdir: Path, timeout: float) -> tuple[int, str, str, bool]:
    """Run ``cmd`` in its own session from the repository root; on a timeout, kill the whole
    process group (a block that started a server leaves nothing behind)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(workdir), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    finally:
        try:  # whatever the block left running in its group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, out, err, timed_out


def run(block: Block, url: str, workdir: Path, timeout: float = BLOCK_TIMEOUT_S) -> Run:
    """Run ``block`` as a reader would against the server at ``url``: a shell block with
    ``bash -e -o pipefail`` (curl's status recorded), a python block with this venv's python."""
    workdir.mkdir(parents=True, exist_ok=True)
    code = prepare(block.text, url)
    if block.kind == "shell":
        script = _CURL_SHIM + "\n".join(_shell_lines(block.fence, code)) + "\n"
        rc, out, err, timed_out = _run(["bash", "-e", "-o", "pipefail", "-c", script],
                                       workdir, timeout)  # fmt: skip
    else:
        script_path = workdir / "block.py"
        script_path.write_text(code + "\n")
        rc, out, err, timed_out = _run([sys.executable, str(script_path)], workdir, timeout)
    curls = []
    for n in range(1, 1 + len(list(workdir.glob("status.*")))):
        status = (workdir / f"status.{n}").read_text().strip()
        body = workdir / f"body.{n}"
        curls.append((int(status) if status.isdigit() else 0,
                      body.read_text(errors="replace") if body.exists() else ""))  # fmt: skip
    return Run(rc, out, err, timed_out, curls)


def check(block: Block, result: Run) -> None:
    """Raise AssertionError if the block failed to run, :class:`SampleMismatch` if it ran but
    what the page documents differs (status, JSON fields, text)."""
    where = block.id
    failing = block.expects_failure()
    if result.timed_out or (result.rc != 0) != failing:
        want = "a failure, as documented" if failing else "exit status 0"
        raise AssertionError(f"{where}: expected {want}\n{result.tail()}")
    problems: list[str] = []
    documented = {o.after_curls: o for o in block.outputs if o.after_curls}
    for n, (status, body) in enumerate(result.curls, start=1):
        out = documented.get(n)
        want = out.status if out and out.status else None
        if want is not None and status != want:
            problems.append(f"curl #{n}: the page says HTTP {want}, the server answers {status}")
        elif want is None and not 200 <= status < 300:
            raise AssertionError(f"{where}: curl #{n} got HTTP {status}, and the page documents "
                                 f"no error status\n{body[-2000:]}")  # fmt: skip
        if out and out.json:
            try:
                actual = json.loads(body)
            except json.JSONDecodeError:
                problems.append(f"curl #{n} (sample at line {out.line}): the reply is not "
                                f"JSON: {body[:300]!r}")  # fmt: skip
                continue
            problems += [f"curl #{n} (sample at line {out.line}): {d}"
                         for d in differences(parse_documented(out.json), actual)]  # fmt: skip
    missing = [o for o in documented if o > len(result.curls)]
    if missing:
        raise AssertionError(f"{where}: outputs documented for curl calls {missing} that never "
                             f"ran ({len(result.curls)} ran)\n{result.tail()}")  # fmt: skip
    printed = result.stdout + "\n" + result.stderr
    for out in block.outputs:
        if out.text is not None and not text_matches(out.text, printed):
            problems.append(f"line {out.line}: the page shows {out.text!r}, the command "
                            f"printed {printed.strip()[-600:]!r}")  # fmt: skip
    if problems:
        raise SampleMismatch(f"{where}: the page's sample is stale:\n  " + "\n  ".join(problems))


# --- documented JSON with `...` --------------------------------------------------------------

ELLIPSIS = "\u2026doc-ellipsis\u2026"  # what a bare `...` value or list item becomes
_MEMBER = "\u2026doc-member\u2026"  # what a bare `...` object member becomes (then dropped)


def _mark_ellipses(text: str) -> str:
    """``text`` with each ``...`` outside a string made valid JSON: in an object where a member
    would start, a member to drop; elsewhere (a value, a list item) the string ELLIPSIS."""
    out: list[str] = []
    stack: list[str] = []
    in_string = False
    i = 0
    while i < len(text):
        c = text[i]
        if in_string:
            out.append(c)
            if c == "\\" and i + 1 < len(text):
                out.append(text[i + 1])
                i += 2
                continue
            in_string = c != '"'
            i += 1
            continue
        if text.startswith("...", i):
            previous = "".join(out).rstrip()[-1:]
            if stack and stack[-1] == "{" and previous != ":":
                out.append(f'"{_MEMBER}": null')
            else:
                out.append(f'"{ELLIPSIS}"')
            i += 3
            continue
        if c == '"':
            in_string = True
        elif c in "[{":
            stack.append(c)
        elif c in "]}" and stack:
            stack.pop()
        out.append(c)
        i += 1
    return "".join(out)


def parse_documented(text: str) -> object:
    """A documented JSON reply: a whole value, or an object's members without their braces
    (``"usage": {...}``); ``...`` stands for anything (see :func:`differences`)."""
    text = text.strip()
    if text.startswith('"'):
        text = "{" + text + "}"

    def members(pairs):
        return {k: v for k, v in pairs if k != _MEMBER}

    return json.loads(_mark_ellipses(text), object_pairs_hook=members)


def _kind(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {dict: "object", list: "array", str: "string", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _is_wildcard(value: object) -> bool:
    return value in (ELLIPSIS, "...")


def _string_matches(documented: str, actual: str) -> bool:
    if "..." not in documented:
        return documented == actual
    pattern = ".*?".join(re.escape(part) for part in documented.split("..."))
    return re.fullmatch(pattern, actual, re.S) is not None


def _list_matches(documented: list, actual: list) -> bool:
    """Glob matching: an ELLIPSIS item matches any run of items (none included)."""
    if not documented:
        return not actual
    head, rest = documented[0], documented[1:]
    if head == ELLIPSIS:
        return any(_list_matches(rest, actual[k:]) for k in range(len(actual) + 1))
    return bool(actual) and not differences(head, actual[0]) and _list_matches(rest, actual[1:])


def differences(documented: object, actual: object, path: str = "") -> list[str]:
    """How ``actual`` differs from ``documented``: every documented key present with an equal
    value of the same JSON type (keys the page leaves out are not compared); numbers exactly;
    ``...`` (bare or as the string "...") matches any value, ``...`` inside a string any text,
    and ``...`` in a list any run of items."""
    where = path or "(the reply)"
    if _is_wildcard(documented):
        return []
    if _kind(documented) != _kind(actual):
        return [f"{where}: the page shows {_kind(documented)} {json.dumps(documented)}, the "
                f"server answers {_kind(actual)} {json.dumps(actual)[:300]}"]  # fmt: skip
    if isinstance(documented, dict):
        found = []
        for key, value in documented.items():
            sub = f"{path}.{key}" if path else key
            if key not in actual:
                found.append(f"{sub}: on the page, missing from the reply")
            else:
                found += differences(value, actual[key], sub)
        return found
    if isinstance(documented, list):
        if ELLIPSIS in documented:
            ok = _list_matches(documented, actual)
        elif len(documented) != len(actual):
            ok = False
        else:
            return [d for k, (a, b) in enumerate(zip(documented, actual, strict=True))
                    for d in differences(a, b, f"{path}[{k}]")]  # fmt: skip
        if ok:
            return []
        shown = json.dumps(documented).replace(json.dumps(ELLIPSIS), "...")
        return [f"{where}: the page shows {shown}, the server answers {json.dumps(actual)[:300]}"]
    equal = (_string_matches(documented, actual) if isinstance(documented, str)
             else documented == actual)  # fmt: skip
    if equal:
        return []
    return [f"{where}: the page shows {json.dumps(documented)}, the server answers "
            f"{json.dumps(actual)[:300]}"]  # fmt: skip


def text_matches(documented: str, printed: str) -> bool:
    """Whether ``documented`` (``...``: any text; whitespace runs are one space) appears in
    ``printed``."""
    squash = lambda s: re.sub(r"\s+", " ", s).strip()  # noqa: E731
    pattern = ".*?".join(re.escape(part.strip()) for part in squash(documented).split("..."))
    return re.search(pattern, squash(printed), re.S) is not None
