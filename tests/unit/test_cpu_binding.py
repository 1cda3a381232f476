"""obcache_vllm.cpu_binding: VLLM_CPU_OMP_THREADS_BIND applied to an in-process engine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from obcache_vllm.cpu_binding import parse_cores


@pytest.mark.parametrize(
    ("value", "cores"),
    [("0", {0}), ("1", {1}), ("0-3", {0, 1, 2, 3}), ("0,2", {0, 2}), ("0-1,4", {0, 1, 4}),
     ("0-1|2-3", {0, 1}), (" 1 ", {1})],
)  # fmt: skip
def test_cores_of_the_first_rank(value, cores):
    assert parse_cores(value) == cores


@pytest.mark.parametrize("value", ["", "auto", "all", "nobind"])
def test_values_that_bind_nothing(value):
    assert parse_cores(value) is None


@pytest.mark.parametrize("value", ["x", "0-", "1-a", ",", "0;1"])
def test_a_malformed_value_names_the_variable(value):
    with pytest.raises(ValueError, match="VLLM_CPU_OMP_THREADS_BIND"):
        parse_cores(value)


def test_a_process_keeps_to_the_core_with_one_thread():
    """In a fresh process (affinity and torch's pool are per process): one core, one thread."""
    core = min(os.sched_getaffinity(0))
    code = (
        "import os, torch\n"
        "from obcache_vllm.cpu_binding import bind_in_process\n"
        "print(sorted(bind_in_process()), sorted(os.sched_getaffinity(0)), "
        "torch.get_num_threads())\n"
    )
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split("\n")[0]  # fmt: skip
    assert out == f"[{core}] [{core}] 1"
