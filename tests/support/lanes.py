"""Two pytest sessions sharing one suite, a core each (``scripts/test_lanes.py`` starts them).

Why: on a 2-core machine the suite is bound by the model's forward passes, and one engine
with a thread per core is a poor use of two cores: measured on this model
(``scripts/engine_threads.py``), two threads make prefill about 1.6x and decode about 1.2x
faster than one, and an OpenAI-style server's engine runs one thread anyway. Two sessions
with one thread each do more work per second, provided neither waits for the other.

How: each session (a *lane*) collects the whole suite, then runs whole test files, claiming
each file before it starts it (an ``O_EXCL`` file in the directory ``OBCACHE_TEST_LANES``
names), so every file runs exactly once, in one lane, with its module fixtures intact. The
lanes take files from the two ends of one preference list:

* lane 0 starts with the engine tests on the shared in-process engine (longest first), the
  lane whose one engine and stock reference serve most of the suite;
* lane 1 starts with the server tests (the ones that start servers or engines of their own
  first, before the stock server joins the session's), then the unit and vllm tiers, then the
  engine tests that start processes of their own;
* lane 0 takes that last group from its end once its shared-engine files are done, so the two
  lanes meet in the middle of it;
* the shared-engine files outweigh everything else (about 40 of 64 minutes of test time in
  the first two-lane run), so lane 1 ends on them, from the short end of lane 0's list: before
  its first one it stops what its server files left running (:func:`release`) and starts a
  shared engine of its own. Lane 0 never takes a server file (memory: see
  :func:`preference`).

A file's last test is run knowing which file comes next in its lane (the next claim is made
before it), so module and directory-level teardowns happen as in a plain run.

The lane's process (and what it starts) is pinned to its core by the driver; servers bind to
it too (``VLLM_CPU_OMP_THREADS_BIND``), and ``OMP_NUM_THREADS=1`` gives the in-process engines
one thread. Outside a lane (``OBCACHE_TEST_LANE`` unset) nothing here is active.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

LANE_ENV = "OBCACHE_TEST_LANE"
CLAIMS_ENV = "OBCACHE_TEST_LANES"

# Shared-engine files that take minutes: first in lane 0, so neither lane ends on one of them.
LONG_FIRST = (
    "test_hf_reference.py",
    "test_decode_eviction.py",
    "test_prefix_cache.py",
    "test_stress.py",
    "test_adakv.py",
    "test_error_target.py",
)
# Server files that start servers or engines of their own (first in lane 1, while the
# session's server is the only other one up), then the long ones.
LONG_SERVER_FIRST = (
    "test_soak.py",
    "test_fleet.py",
    "test_examples.py",
    "test_concurrent_reuse_http.py",
    "test_fidelity_http.py",
    "test_lm_eval.py",
    "test_composition_http.py",
)


def suite_cores() -> list[int]:
    """The cores the suite may use: ``OBCACHE_TEST_CORES`` ("0,1", set by the driver for both
    lanes, each of which is pinned to one of them), else this process's."""
    given = os.environ.get("OBCACHE_TEST_CORES")
    return [int(c) for c in given.split(",")] if given else sorted(os.sched_getaffinity(0))


def lane() -> int | None:
    value = os.environ.get(LANE_ENV)
    return int(value) if value not in (None, "") else None


def _kind(items: list[pytest.Item]) -> str:
    """"shared" (uses the session's in-process engine), "server", "engine" (engine tests that
    start their own processes), or the folder's tier ("unit", "vllm")."""
    names = set().union(*(set(getattr(i, "fixturenames", ())) for i in items))
    folder = Path(items[0].path).parent.name
    if "llm" in names:
        return "shared"
    if folder == "server" or names & {"server", "stock_server", "early_server"}:
        return "server"
    return folder


def _ranked(files: list[Path], first: tuple[str, ...]) -> list[Path]:
    rank = {name: i for i, name in enumerate(first)}
    return sorted(files, key=lambda f: rank.get(f.name, len(rank)))


SERVER_FIXTURES = frozenset({"server", "stock_server", "early_server"})


def preference(groups: dict[Path, list[pytest.Item]], which: int) -> list[Path]:
    """The order in which lane ``which`` tries to claim files."""
    by_kind: dict[str, list[Path]] = {}
    for path, items in groups.items():
        by_kind.setdefault(_kind(items), []).append(path)
    # shared-engine files that use a server too go early in lane 0's list, where lane 1 (whose
    # servers are stopped by then) seldom reaches them
    shared = by_kind.pop("shared", [])
    with_server = tuple(p.name for p in shared if _fixtures(groups[p]) & SERVER_FIXTURES)
    shared = _ranked(shared, LONG_FIRST + with_server)
    server = _ranked(by_kind.pop("server", []), LONG_SERVER_FIRST)
    engine = by_kind.pop("engine", [])
    rest = [p for kind in sorted(by_kind) for p in by_kind[kind]]  # unit, vllm
    middle = rest + engine  # either lane's, whichever gets there first
    # Memory (24 GiB): an engine and its stock reference take about 4.5 GB, a server about 3.3,
    # the fleet's two workers 6.6. Lane 1 holds servers or, later, a shared engine, never both
    # (release); lane 0 holds its engine throughout and never starts the server files' set.
    return shared + middle[::-1] if which == 0 else server + middle + shared[::-1]


def _fixtures(items: list[pytest.Item]) -> set[str]:
    return set().union(*(set(getattr(i, "fixturenames", ())) for i in items))


# The session-scoped fixtures this session has set up, each with the request that set it up.
_session_fixtures: list[tuple[object, object]] = []


def record_fixture(fixturedef, request) -> None:
    if fixturedef.scope == "session":
        _session_fixtures.append((fixturedef, request))


class _Recorder:
    """Registered as a plugin by :func:`runtestloop`: a conftest's own hook would not see the
    session-scoped fixtures (pytest calls their setup hook on the Session node, which a
    conftest below the root does not cover)."""

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        result = yield
        record_fixture(fixturedef, request)
        return result


def release(names: frozenset[str] = SERVER_FIXTURES) -> list[str]:
    """Tear down the session-scoped fixtures named ``names`` that this session has set up (and,
    through pytest's own finalizers, whatever depends on them): lane 1 stops its server files'
    servers this way before it starts a shared engine. A fixture released here is set up
    again if a later test asks for it (a shared-engine file that also uses a server). Returns
    the names released, the last set up first."""
    released = []
    for fixturedef, request in reversed(_session_fixtures):
        if fixturedef.argname in names and fixturedef.cached_result is not None:
            fixturedef.finish(request)
            released.append(fixturedef.argname)
    _session_fixtures[:] = [(f, r) for f, r in _session_fixtures if f.cached_result is not None]
    return released


def _claim(directory: Path, path: Path) -> bool:
    name = str(path).replace(os.sep, "_")
    try:
        os.close(os.open(directory / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def runtestloop(session: pytest.Session, which: int) -> bool:
    """pytest's run loop over the files this lane claims (see the module docstring)."""
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted(f"{session.testsfailed} errors during collection")
    if session.config.option.collectonly:
        return True
    directory = Path(os.environ[CLAIMS_ENV])
    session.config.pluginmanager.register(_Recorder(), "obcache-lane-fixtures")
    groups: dict[Path, list[pytest.Item]] = {}
    for item in session.items:
        groups.setdefault(Path(item.path), []).append(item)
    order = preference(groups, which)

    def claim_from(start: int) -> int | None:
        for k in range(start, len(order)):
            if _claim(directory, order[k]):
                return k
        return None

    shared = {p for p, items in groups.items() if _kind(items) == "shared"}
    released = which == 0
    current = claim_from(0)
    while current is not None:
        items = groups[order[current]]
        if not released and order[current] in shared:
            released = True
            names = release()
            print(f"\nlane {which}: stopped {', '.join(names) or 'nothing'} before "
                  f"{order[current]}", flush=True)  # fmt: skip
        following = None
        for j, item in enumerate(items):
            if j + 1 < len(items):
                nextitem = items[j + 1]
            else:
                following = claim_from(current + 1)
                nextitem = groups[order[following]][0] if following is not None else None
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
        current = following
    return True
