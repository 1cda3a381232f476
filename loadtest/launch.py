"""Start an ``obcache-vllm serve`` for a run (``--launch``, ``compare``) and stop it afterwards.

The server listens on 127.0.0.1 on a free port, in its own process group, logging to a file;
it is stopped with SIGINT (vLLM's clean shutdown), then SIGKILL after 60 s. ``VLLM_PLUGINS=``
in ``env`` gives stock vLLM from the same install.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path


class LaunchError(RuntimeError):
    """The server exited or did not become healthy in time (the message ends with its log)."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    """GET ``url``/health answers 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@contextmanager
def launched(
    args: Sequence[str],
    env: Mapping[str, str],
    log_path: Path,
    start_timeout_s: float = 600,
) -> Iterator[str]:
    """Yield the base URL of a healthy ``obcache-vllm serve --port P ARGS`` (``env`` over ours)."""
    port = free_port()
    script = Path(sys.executable).parent / "obcache-vllm"
    cmd = [str(script), "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    full_env = {**os.environ, **env}
    url = f"http://127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
        try:
            started = time.monotonic()
            while not healthy(url):
                if proc.poll() is not None:
                    raise LaunchError(f"server exited ({proc.returncode}): {_tail(log_path)}")
                if time.monotonic() - started > start_timeout_s:
                    raise LaunchError(f"server not healthy in {start_timeout_s:.0f} s: "
                                      f"{_tail(log_path)}")
                time.sleep(1)
            print(f"[loadtest] server up in {time.monotonic() - started:.0f} s: {url} "
                  f"(log {log_path})", file=sys.stderr)
            yield url
        finally:
            stop(proc)


def stop(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """Stop a server started with ``start_new_session=True``: SIGINT to its process group (vLLM
    shuts its engine processes down), SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:]
