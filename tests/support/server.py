"""A real `obcache-vllm serve` process for tests (no vLLM import here), and /metrics parsing.

Started as a user does: vLLM's normal topology (API server -> EngineCore -> worker), in its own
process group, logs to a file (nobody would drain a pipe), stopped with SIGINT then SIGKILL.
Each start costs about a minute on the development machine: tests share one per session
(`tests/conftest.py`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from loadtest.launch import free_port, healthy, stop
from loadtest.scrape import Snapshot
from obcache_vllm.plugin import TRACE_ENV

MODEL_NAME = "SmolLM2-135M-Instruct"
# Small engine settings: a 96-block pool (3072 tokens) makes capacity effects visible with
# prompts of a few hundred tokens; block size 32 comes from `obcache-vllm serve`.
POOL_BLOCKS = 96
TEST_SERVER_ARGS = (
    "--max-model-len", "2048",
    "--num-gpu-blocks-override", str(POOL_BLOCKS),
    "--max-num-seqs", "8",
    "--max-num-batched-tokens", "512",
    "--seed", "0",
)  # fmt: skip
START_TIMEOUT_S = 600


@dataclass(frozen=True)
class Server:
    url: str
    pid: int
    trace: Path
    log: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def get_json(self, path: str, timeout: float = 30) -> dict:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout) as resp:
            return json.loads(resp.read())

    def post_json(
        self, path: str, body: dict, timeout: float = 300, headers: dict | None = None
    ) -> tuple[int, dict]:
        """POST ``body``; (status, decoded JSON) for success and error statuses alike
        (``{"raw": text}`` when the body is not JSON)."""
        req = urllib.request.Request(
            f"{self.url}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        try:
            return status, json.loads(raw)
        except json.JSONDecodeError:  # e.g. an event stream where an error was expected
            return status, {"raw": raw.decode(errors="replace")}

    def metrics(self) -> Snapshot:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as resp:
            return Snapshot.parse(resp.read().decode(), time.time())

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def production_env() -> dict[str, str]:
    """This process's environment without what the in-process test engine set: a server (or
    a load run that launches one) gets vLLM's production topology."""
    drop = ("VLLM_ENABLE_V1_MULTIPROCESSING", "OBCACHE_VLLM_RECORD_KEEP")
    return {k: v for k, v in os.environ.items() if k not in drop}


class Launch:
    """`obcache-vllm serve --port P ARGS`, started now; :meth:`ready` waits until it is
    healthy. Two launches start side by side (the session's plugin and stock servers): each
    start is mostly single-threaded imports and loading, so two take little longer than one.
    ``env_overrides``: variables to set (``None``: unset)."""

    def __init__(
        self,
        workdir: Path,
        args: Sequence[str] = TEST_SERVER_ARGS,
        env_overrides: Mapping[str, str | None] | None = None,
    ) -> None:
        port = free_port()
        env = production_env()
        env[TRACE_ENV] = str(workdir / "trace.txt")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # Test servers honour vllm_xargs {"obcache_fault": ...} (obcache_vllm/eviction/faults.py).
        env.setdefault("OBCACHE_VLLM_FAULTS", "1")
        # The KV oracle checks every reuse of KV between requests; a mismatch is a counted fault
        # (stage="verify"), which the tests that share state read back from the metrics.
        env.setdefault("OBCACHE_VLLM_VERIFY", "1")
        for key, value in (env_overrides or {}).items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        script = Path(sys.executable).parent / "obcache-vllm"
        self.cmd = [str(script), "serve", "--port", str(port), *args]
        log_path = workdir / "server.log"
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.started = time.monotonic()
        self.server = Server(
            f"http://127.0.0.1:{port}", self.proc.pid, Path(env[TRACE_ENV]), log_path
        )

    def ready(self) -> Server:
        """The server once healthy; fails the test if it exits or is not up in time."""
        import pytest

        server = self.server
        while not healthy(server.url):
            if self.proc.poll() is not None:
                pytest.fail(f"server exited ({self.proc.returncode}):\n{server.log_tail()}")
            if time.monotonic() - self.started > START_TIMEOUT_S:
                pytest.fail(f"server not up in {START_TIMEOUT_S} s:\n{server.log_tail()}")
            time.sleep(1)
        print(f"server {self.cmd} up in {time.monotonic() - self.started:.0f} s", file=sys.stderr)
        return server

    def stop(self) -> None:
        stop(self.proc)


@contextmanager
def running_server(
    workdir: Path,
    args: Sequence[str] = TEST_SERVER_ARGS,
    env_overrides: Mapping[str, str | None] | None = None,
) -> Iterator[Server]:
    """A :class:`Launch` until the block exits, healthy when the block starts."""
    launch = Launch(workdir, args, env_overrides)
    try:
        yield launch.ready()
    finally:
        launch.stop()
