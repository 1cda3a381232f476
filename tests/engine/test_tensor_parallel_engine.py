"""The plugin in vLLM's real tensor-parallel engine on CPU: TP=3, the default model's 3 KV heads.

The TP=3 engine runs in a subprocess (tests/support/probes/tp_probe.py): EngineCore in the
probe, three ranks as vLLM's multiprocessing workers (gloo), ``VLLM_CPU_OMP_THREADS_BIND=
nobind`` (what ``obcache-vllm serve --tensor-parallel-size N`` sets). One batch of budgeted
requests, greedy, one prompt each, covering every path that differs under TP:

* per-head ranking (``kv_per_head: true``): each rank ranks its own KV head, no communication;
* one ranking per layer (``kv_per_head: false``): the rank's head scores all-reduced over the
  TP group, so every rank keeps the same tokens;
* decode eviction (``kv_decode``): the same, every step;
* every pipeline (snapkv, tova, h2o, streaming), ``kv_compress_at`` and ``kv_prefill_evict``;
* a fault on one rank only (``obcache_fault: "score@1"``, the probe runs with
  ``OBCACHE_VLLM_FAULTS=1``): the request ends alike on every rank, counted once.

Checked against the session's single-process engine (TP=1, the same engine settings) on the
same prompts: the same tokens and the same scheduler outcome (evictions, freed blocks, kept
tokens), and rank r kept exactly the tokens the single process kept for KV head r, in every
layer; the pool whole after. (The all-reduces sum in another order than one process does, in
float32; on these requests the kept sets and tokens are identical, which the test asserts.)
"""

from __future__ import annotations

import sys

import pytest
from support.tp import COMPARED, KV, MAX_TOKENS, OUTCOME_KEYS, PROBE, prompts, run_probe

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1200)]

REQUESTS = {
    **COMPARED,
    # Rank 1 alone raises while scoring: ranks 0 and 2 compact every layer, rank 1 none. The
    # ranks agree before committing, so the request's cache is torn on all three alike (it ends
    # with an error, its blocks freed) and its neighbours are untouched. At TP=1 the fault
    # names a rank that does not exist and never fires.
    "fault_rank1": {**KV, "kv_per_head": True, "obcache_fault": "score@1"},
}
BUDGETED = list(COMPARED)


def _tp1(engine, prompts: dict) -> dict:
    """The same requests on the session engine, in one batch as in the probe."""
    from vllm import SamplingParams

    sys.path.insert(0, str(PROBE.parent))
    from tp_probe import records_of

    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             extra_args=kv) for kv in REQUESTS.values()]  # fmt: skip
    outs = engine.llm.generate([{"prompt_token_ids": prompts[n]} for n in REQUESTS], params,
                               use_tqdm=False)  # fmt: skip
    return {
        "tokens": {n: list(o.outputs[0].token_ids) for n, o in zip(REQUESTS, outs, strict=True)},
        "outcome": {n: (o.kv_transfer_params or {}).get("obcache")
                    for n, o in zip(REQUESTS, outs, strict=True)},  # fmt: skip
        "kept": records_of(engine.runner, last=len(REQUESTS)),  # this batch's, in arrival order
    }


@pytest.fixture(scope="module")
def runs(engine, engine_kwargs, tokenizer) -> dict[int, dict]:
    ids = prompts(tokenizer, REQUESTS)
    return {1: _tp1(engine, ids), 3: run_probe(3, engine_kwargs, ids, REQUESTS)}


def test_tensor_parallel_eviction_matches_the_single_process_engine(runs) -> None:
    one, three = runs[1], runs[3]
    for name in BUDGETED:
        assert three["tokens"][name] == one["tokens"][name], name
        assert three["finish"][name] == "length", name
        got, want = three["outcome"][name], one["outcome"][name]
        assert got["evictions"] >= 1 and got["freed_blocks"] >= 1, got
        for key in OUTCOME_KEYS:
            assert got[key] == want[key], (name, key, got, want)
    assert three["free_blocks"] == three["pool_blocks"] - 1  # vLLM's null block


def test_a_fault_on_one_rank_ends_the_request_on_every_rank_alike(runs) -> None:
    three = runs[3]
    assert three["finish"]["fault_rank1"] == "error"
    assert len(three["tokens"]["fault_rank1"]) < MAX_TOKENS
    # Counted once by the one scheduler, not once per rank (the metrics read these totals).
    assert sum(n for *_, n in three["failures"]) == 1, three["failures"]
    assert three["evictions"] == sum((o or {}).get("evictions", 0)
                                     for o in three["outcome"].values())  # fmt: skip


def test_each_rank_keeps_what_one_process_keeps_for_its_head(runs) -> None:
    one, ranks = runs[1]["kept"], runs[3]["kept"]
    assert len(ranks) == 3 and all(len(rank) == len(REQUESTS) for rank in ranks)
    for i, name in enumerate(BUDGETED):  # arrival order: the fault's request comes last
        layers = one[i]
        assert len(layers) == 30, name
        for layer, heads in layers.items():
            assert len(heads) == 3  # the model's 3 KV heads in one process
            for r, rank in enumerate(ranks):
                assert rank[i][layer] == [heads[r]], (name, layer, r)
