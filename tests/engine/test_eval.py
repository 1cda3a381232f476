"""The accuracy harness end to end on the real engine: cells computed, evicted, resumed."""

from __future__ import annotations

import json

from obcache_vllm.evidence.eval.cells import Cell, load_results
from obcache_vllm.evidence.eval.harness import Harness

SAMPLES = 3


def _cells(settings):
    common = dict(task="niah_single", length=256, samples=SAMPLES, seed=0, chat=True)
    cells = [Cell(setting="full", pipeline="full", scorer="-", budget=1.0, **common)]
    cells += [
        Cell(setting=s, pipeline="tova", scorer="obcache_key", budget=0.5, **common)
        for s in settings
    ]
    # One ranking per layer (kv_per_head: false), as kvpress's TOVA selects.
    cells.append(Cell(setting="query_aware", pipeline="tova", scorer="attn", budget=0.5,
                      per_head=False, **common))  # fmt: skip
    return cells


def test_harness_runs_cells_through_the_engine_and_resumes(engine, model_path, tmp_path):
    settings = ["query_aware", "query_agnostic"]  # query-agnostic: kv_compress_at
    cells = _cells(settings)
    results = tmp_path / "results.jsonl"
    harness = Harness(results, model=str(model_path), llm=engine.llm, progress=False)
    evictions = engine.scheduler.obcache_totals.evictions

    written = harness.run(cells)

    assert [Cell(**r["cell"]) for r in written] == cells
    full, *evicted = written
    # Every budgeted request was compressed inside the engine (one eviction each).
    assert engine.scheduler.obcache_totals.evictions - evictions == SAMPLES * len(evicted)
    # A 256-token needle is easy for the full cache: the answer is found.
    assert full["accuracy"] >= 2 / 3, full["outputs"]
    assert full["kept_tokens_mean"] == full["prompt_tokens_mean"]
    for record in evicted:
        assert len(record["scores"]) == SAMPLES and all(s in (0.0, 1.0) for s in record["scores"])
        doc = record["document_tokens_mean"]
        assert 0.5 * doc <= record["kept_tokens_mean"] < record["prompt_tokens_mean"]
    lines = results.read_text().splitlines()
    assert [json.loads(line)["cell"]["setting"] for line in lines] == [
        "full", *settings, "query_aware",
    ]  # fmt: skip
    assert written[-1]["cell"]["per_head"] is False

    # Resume: a second run (a new harness on the same file) computes nothing.
    again = Harness(results, model=str(model_path), llm=engine.llm, progress=False)
    assert again.pending(cells) == []
    assert again.run(cells) == []
    assert engine.scheduler.obcache_totals.evictions - evictions == SAMPLES * len(evicted)
    assert results.read_text().splitlines() == lines
    assert set(load_results(results)) == {c.key for c in cells}
