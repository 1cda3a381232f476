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
  nothing (no compressed entry is left on several KV-cache groups);
* KV-sharing layers (a Gemma 3n layout: the last two of six layers read an earlier layer's
  KV cache): the worker takes a sharing layer for a layer of its own, so the cache it reads is
  compacted a second time, by that layer's own selection; the kept sets in the layers that own
  their cache match the HF reference's and the tokens do not (seen);
* a KV connector that saves a finished request's blocks under its prompt's block hashes, as
  vLLM's offloading connectors and LMCache do (``support/block_store_connector.py``; those
  connectors do not run on vLLM's CPU build): after a budgeted request, the same prompt without
  a budget loads compacted blocks as its prompt's KV and its tokens change.

Speculative decoding's refusal is shown in ``test_spec_decode.py``, streaming inputs' in the
scheduler harness (``tests/vllm/test_scheduler_sim.py -k streaming``). Not runnable here: Mamba
layers (vLLM's CPU build lacks ``selective_scan_fwd``), the V2 model runner (Triton), async
scheduling (off on vLLM's CPU platform), context parallelism.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.arch import BS, BUDGETED, ENGINE, NEW_TOKENS
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


def _mla_engine() -> dict:
    """The MLA model's engine: float32 like the others, except on a host with AMX, where
    vLLM's CPU MLA path refused to start a float32 engine ("expect weight to be bfloat16,
    float16, int8, ...": seen on an Intel Xeon with amx_bf16, 2026-12-06; the AMD EPYC CI
    hosts ran it in float32), so bfloat16 there: the refusal this test measures is about the
    layout, not the dtype."""
    cpuinfo = Path("/proc/cpuinfo")
    amx = cpuinfo.exists() and "amx_bf16" in cpuinfo.read_text()
    return {"max_model_len": 1024, **({"dtype": "bfloat16"} if amx else {})}


@pytest.mark.parametrize("name, engine, fault", [
    ("mistral-window", {}, "schedule: BlockNotWritableError"),
    ("deepseek-mla", _mla_engine(), "compact: not_applied"),
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


def test_a_connector_hands_a_budgeted_requests_compacted_blocks_to_the_next_request(
    prompt, model_path, tmp_path_factory
):
    """The same prompt twice, the second once the connector has saved the first's blocks (a
    one-token request in between gives it the step), vLLM's prefix cache off so that the
    connector is where the second's hit comes from (as when the local cache has evicted the
    prompt). With the first unbudgeted (the control), the second loads all but its last block
    from the connector and gives the first's tokens. With the first budgeted (the refusal
    lifted), the blocks it saved are its compacted block table: null blocks where the head was
    freed, kept tokens from anywhere in the prompt in the rest, none where its hash says; the
    unbudgeted second request loads them as its prompt's KV and its tokens change. vLLM's
    ExampleConnector shows nothing of this: it saves during the first forward, before any
    eviction."""
    model_dir = write_model(BY_NAME["llama"], tmp_path_factory.mktemp("llama"), model_path)
    env = {"PYTHONPATH": os.pathsep.join([SUPPORT, os.environ.get("PYTHONPATH", "")])}
    results = {}
    for arm, first in (("control", {}), ("budget", {"extra_args": BUDGETED})):
        store = tmp_path_factory.mktemp(f"store-{arm}")
        connector = {"kv_connector": "BlockStoreConnector", "kv_role": "kv_both",
                     "kv_connector_module_path": "block_store_connector",
                     "kv_connector_extra_config": {"shared_storage_path": str(store)}}
        requests = [
            {"id": "first", "prompt_token_ids": prompt, "max_tokens": NEW_TOKENS, **first},
            {"id": "gap", "prompt_token_ids": prompt[:8], "max_tokens": 1, "after": "first"},
            {"id": "second", "prompt_token_ids": prompt, "max_tokens": NEW_TOKENS,
             "after": "gap"},
        ]  # fmt: skip
        engine = {"kv_transfer_config": connector, "enable_prefix_caching": False}
        out = _lifted(model_dir, prompt, ["config"], engine, env, requests)
        results[arm] = out["results"]
        assert out["free_at_end"] == out["pool_blocks"], out  # the held blocks came back
        assert len(list(store.iterdir())) == len(prompt) // 32, arm  # every full block saved
    control, budget = results["control"], results["budget"]
    loaded = (len(prompt) - 1) // 32 * 32
    assert control["second"]["cached_tokens"] == budget["second"]["cached_tokens"] == loaded
    assert control["second"]["token_ids"] == control["first"]["token_ids"]  # the connector
    assert budget["first"]["obcache"]["freed_blocks"] > 0, budget["first"]
    print(f"\nthe same prompt after a budgeted request, its KV from the connector: "
          f"{budget['second']['token_ids'][:8]}... against stock "
          f"{control['first']['token_ids'][:8]}...")  # fmt: skip
    assert budget["second"]["token_ids"] != control["first"]["token_ids"]


def test_kv_sharing_layers_compact_the_cache_they_read_a_second_time_when_let_through(
    prompt, model_path, tmp_path_factory
):
    """Gemma 3n's KV-sharing layers have no KV cache of their own: vLLM adds each to its
    target's KV-cache group, bound to the target's tensor. With the refusal lifted the worker
    indexes the sharing layer as a layer of its own: it records a selection there and compacts
    the target's cache again. Without a budget the engine and the HF reference agree (the
    reference is good on this layout); with one, the kept sets of the layers that own their
    cache agree with the reference's, and the tokens do not."""
    import torch

    from obcache_vllm.admission import parse_kv_options
    from obcache_vllm.evidence import hf_reference as ref

    model_dir = write_model(BY_NAME["gemma3n-shared"], tmp_path_factory.mktemp("g3n"), model_path)
    out = _lifted(model_dir, prompt, ["config"], env={"OBCACHE_VLLM_RECORD_KEEP": "1"})
    plain, budget = out["results"]["plain"], out["results"]["budget"]
    model, _ = ref.load_model(model_dir)
    full = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert plain["token_ids"] == full[0, len(prompt):].tolist()  # no budget: they agree
    want = ref.compress_and_generate(model, torch.tensor(prompt),
                                     parse_kv_options(BUDGETED, len(prompt)), BS, NEW_TOKENS)
    assert ref.evicting_layers(model) == (1, 3)  # layer 5 reads layer 3's cache
    kept = budget["kept"]
    for layer, rows in want.kept.items():  # the first compaction is the reference's
        assert [sorted(r) for r in kept[str(layer)]] == [sorted(r) for r in rows.tolist()]
    assert "5" in kept and kept["5"] != kept["3"]  # ... then the sharing layer's own
    print(f"\nKV-sharing, refusal lifted: {budget['token_ids'][:6]}... against the "
          f"reference's {want.token_ids[:6]}...")  # fmt: skip
    assert budget["obcache"]["freed_blocks"] > 0 and budget["token_ids"] != want.token_ids
