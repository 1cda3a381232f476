"""Accuracy evaluation, pure parts: task generation, answer checking, cells, results, report."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict

import pytest

from obcache_vllm.evidence.eval import grid, report, tasks
from obcache_vllm.evidence.eval.cells import Cell, append_result, kept_tokens, load_results


@pytest.mark.parametrize("task", tasks.TASK_NAMES)
def test_generation_is_deterministic_and_seeded(task):
    a = tasks.generate(task, 512, 3, seed=0)
    assert a == tasks.generate(task, 512, 3, seed=0)
    assert a != tasks.generate(task, 512, 3, seed=1)
    assert len({s.context for s in a}) == 3  # samples differ from each other


@pytest.mark.parametrize("task", tasks.TASK_NAMES)
def test_answers_are_in_the_context_and_not_in_the_question(task):
    for s in tasks.generate(task, 1024, 5, seed=3):
        for answer in s.answers:
            assert answer in s.context
            assert answer not in s.question + s.answer_prefix
        # Nominal length: about TOKENS_PER_SENTENCE characters-per-token-free estimate.
        words = len(s.context.split())
        assert 0.4 * 1024 < words < 1.2 * 1024


def test_multikey_asks_one_of_several_keys():
    s = tasks.niah_multikey(512, 0, 0, num_keys=4)
    needles = re.findall(r"special magic numbers for (\S+) is: (\d+)", s.context)
    assert len(needles) == 4 and len({k for k, _ in needles}) == 4
    (asked,) = [k for k, _ in needles if k in s.question]
    assert dict(needles)[asked] == s.answers[0]


def test_multivalue_has_all_values_for_one_key():
    s = tasks.niah_multivalue(512, 0, 0, num_values=4)
    needles = re.findall(r"special magic numbers for (\S+) is: (\d+)", s.context)
    assert {k for k, _ in needles} == {s.question.split(" for ")[1].split()[0]}
    assert sorted(v for _, v in needles) == sorted(s.answers)


def test_variable_tracking_chain_is_in_order():
    s = tasks.variable_tracking(512, 0, 0, hops=4)
    first = re.search(r"VAR (\w+) = (\d+)\.", s.context)
    assert first.group(1) == s.answers[0] and first.group(2) in s.question
    positions = [s.context.index(f"VAR {name} =") for name in s.answers]
    assert positions == sorted(positions)
    for prev, name in zip(s.answers, s.answers[1:], strict=False):
        assert f"VAR {name} = VAR {prev}." in s.context


def test_score_counts_found_answers():
    s = tasks.Sample("t", 0, 0, "ctx", "q?", "A:", ("123", "456"))
    assert tasks.score(s, " 123 and 456.") == 1.0
    assert tasks.score(s, " 123 only") == 0.5
    assert tasks.score(s, " nothing") == 0.0
    vt = tasks.Sample("vt", 0, 0, "ctx", "q?", "A:", ("ABCDE",))
    assert tasks.score(vt, "abcde") == 1.0  # case-insensitive


def test_render_splits_document_from_question():
    s = tasks.generate("niah_single", 256, 1, 0)[0]
    doc, question = tasks.render(s)
    assert doc == s.context and s.question in question and question.endswith(s.answer_prefix)

    def template(user):
        return f"<user>{user}</user><assistant>"

    doc, question = tasks.render(s, template)
    assert doc == "<user>" + s.context
    assert question == f"\n\n{s.question}</user><assistant>{s.answer_prefix}"
    with pytest.raises(ValueError, match="dropped"):
        tasks.render(s, lambda user: "nothing")


def test_sample_json_round_trip():
    s = tasks.generate("vt", 256, 1, 0)[0]
    assert tasks.Sample.from_json(json.loads(json.dumps(s.to_json()))) == s


def test_unknown_task_is_refused():
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        tasks.generate("nope", 512, 1, 0)


# --- cells and the results file ----------------------------------------------------------------


def _cell(**kw):
    base = dict(task="niah_single", length=512, setting="query_aware", pipeline="snapkv",
                scorer="obcache_key", budget=0.2, samples=4, seed=0, chat=True, window=16)
    return Cell(**{**base, **kw})  # fmt: skip


def test_cell_extra_args_per_setting():
    aware = _cell()
    assert aware.extra_args(500) == {
        "kv_budget": 100, "kv_pipeline": "snapkv", "kv_scorer": "obcache_key", "kv_window": 16,
    }  # fmt: skip
    agnostic = _cell(setting="query_agnostic")
    assert agnostic.extra_args(500)["kv_compress_at"] == 500
    assert _cell(pipeline="streaming", scorer="-", window=0).extra_args(500) == {
        "kv_budget": 100, "kv_pipeline": "streaming",
    }  # fmt: skip
    assert _cell(setting="full", pipeline="full", scorer="-", budget=1.0).extra_args(500) is None
    assert aware.method == "snapkv/obcache_key+w16"
    shared = _cell(pipeline="tova", window=0, per_head=False)
    assert shared.extra_args(500)["kv_per_head"] is False
    assert "kv_per_head" not in aware.extra_args(500)
    assert shared.method == "tova/obcache_key/shared"
    assert shared.key != _cell(pipeline="tova", window=0).key


def test_cell_validation():
    with pytest.raises(ValueError, match="setting"):
        _cell(setting="sometimes")
    with pytest.raises(ValueError, match="full cache"):
        _cell(setting="full")
    with pytest.raises(ValueError, match="budget"):
        _cell(budget=0.0)
    with pytest.raises(ValueError, match="ranks nothing"):
        _cell(pipeline="streaming", scorer="-", window=0, per_head=False)


def test_kept_tokens_follows_the_block_rule():
    for compressed, budget in [(600, 60), (600, 590), (1000, 301), (64, 40)]:
        kept = kept_tokens(compressed, budget, 32)
        if compressed - budget < 32:
            assert kept == compressed
        else:
            assert budget <= kept < budget + 32 and (compressed - kept) % 32 == 0


def test_results_file_resumes_and_ignores_a_torn_line(tmp_path):
    path = tmp_path / "r.jsonl"
    a, b = _cell(), _cell(budget=0.5)
    append_result(path, a, {"accuracy": 1.0, "scores": [1.0]})
    append_result(path, b, {"accuracy": 0.0, "scores": [0.0]})
    with path.open("a") as f:
        f.write('{"cell": {"task"')  # an interrupted write
    done = load_results(path)
    assert set(done) == {a.key, b.key}
    assert done[b.key]["accuracy"] == 0.0
    assert a.key != _cell(samples=5).key != _cell(chat=False).key


def test_grid_counts_streaming_once_and_windows_for_snapkv_only():
    cells = grid.grid(tasks=["niah_single"], lengths=[512, 1024], samples=2, seed=0, chat=True,
                      windows=(16, 64))  # fmt: skip
    n = len(grid.SCORERS)
    per_task_length = 1 + 2 * 4 * (n * 2 + n + n + 1)  # full + settings x budgets x methods
    assert len(cells) == 2 * per_task_length
    assert len({c.key for c in cells}) == len(cells)
    assert all(c.scorer == "-" for c in cells if c.pipeline == "streaming")


def test_grid_per_head_multiplies_ranked_cells_and_kvpress_follows_its_presses():
    common = dict(tasks=["niah_single"], lengths=[512], samples=2, seed=0, chat=True,
                  budgets=[0.5], settings=["query_aware"], scorers=["attn"], full=False)
    both = grid.grid(per_heads=(True, False), **common)
    assert len(both) == 3 * 2 + 1  # snapkv, h2o, tova twice; streaming once
    assert {c.per_head for c in both if c.pipeline == "streaming"} == {True}
    kvpress = grid.grid(per_heads=(True, False), engine="kvpress", **common)
    assert {c.pipeline: c.per_head for c in kvpress} == {
        "snapkv": True, "h2o": True, "tova": False, "streaming": True,
    }  # fmt: skip


# --- report ------------------------------------------------------------------------------------


def test_wilson_interval_known_values():
    lo, hi = report.wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-3) and hi == pytest.approx(0.9433, abs=1e-3)
    assert report.wilson(0, 20)[0] == 0.0 and report.wilson(20, 20)[1] == pytest.approx(1.0)
    lo, hi = report.wilson(50, 100)
    assert (lo + hi) / 2 == pytest.approx(0.5) and hi - lo == pytest.approx(0.19, abs=0.01)


def test_bootstrap_interval_brackets_the_mean_and_is_deterministic():
    scores = [0.0, 0.25, 0.5, 0.75, 1.0] * 8
    lo, hi = report.bootstrap(scores)
    assert lo < 0.5 < hi and (lo, hi) == report.bootstrap(scores)
    assert report.interval([1.0, 0.0, 1.0]) == report.wilson(2, 3)
    assert report.interval([0.5, 1.0]) == report.bootstrap([0.5, 1.0])


def test_paired_difference_known_values():
    d = report.paired_difference([0, 0, 0, 0, 1], [1, 1, 1, 0, 0])
    assert d["difference"] == pytest.approx(0.4)
    assert (d["better"], d["worse"]) == (3, 1)
    assert d["p_sign"] == pytest.approx(2 * (1 + 4) / 16)  # P(X <= 1), X ~ Bin(4, 1/2), twice
    lo, hi = d["ci95"]
    assert -1 <= lo <= 0.4 <= hi <= 1
    same = report.paired_difference([1, 0, 1], [1, 0, 1])
    assert same["difference"] == 0 and same["p_sign"] == 1.0 and same["ci95"] == (0, 0)
    with pytest.raises(ValueError):
        report.paired_difference([1], [1, 0])


def test_write_report(tmp_path):
    path = tmp_path / "results.jsonl"
    full = Cell("niah_single", 512, "full", "full", "-", 1.0, 10, 0, True)
    append_result(path, full, _record([1.0] * 9 + [0.0]))
    for budget, acc in [(0.2, 3), (0.5, 8)]:
        scores = [1.0] * acc + [0.0] * (10 - acc)
        append_result(path, _cell(budget=budget, samples=10), _record(scores))
    paths = report.write_report(tmp_path)
    rows = json.loads((tmp_path / "results.json").read_text())
    assert len(rows) == 3
    row = next(r for r in rows if r["budget"] == 0.5)
    assert row["accuracy"] == 0.8 and row["ci95"] == [round(x, 4) for x in report.wilson(8, 10)]
    md = (tmp_path / "RESULTS.md").read_text()
    assert "| snapkv/obcache_key+w16 | 0.30 [0.11, 0.60] | 0.80 [0.49, 0.94] |" in md
    assert "| vllm | niah_single | 512 | 600 | 10 | 0.90 [0.60, 0.98] |" in md
    png = tmp_path / "vllm_niah_single_512.png"
    assert png in paths and png.read_bytes()[:4] == b"\x89PNG"


def _record(scores):
    return {"accuracy": sum(scores) / len(scores), "scores": scores, "outputs": [""] * len(scores),
            "document_tokens_mean": 600.0, "kept_tokens_mean": math.nan}  # fmt: skip


def test_tables_show_the_largest_run_and_comparison_pairs_equal_samples(tmp_path):
    path = tmp_path / "results.jsonl"
    for n, hits in [(8, 4), (12, 9)]:
        append_result(path, _cell(samples=n), _record([1.0] * hits + [0.0] * (n - hits)))
    append_result(path, _cell(samples=8, engine="kvpress"), _record([1.0] * 5 + [0.0] * 3))
    report.write_report(tmp_path)
    md = (tmp_path / "RESULTS.md").read_text()
    assert "| snapkv/obcache_key+w16 | 0.75 [0.47, 0.91] |" in md  # n = 12 in the vllm table
    assert "| 20% | 8 | nan | 0.50 [0.22, 0.78] | 0.62 [0.31, 0.86] | -0.12 [" in md  # n = 8 pairs


def test_report_reads_records_written_before_per_head_existed(tmp_path):
    old = {k: v for k, v in asdict(_cell(samples=2)).items() if k != "per_head"}
    (tmp_path / "results.jsonl").write_text(json.dumps({"cell": old, **_record([1.0, 0.0])}))
    report.write_report(tmp_path)
    (row,) = json.loads((tmp_path / "results.json").read_text())
    assert row["per_head"] is True and row["method"] == "snapkv/obcache_key+w16"


def test_report_pairs_scorers_with_attn_on_the_same_samples(tmp_path):
    path = tmp_path / "results.jsonl"
    append_result(path, _cell(scorer="attn", samples=4), _record([0.0, 0.0, 1.0, 1.0]))
    append_result(path, _cell(samples=4), _record([1.0, 1.0, 1.0, 0.0]))
    append_result(path, _cell(samples=4, window=64), _record([1.0] * 4))  # no attn partner
    report.write_report(tmp_path)
    md = (tmp_path / "RESULTS.md").read_text()
    lines = [line for line in md.splitlines() if "| obcache_key | 0.75 | 0.50 |" in line]
    assert len(lines) == 1 and "snapkv+w16" in lines[0] and "| 2 / 1 |" in lines[0], md


def test_prefill_evict_cells_send_the_option_and_are_named_apart():
    from obcache_vllm.evidence.eval.cells import Cell
    from obcache_vllm.evidence.eval.grid import grid

    cells = grid(tasks=["niah_single"], lengths=[2048], samples=4, seed=0, chat=True,
                 pipelines=["snapkv", "streaming"], scorers=["attn"], budgets=[0.1],
                 settings=["query_aware"], windows=[1], prefill_evicts=[False, True])
    evicting = [c for c in cells if c.pipeline != "full"]
    assert len(evicting) == 4 and sum(c.prefill_evict for c in evicting) == 2
    pe = next(c for c in evicting if c.prefill_evict and c.pipeline == "snapkv")
    assert pe.extra_args(1000)["kv_prefill_evict"] is True and pe.method.endswith("+pe")
    plain = next(c for c in evicting if not c.prefill_evict and c.pipeline == "snapkv")
    assert "kv_prefill_evict" not in plain.extra_args(1000) and pe.key != plain.key
    with pytest.raises(ValueError, match="prefill_evict"):
        Cell("niah_single", 512, "full", "full", "-", 1.0, 4, 0, True, prefill_evict=True)


def test_session_conversations_ask_for_facts_they_state() -> None:
    from obcache_vllm.evidence.eval import sessions

    conv = sessions.conversation(3)
    assert conv == sessions.conversation(3)  # seeded
    system_facts, turn_facts = conv.facts[:2], conv.facts[2:]
    assert all(f.statement.rstrip(".") in conv.system for f in system_facts)
    assert all(f.statement in conv.first_turn for f in turn_facts)
    assert [conv.question(t)[1] for t in (2, 3, 4, 5)] == list(conv.facts)
    answers = [sessions.Answer("a", 0, 2, "1234", "It is 1234.", True, None),
               sessions.Answer("a", 0, 4, "5678", "no idea", False, None)]
    table = sessions.table(answers, 4)
    assert "| a | **0.50** (n=2) | 1.00 | 0.00 | 0.00 |" in table
    assert "| a | 1.00 (n=1) | 0.00 (n=1) |" in table  # turn 2: system text; turn 4: first turn


def test_report_pairs_adakv_with_snapkv_at_the_same_scorer_and_budget(tmp_path):
    path = tmp_path / "results.jsonl"
    append_result(path, _cell(samples=4), _record([0.0, 0.0, 1.0, 0.0]))  # snapkv
    append_result(path, _cell(pipeline="adakv", samples=4), _record([1.0, 1.0, 1.0, 0.0]))
    append_result(path, _cell(pipeline="adakv", samples=4, budget=0.3), _record([1.0] * 4))
    report.write_report(tmp_path)
    md = (tmp_path / "RESULTS.md").read_text()
    section = md.split("## Reallocations against their uniform host")[1]
    lines = [line for line in section.splitlines() if "| adakv |" in line]
    assert len(lines) == 1 and "| 0.75 | 0.25 | +0.50" in lines[0] and "| 2 / 0 |" in lines[0]


def test_the_kvpress_venv_is_where_its_setup_script_puts_it(monkeypatch):
    """``obcache-vllm eval kvpress`` looks for the venv where ``scripts/kvpress_venv.sh``
    creates it by default (the checkout's parent's ``venvs/kvpress``)."""
    from pathlib import Path

    from obcache_vllm.evidence.eval import kvpress_bridge

    monkeypatch.delenv("KVPRESS_PYTHON", raising=False)
    root = Path(__file__).resolve().parents[2]
    script = (root / "scripts" / "kvpress_venv.sh").read_text()
    assert '"${1:-${KVPRESS_VENV:-$here/../venvs/kvpress}}"' in script
    assert Path(kvpress_bridge.default_python()) == root.parent / "venvs/kvpress/bin/python"


def test_kvpress_requests_name_their_rule_and_only_snapkv_has_ours():
    from obcache_vllm.evidence.eval import kvpress_bridge
    from obcache_vllm.evidence.eval.harness import Prompt

    cell = _cell(pipeline="snapkv", scorer="attn", window=32, budget=0.1, engine="kvpress")
    prompt = Prompt(sample=None, document_ids=tuple(range(260)), question_ids=tuple(range(40)))
    assert kvpress_bridge.kvpress_request(cell, prompt, "0")["rule"] == "kvpress"
    request = kvpress_bridge.kvpress_request(cell, prompt, "0", "obcache")
    assert (request["rule"], request["window"], request["compress"]) == ("obcache", 32, 300)
    with pytest.raises(SystemExit, match="no kvpress rule"):
        kvpress_bridge.run_kvpress([cell], None, rule="ours", python=__file__)
