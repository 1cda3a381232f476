"""The pure parts of `obcache-vllm ppl`: text cleaning, documents, methods, bins, reports."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from obcache_vllm.admission import parse_kv_options
from obcache_vllm.evidence import perplexity as ppl


def test_clean_verses_drops_references_and_joins_wrapped_lines():
    raw = (
        "Ge1:1 In the beginning God created the heaven and the earth.\n"
        "Ge1:2 And the earth was without form,\n"
        "   and void.\n"
        "1Co13:4 Charity suffereth long.\n"
    )
    assert ppl.clean_verses(raw) == (
        "In the beginning God created the heaven and the earth. "
        "And the earth was without form, and void. Charity suffereth long."
    )
    assert ppl.clean_verses("Bad Book: 'nosuchbook 1:1-999:999'") == ""


def test_make_document_splits_prompt_and_forced_continuation():
    doc = ppl.make_document("d", list(range(100)), prompt_tokens=8, tokens=50)
    assert doc.prompt == tuple(range(8)) and doc.target == tuple(range(8, 58))
    with pytest.raises(ValueError, match="fewer than prompt 8 \\+ forced 93"):
        ppl.make_document("d", list(range(100)), prompt_tokens=8, tokens=93)


def test_methods_are_full_then_streaming_and_h2o_per_scorer_at_each_budget():
    ms = ppl.methods([256, 1024])
    names = [m.name for m in ms]
    assert names[0] == "full" and ms[0].kv is None
    assert len(ms) == 1 + 2 * 5
    assert "streaming@256" in names and "h2o+obcache_joint@1024" in names
    for m in ms[1:]:
        opts = parse_kv_options(m.kv, num_prompt_tokens=32, max_model_len=8192)
        assert opts.decode and opts.budget == m.budget and opts.sinks == ppl.SINKS
        if m.family == "streaming":
            assert opts.pipeline == "streaming" and opts.recent == m.budget - ppl.SINKS - 1
        else:
            assert opts.pipeline == "h2o" and opts.scorer in ppl.SCORED and opts.recent == 16
    with pytest.raises(ValueError, match="too small"):
        ppl.methods([16])
    quarter = ppl.methods([256], scorers=["attn"], recent_fraction=0.25)
    assert quarter[-1].kv["kv_recent"] == 64
    assert parse_kv_options(quarter[-1].kv, 32).recent == 64


def test_bins_are_aligned_on_absolute_positions_and_merge_over_documents():
    bins = ppl.bin_nll([-1.0, -2.0, -3.0, -4.0], start=3, width=2)
    # positions 3 | 4 5 | 6: bin 0 is empty (the prompt), bin 1 has position 3
    assert bins == [(0.0, 0), (1.0, 1), (5.0, 2), (4.0, 1)]
    merged = ppl.merge_bins([bins, [(1.0, 2)]], factor=2)
    assert merged == [[2.0, 3], [9.0, 3]]
    assert ppl.ppl(2.0, 2) == pytest.approx(math.e)
    assert math.isnan(ppl.ppl(0.0, 0))


def _fake_results(tmp_forced: int = 300) -> dict:
    ms = ppl.methods([64], scorers=["attn"])
    per = {}
    for i, m in enumerate(ms):
        lps = [-(1.0 + 0.1 * i + 0.001 * j) for j in range(tmp_forced)]
        per[m.name] = [{"document": "Doc", "bins": ppl.bin_nll(lps, start=32), "forced": 300,
                        "max_live_blocks": 3, "max_resident_tokens": 90, "evictions": 5}]
    return {
        "model_name": "tiny", "documents": [{"name": "Doc"}], "bin": ppl.BIN,
        "method_info": {m.name: {"budget": m.budget, "kv": m.kv} for m in ms},
        "methods": per,
    }


def test_summary_and_table_report_per_bin_and_overall_perplexity():
    results = _fake_results()
    summary = ppl.summarise(results, table_bin=128)
    assert list(summary) == ["full", "streaming@64", "h2o+attn@64"]
    full = summary["full"]
    assert full["tokens"] == 300 and len(full["bins"]) == 3  # positions 32..331
    assert full["bins"][0] == pytest.approx(math.exp(sum(1 + 0.001 * j for j in range(96)) / 96))
    assert summary["h2o+attn@64"]["overall"] > full["overall"]
    table = ppl.markdown_table(summary, 128).splitlines()
    assert table[0] == "| method | 0-128 | 128-256 | 256-384 | all |"
    assert table[2].startswith("| full | ") and len(table) == 5
    with pytest.raises(ValueError, match="multiple"):
        ppl.summarise(results, table_bin=100)


def test_paired_ratios_resample_the_same_positions_of_both_methods():
    """The paired interval: a method whose every token is 0.2 nats further from the text than
    the full cache's has a ratio of exp(0.2) with a zero-width interval (the units move
    together); a method equal to another has 1; methods forced over other positions are
    refused; the table compares with the floor and the rival at the method's own budget."""
    results = _fake_results()  # h2o+attn@64 is 0.2 nats a token above full, everywhere
    ratio, lo, hi = ppl.paired(results, "h2o+attn@64", "full")
    assert ratio == pytest.approx(math.exp(0.2)) and lo == pytest.approx(hi)
    assert ppl.paired(results, "full", "full") == (1.0, 1.0, 1.0)
    # Noise that is not shared: the interval widens and still holds the ratio.
    noisy = json.loads(json.dumps(results))
    for n, unit in enumerate(noisy["methods"]["streaming@64"][0]["bins"]):
        unit[0] += 5.0 * (-1) ** n
    ratio, lo, hi = ppl.paired(noisy, "streaming@64", "full")
    assert lo < ratio < hi and hi - lo > 0.01
    short = json.loads(json.dumps(results))
    short["methods"]["streaming@64"][0]["bins"].pop()
    with pytest.raises(ValueError, match="same positions"):
        ppl.paired(short, "streaming@64", "full")
    floor = json.loads(json.dumps(results))  # add the floor at 64, 0.1 nats below attn
    floor["methods"]["h2o+random@64"] = [
        {**d, "bins": [[s - 0.1 * c, c] for s, c in d["bins"]]}
        for d in floor["methods"]["h2o+attn@64"]]  # fmt: skip
    floor["method_info"]["h2o+random@64"] = {"budget": 64, "kv": {}}
    lines = ppl.paired_table(floor).splitlines()
    assert lines[0] == "| method | / full | / h2o+random |"
    row = next(line for line in lines if line.startswith("| h2o+attn@64 |"))
    assert f"| {math.exp(0.1):.3f} [" in row
    assert next(line for line in lines if line.startswith("| h2o+random@64 |")).endswith("|  |")


def test_write_reports_writes_json_table_and_png(tmp_path):
    table = ppl.write_reports(_fake_results(), tmp_path, table_bin=128)
    assert json.loads((tmp_path / "results.json").read_text())["bin"] == ppl.BIN
    assert (tmp_path / "table.md").read_text().strip() == table
    assert "| h2o+attn@64 | 1.221 [1.221, 1.221] |" in table  # the paired ratios follow
    assert (tmp_path / "ppl_vs_position.png").read_bytes()[:4] == b"\x89PNG"


def test_missing_bible_fails_with_an_install_hint(monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ppl.MissingTextError, match="apt-get install -y bible-kjv"):
        ppl.kjv_book("Genesis")
    assert ppl.main(["--docs", "1", "--tokens", "10"]) == 2
    assert "bible-kjv" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("bible") is None, reason="bible-kjv not installed")
def test_kjv_book_is_long_prose_and_unknown_books_are_refused():
    text = ppl.kjv_book("Genesis")
    assert text.startswith("In the beginning God created the heaven and the earth.")
    assert len(text.split()) > 30_000
    with pytest.raises(ppl.MissingTextError, match="book name"):
        ppl.kjv_book("Nosuchbook")


def test_the_rival_and_the_floor_are_scorers_the_command_runs():
    """`--scorers dropkv random` gives h2o methods with kvpress's DropKV score and the floor."""
    args = ppl._parser().parse_args(["--scorers", "attn", "dropkv", "random"])
    names = [m.name for m in ppl.methods([256], args.scorers)]
    assert names == ["full", "streaming@256", "h2o+attn@256", "h2o+dropkv@256", "h2o+random@256"]
    assert ppl.methods([256], ["dropkv"])[-1].kv["kv_scorer"] == "dropkv"
    with pytest.raises(SystemExit):
        ppl._parser().parse_args(["--scorers", "snapkv"])  # a pipeline, not a scorer
