"""The OpenAI-server patches load in the API-server process only (issue #12, item 3).

The plugin runs in every vLLM process. It used to check every seam first, importing vLLM's app
module (``install.API_SERVER_MODULE``), and only then test whether that module was loaded: so
EngineCore and workers imported the server's modules and got the server patches too. Each case
is a fresh interpreter that runs the plugin's ``register()`` as vLLM would; the real server's
process trace is checked in tests/server/test_refusals_server.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from obcache_vllm.plugin import TRACE_ENV

PROBE = """
import json, sys
if sys.argv[1] == "api-server":
    import vllm.entrypoints.launchers.app  # what `vllm serve` has imported when plugins load
from obcache_vllm.plugin import register
from obcache_vllm.vllm_ext import install

register()
loaded = sorted(m for m in sys.modules if m.startswith("vllm.") and (
    m == install.API_SERVER_MODULE or m.endswith(".serving") or m.endswith(".async_llm")))
# A protocol module EngineCore imports anyway (vLLM's own imports): patched or not?
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
wrapped = getattr(CompletionRequest.to_sampling_params, "__obcache_wrapped__", False)
print("PROBE " + json.dumps({"server_modules": loaded, "wrapped": wrapped}))
"""


def _probe(kind: str, trace) -> dict:
    env = {**os.environ, TRACE_ENV: str(trace)}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, kind], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PROBE "))
    return json.loads(line.removeprefix("PROBE "))


@pytest.mark.parametrize("kind", ["engine-process", "api-server"])
def test_server_patches_only_where_the_app_module_was_loaded(tmp_path, kind):
    trace = tmp_path / "trace.txt"
    result = _probe(kind, trace)
    lines = trace.read_text().splitlines()
    assert len(lines) == (2 if kind == "api-server" else 1), lines
    assert lines[0].endswith(" registered")
    if kind == "api-server":
        # Checked (a mismatch would have raised), imported and patched.
        assert result["wrapped"] is True
        assert "vllm.entrypoints.launchers.app" in result["server_modules"]
        assert lines[1].endswith(" api-server")
    else:
        assert result == {"server_modules": [], "wrapped": False}


def test_compatibility_check_without_server_seams_imports_no_server_module():
    code = (
        "import sys; from obcache_vllm.vllm_ext import install as i; "
        "i.check_compatibility(include_server=False); "
        "print(sorted(m for m in sys.modules if m == i.API_SERVER_MODULE "
        "or m.endswith('.serving') or m.endswith('async_llm')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
