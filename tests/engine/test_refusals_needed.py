"""Refusals this machine can run, shown to be still needed: the same engine with the refusal
lifted (``pool_runner.py``'s ``"lift"``) serves the budgeted request wrongly. Tiny random-weight
models written locally (``obcache_vllm/evidence/architectures.py``), one fresh engine each.

* a sliding window in every layer (Mistral-style): the scheduler's first order meets blocks
  vLLM's window manager already took (a fault: nothing evicted) and the request's tokens
  differ from the same prompt's without a budget (seen);
* MLA (DeepSeek-V2 layout): vLLM's MLA backend is not obcache's, so no layer compacts (a fault:
  the order is not applied) and the tokens differ likewise (seen);
* a ``--scheduler-cls`` that is not obcache's: the budget is silently ignored (the request
  holds every block of its prompt and reports no outcome);
* a session on an interleaved sliding-window model (Gemma 2 layout): the next turn continues
  nothing (no compressed entry is left on several KV-cache groups).

Speculative decoding's refusal is shown in ``test_spec_decode.py``, streaming inputs' in the
scheduler harness (``tests/vllm/test_scheduler_sim.py -k streaming``). Not runnable here: Mamba
layers (vLLM's CPU build lacks ``selective_scan_fwd``), the V2 model runner (Triton), async
scheduling (off on vLLM's CPU platform), context parallelism.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.arch import BUDGETED, ENGINE, NEW_TOKENS
from support.engine import run_pool

from obcache_vllm.evidence.architectures import BY_NAME, write_model
from obcache_vllm.textgen import haystack

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

SUPPORT = str(Path(__file__).resolve().parents[1] / "support")  # plain_scheduler.py


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer(haystack(40, seed=5)).input_ids[:640]


def _lifted(model_dir, prompt, lift, engine=None, env=None, requests=None) -> dict:
    requests = requests or [
        {"id": "plain", "prompt_token_ids": prompt, "max_tokens": NEW_TOKENS},
        {"id": "budget", "prompt_token_ids": prompt, "max_tokens": NEW_TOKENS,
         "extra_args": BUDGETED},
    ]  # fmt: skip
    spec = {"engine": {"model": str(model_dir), **ENGINE, **(engine or {})},
            "requests": requests, "lift": lift}  # fmt: skip
    core = sorted(os.sched_getaffinity(0))[0]
    return run_pool(spec, False, core, {"OBCACHE_VLLM_VERIFY": "1", **(env or {})}, timeout=600)


@pytest.mark.parametrize("name, engine, fault", [
    ("mistral-window", {}, "schedule: BlockNotWritableError"),
    ("deepseek-mla", {"max_model_len": 1024}, "compact: not_applied"),
])  # fmt: skip
def test_a_budget_on_a_layout_admission_refuses_goes_wrong_when_let_through(
    name, engine, fault, prompt, model_path, tmp_path_factory
):
    model_dir = write_model(BY_NAME[name], tmp_path_factory.mktemp(name), model_path)
    out = _lifted(model_dir, prompt, ["config"], engine)
    plain, budget = out["results"]["plain"], out["results"]["budget"]
    outcome = budget["obcache"]
    print(f"\n{name}, refusal lifted: {outcome.get('fault')}; tokens as without a budget: "
          f"{budget['token_ids'] == plain['token_ids']}")  # fmt: skip
    assert outcome.get("fault") == fault and outcome["freed_blocks"] == 0, outcome


def test_a_foreign_scheduler_class_ignores_a_budget_when_let_through(prompt, model_path,
                                                                    tmp_path_factory):  # fmt: skip
    model_dir = write_model(BY_NAME["llama"], tmp_path_factory.mktemp("llama"), model_path)
    out = _lifted(model_dir, prompt, ["config"],
                  {"scheduler_cls": "plain_scheduler.PlainScheduler"},
                  {"PYTHONPATH": os.pathsep.join([SUPPORT, os.environ.get("PYTHONPATH", "")])})
    plain, budget = out["results"]["plain"], out["results"]["budget"]
    assert "obcache" not in budget, budget  # no eviction, no outcome: served as stock
    assert budget["peak_blocks"] == plain["peak_blocks"] == -(-len(prompt) // 32) + 1
    assert budget["token_ids"] == plain["token_ids"]


def test_a_session_on_an_interleaved_model_continues_nothing_when_let_through(
    prompt, model_path, tmp_path_factory
):
    """Turn 2 (turn 1's prompt and answer, then more) continues turn 1's compressed cache on
    the Llama layout, and nothing on the Gemma 2 layout with the refusal lifted."""
    session = {**BUDGETED, "kv_session": True}
    requests = [
        {"id": "turn1", "prompt_token_ids": prompt[:400], "max_tokens": 8, "extra_args": session},
        {"id": "turn2", "prompt_token_ids": prompt[400:], "max_tokens": 8, "extra_args": session,
         "after": "turn1", "continues": "turn1"},
    ]  # fmt: skip
    reused = {}
    for name, lift in (("llama", []), ("gemma2", ["hybrid"])):
        model_dir = write_model(BY_NAME[name], tmp_path_factory.mktemp(name), model_path)
        out = _lifted(model_dir, prompt, lift, requests=requests)
        turn1, turn2 = out["results"]["turn1"]["obcache"], out["results"]["turn2"]["obcache"]
        assert turn1["freed_blocks"] > 0, (name, turn1)  # the first turn was compressed
        reused[name] = turn2.get("reused_tokens", 0)
    assert reused["llama"] > 0 and reused["gemma2"] == 0, reused
