"""The offline ``LLM`` and the server on the same request: the one deliberate difference is
their defaults for the kv_* fields a request leaves out.

The server fills them from its policy (the shipped ``obcache_vllm/default.yaml``, whose selection
for the default model a stated rule chooses: ``snapkv``, window 32); the offline engine, which
reads no server policy, from the options' own defaults (the paper's: ``snapkv``, a 64-query
window, per head). With every field spelled out the two are the same engine and give the same
tokens; with only ``kv_budget`` each reports the defaults it applied. (docs: "Every option".)
"""

from __future__ import annotations

import json
import subprocess
import sys

from support.engine import PROBES
from support.server import MODEL_NAME, POOL_BLOCKS, Server

from obcache_vllm import config
from obcache_vllm.options import OPTIONS
from obcache_vllm.textgen import haystack

NEW = 24


def _server_tokens(server: Server, prompt: list[int], fields: dict) -> tuple[list[int], dict]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **fields}  # fmt: skip
    code, reply = server.post_json("/v1/completions", body)
    assert code == 200, reply
    return reply["choices"][0]["token_ids"], reply["usage"]["obcache"]


def test_offline_and_server_differ_only_in_the_defaults_they_fill_in(server, model_path):
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(str(model_path))(haystack(16, seed=61)).input_ids
    shipped = {k: v for k, v in config.load_defaults({}).items()
               if k != "kv_budget" and v is not None}  # fmt: skip
    built_in = {spec.field: spec.default for spec in OPTIONS if spec.field in shipped}
    assert shipped != built_in  # the difference this test is about (if it goes, so can it)
    only_budget = {"kv_budget": 128}
    spelled_out = {**only_budget, **shipped}
    on_server = [_server_tokens(server, prompt, f) for f in (only_budget, spelled_out)]
    engine = {"model": str(model_path), "dtype": "float32", "enforce_eager": True,
              "block_size": 32, "max_model_len": 2048, "num_gpu_blocks_override": POOL_BLOCKS,
              "max_num_seqs": 8, "max_num_batched_tokens": 512, "seed": 0}  # fmt: skip
    spec = {"engine": engine, "prompt": prompt, "max_tokens": NEW,
            "requests": [only_budget, spelled_out]}  # fmt: skip
    proc = subprocess.run([sys.executable, str(PROBES / "offline_probe.py"), json.dumps(spec)],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    line = [x for x in proc.stdout.splitlines() if x.startswith("OFFLINE_PROBE ")]
    assert line, proc.stderr[-3000:]
    offline = json.loads(line[-1].removeprefix("OFFLINE_PROBE "))
    # Every field spelled out: the same request, the same tokens and options.
    assert offline[1]["tokens"] == on_server[1][0]
    assert offline[1]["usage"]["pipeline"] == on_server[1][1]["pipeline"] == shipped["kv_pipeline"]
    # Only a budget: the server applies its shipped file (as spelled out), offline the table's.
    same = ("pipeline", "scorer", "budget", "prompt_tokens_kept", "evicted_tokens")
    assert on_server[0][0] == on_server[1][0]
    assert {k: on_server[0][1][k] for k in same} == {k: on_server[1][1][k] for k in same}
    assert offline[0]["usage"]["pipeline"] == built_in["kv_pipeline"]
    assert offline[0]["usage"]["scorer"] == built_in["kv_scorer"]
