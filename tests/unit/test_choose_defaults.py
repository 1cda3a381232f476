"""The rule the shipped defaults are chosen by (scripts/choose_defaults.py), on made-up scores,
and the shipped file against the recorded decision."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("choose_defaults",
                                               ROOT / "scripts" / "choose_defaults.py")
choose_defaults = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(choose_defaults)

RULE = {"min_full": 0.2, "current": "cur", "floor": "rand", "rival": "rival",
        "candidates": {"cur": {"kv_pipeline": "tova"}, "good": {"kv_pipeline": "snapkv"},
                       "rival": {"kv_scorer": "dropkv"}, "rand": {"kv_scorer": "random"}}}
CELLS = (("niah", 1024), ("niah", 2048), ("hard", 1024))


def scores(**accuracy):
    """Per-document 0/1 scores, 40 documents a cell: the first round(acc * 40) are 1."""
    out = {}
    for arm, per_cell in accuracy.items():
        out[arm] = {c: {d: float(d < round(a * 40)) for d in range(40)}
                    for c, a in zip(CELLS, per_cell, strict=True)}  # fmt: skip
    return out


def test_a_clear_winner_replaces_the_current_setting():
    got = choose_defaults.choose(scores(full=(1, 1, 0.05), cur=(0.9, 0.5, 0), good=(0.95, 0.9, 0),
                                        rival=(0.9, 0.8, 0), rand=(0, 0, 0)), RULE)
    assert got["cells"] == [["niah", 1024], ["niah", 2048]]  # full below min_full: not counted
    assert (got["best"], got["winner"]) == ("good", "good")
    assert "cur" not in got["tied"]


def test_the_current_setting_stays_where_it_is_tied_with_the_best():
    got = choose_defaults.choose(scores(full=(1, 1, 1), cur=(0.9, 0.85, 0.5), good=(0.9, 0.9, 0.5),
                                        rival=(0.2, 0.2, 0.2), rand=(0, 0, 0)), RULE)
    assert got["best"] == "good" and "cur" in got["tied"] and got["winner"] == "cur"


def test_no_winner_where_the_floor_is_as_good_as_the_best():
    got = choose_defaults.choose(scores(full=(1, 1, 1), cur=(0.5, 0.5, 0.5), good=(0.55, 0.5, 0.5),
                                        rival=(0.5, 0.5, 0.5), rand=(0.5, 0.5, 0.5)), RULE)
    assert got["winner"] is None and "floor" in got["why"]


def test_the_rival_can_win():
    got = choose_defaults.choose(scores(full=(1, 1, 1), cur=(0.2, 0.2, 0.2), good=(0.5, 0.5, 0.5),
                                        rival=(1, 1, 1), rand=(0, 0, 0)), RULE)
    assert got["winner"] == "rival"


def test_the_winner_is_written_between_the_markers(tmp_path):
    path = tmp_path / "default.yaml"
    path.write_text(f"kv_budget: null\n{choose_defaults.BEGIN}\nkv_scorer: \"x\"\n"
                    f"{choose_defaults.END}\nkv_sinks: 4\n")  # fmt: skip
    choose_defaults.write_shipped({"kv_pipeline": "snapkv", "kv_window": 32, "kv_per_head": True,
                                   "kv_scorer": "attn"}, "good", path)  # fmt: skip
    assert yaml.safe_load(path.read_text()) == {
        "kv_budget": None, "kv_scorer": "attn", "kv_pipeline": "snapkv", "kv_window": 32,
        "kv_per_head": True, "kv_sinks": 4}  # fmt: skip


def test_the_shipped_defaults_are_the_recorded_winner():
    """obcache_vllm/default.yaml holds the winner of the last run of the rule (or, where that
    run found none, the setting it was judged against), field for field."""
    decision_path = ROOT / "results" / "choose-defaults" / "decision.json"
    if not decision_path.exists():
        pytest.fail("no results/choose-defaults/decision.json: run `make choose-defaults`")
    decision = json.loads(decision_path.read_text())
    rule = choose_defaults.load_rule()
    name = decision["winner"] or decision["current"]
    shipped = yaml.safe_load((ROOT / "obcache_vllm" / "default.yaml").read_text())
    for key, value in rule["candidates"][name].items():
        assert shipped[key] == value, (key, name)
    text = (ROOT / "obcache_vllm" / "default.yaml").read_text()
    assert f"# winner: {name} " in text


def test_the_shipped_query_agnostic_block_is_the_recorded_winner_of_the_kind_that_ships_it():
    """default.yaml's ``query_agnostic`` holds the last recorded winner of the traffic kind
    marked ``ships: query_agnostic`` (field for field, the block naming it); where that run
    found no winner the block ships what it shipped before."""
    rule = choose_defaults.load_rule()
    kind = choose_defaults.shipping_kind(rule)
    decision = json.loads((ROOT / "results" / "choose-defaults" / "decision.json").read_text())
    won = decision["traffic"].get(kind, {}).get("winner") if kind else None
    shipped = yaml.safe_load((ROOT / "obcache_vllm" / "default.yaml").read_text())
    if won is None:  # the block stays as it was: nothing, or one of the candidates
        kept = shipped[choose_defaults.AGNOSTIC_KEY]
        candidates = choose_defaults.traffic_rule(rule, kind, None)["candidates"].values()
        assert kept is None or kept in candidates, kept
        return
    fields = choose_defaults.traffic_rule(rule, kind, None)["candidates"][won]
    assert shipped[choose_defaults.AGNOSTIC_KEY] == fields
    assert choose_defaults.shipped_agnostic() == won


def test_the_kind_that_ships_is_judged_against_what_the_server_applies_and_written(tmp_path):
    """A kind marked ``ships: query_agnostic``: its current is the shipped block's winner (or
    the query-aware winner where none is shipped); --write puts its winner in the block, the
    query-aware winner in its own, and the report says it is shipped, not recommended."""
    rule = {**RULE, "budget": 0.1, "traffic": {
        "agnostic": {"ships": "query_agnostic", "fields": {"kv_compress_at": -96}},
        "other": {"fields": {"kv_compress_at": -32}}}}  # fmt: skip
    rule_path = tmp_path / "rule.yaml"
    rule_path.write_text(yaml.safe_dump(rule))
    shipped = tmp_path / "default.yaml"
    shipped.write_text(f"kv_budget: null\n{choose_defaults.BEGIN}\nkv_scorer: \"x\"\n"
                       f"{choose_defaults.END}\n{choose_defaults.AGNOSTIC_BEGIN}\n"
                       f"query_agnostic: null\n{choose_defaults.AGNOSTIC_END}\n")  # fmt: skip
    assert choose_defaults.shipped_agnostic(shipped) is None
    _lm_eval_json(tmp_path / "lm_eval.json", full=(1, 1, 1), cur=(0.2, 0.2, 0.2),
                  good=(0.9, 0.9, 0.9), rival=(0.5, 0.5, 0.5), rand=(0, 0, 0))
    for kind in ("agnostic", "other"):  # "rival" clearly best for both
        _lm_eval_json(tmp_path / kind / "lm_eval.json", full=(1, 1, 1), cur=(0.2, 0.2, 0.2),
                      good=(0.1, 0.1, 0.1), rival=(0.9, 0.9, 0.9), rand=(0, 0, 0))
    args = ["--rule", str(rule_path), "--report-only", str(tmp_path / "lm_eval.json"),
            "--shipped", str(shipped)]  # fmt: skip
    choose_defaults.main(args + ["--write"])
    decision = json.loads((tmp_path / "decision.json").read_text())
    assert decision["winner"] == "good"  # query-aware
    assert decision["traffic"]["agnostic"]["winner"] == "rival"
    got = yaml.safe_load(shipped.read_text())
    assert got["kv_pipeline"] == "snapkv" and got["query_agnostic"] == {"kv_scorer": "dropkv"}
    assert choose_defaults.shipped_agnostic(shipped) == "rival"
    report = (tmp_path / "DECISION.md").read_text()
    assert "Shipped for requests that set `kv_compress_at` to a position" in report
    assert "Recommended for other traffic: `kv_scorer: \"dropkv\"`" in report
    # Judged again with "rival" shipped: it is now the kind's current setting.
    kind_rule = choose_defaults.traffic_rule(rule, "agnostic", "good",
                                             choose_defaults.shipped_agnostic(shipped))
    assert kind_rule["current"] == "rival"
    assert choose_defaults.traffic_rule(rule, "other", "good", "rival")["current"] == "good"


def test_at_most_one_kind_ships_the_query_agnostic_block():
    rule = {"traffic": {k: {"ships": "query_agnostic", "fields": {}} for k in ("a", "b")}}
    with pytest.raises(SystemExit, match="more than one"):
        choose_defaults.shipping_kind(rule)


def _lm_eval_json(path: Path, **accuracy) -> None:
    """An lm_eval_grid result file holding ``scores(**accuracy)``."""
    runs = {arm: {"scores": {}} for arm in accuracy}
    for arm, per_cell in scores(**accuracy).items():
        for (task, length), docs in per_cell.items():
            runs[arm]["scores"].setdefault(task, {})[str(length)] = {str(d): v
                                                                     for d, v in docs.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": runs, "command": "made up", "model": "m",
                                "date": "d", "machine": "here", "seconds": 60}))  # fmt: skip


def test_each_traffic_kind_gets_its_own_winner_and_the_query_aware_one_is_shipped(tmp_path):
    """A traffic kind's evidence (OUT/KIND/lm_eval.json) is judged by the same rule with the
    shipped winner as its current setting; its winner is reported, not written."""
    rule = {**RULE, "budget": 0.1, "traffic": {"agnostic": {"fields": {"kv_compress_at": -96},
                                                            "lengths": [1024]}}}  # fmt: skip
    rule_path = tmp_path / "rule.yaml"
    rule_path.write_text(yaml.safe_dump(rule))
    _lm_eval_json(tmp_path / "lm_eval.json", full=(1, 1, 1), cur=(0.2, 0.2, 0.2),
                  good=(0.9, 0.9, 0.9), rival=(0.5, 0.5, 0.5), rand=(0, 0, 0))
    # Agnostic: "good" (shipped) is tied with the best, so it stays; "rival" is the best.
    _lm_eval_json(tmp_path / "agnostic" / "lm_eval.json", full=(1, 1, 1), cur=(0.2, 0.2, 0.2),
                  good=(0.6, 0.6, 0.6), rival=(0.62, 0.62, 0.62), rand=(0, 0, 0))
    choose_defaults.main(["--rule", str(rule_path), "--report-only",
                          str(tmp_path / "lm_eval.json"),
                          "--shipped", str(_shipped(tmp_path, None))])  # fmt: skip
    decision = json.loads((tmp_path / "decision.json").read_text())
    assert decision["winner"] == "good"
    agnostic = decision["traffic"]["agnostic"]
    assert (agnostic["best"], agnostic["winner"]) == ("rival", "good")
    assert "the current setting is tied" in agnostic["why"]
    report = (tmp_path / "DECISION.md").read_text()
    assert "### Agnostic traffic" in report and "`kv_compress_at: -96`" in report
    assert "Recommended for agnostic traffic: `kv_pipeline: \"snapkv\"`" in report


def test_a_traffic_kind_may_set_its_budget_and_add_candidates():
    rule = yaml.safe_load((ROOT / "configs" / "choose_defaults.yaml").read_text())
    kind = choose_defaults.traffic_rule(rule, "query_agnostic_30", "snapkv-w32-obcache_key")
    assert kind["budget"] == 0.3 and kind["current"] == "snapkv-w32-obcache_key"
    assert "streaming" in kind["candidates"] and "streaming" not in rule["candidates"]
    assert set(rule["candidates"]) < set(kind["candidates"])
    plain = choose_defaults.traffic_rule(rule, "query_agnostic", None)
    assert plain["budget"] == rule["budget"] and plain["candidates"] == rule["candidates"]


def _shipped(tmp_path: Path, winner: str | None) -> Path:
    """A default.yaml whose chosen block names ``winner`` (None: names none)."""
    path = tmp_path / "default.yaml"
    named = f"# winner: {winner} (results/choose-defaults/DECISION.md)\n" if winner else ""
    path.write_text(f"kv_budget: null\n{choose_defaults.BEGIN}\n{named}kv_scorer: \"x\"\n"
                    f"{choose_defaults.END}\n")  # fmt: skip
    return path


def test_a_new_run_is_judged_against_what_the_server_ships_not_a_stale_rule_line(tmp_path):
    """Step 4 keeps the setting the server ships when it is tied with the best: the one named
    in default.yaml's chosen block, whatever an old ``current:`` line of the rule says (it
    named the setting shipped before the last run); re-rendering a recorded decision keeps
    the current it was made against."""
    rule_path = tmp_path / "rule.yaml"
    rule_path.write_text(yaml.safe_dump({**RULE, "budget": 0.1}))  # says "cur", stale
    # "rival" is the best; "good" is tied with it; "cur" is not.
    _lm_eval_json(tmp_path / "lm_eval.json", full=(1, 1, 1), cur=(0.2, 0.2, 0.2),
                  good=(0.6, 0.6, 0.6), rival=(0.62, 0.62, 0.62), rand=(0, 0, 0))
    shipped = _shipped(tmp_path, "good")
    assert choose_defaults.shipped_query_aware(shipped) == "good"
    args = ["--rule", str(rule_path), "--report-only", str(tmp_path / "lm_eval.json"),
            "--shipped", str(shipped)]  # fmt: skip
    choose_defaults.main(args)
    decision = json.loads((tmp_path / "decision.json").read_text())
    assert (decision["current"], decision["best"], decision["winner"]) == ("good", "rival", "good")
    assert next(r for r in decision["rows"] if r["candidate"] == "good")["role"] == "current"
    # The recorded decision keeps its current when the shipped file has moved on since.
    _shipped(tmp_path, "rival")
    choose_defaults.main(args)
    again = json.loads((tmp_path / "decision.json").read_text())
    assert (again["current"], again["winner"]) == ("good", "good")
    # With no recorded decision, the shipped file's winner is the current.
    (tmp_path / "decision.json").unlink()
    choose_defaults.main(args)
    assert json.loads((tmp_path / "decision.json").read_text())["current"] == "rival"
    # A shipped setting the rule does not list cannot be kept by any evidence: refused.
    (tmp_path / "decision.json").unlink()
    _shipped(tmp_path, "gone")
    with pytest.raises(SystemExit, match="not a candidate"):
        choose_defaults.main(args)


def _kl(**per_candidate):
    """Step 3b's evidence: ``{candidate: {(length, kind): {prompt: KL}}}``, 6 prompts a cell,
    each candidate's KL its value plus a small per-prompt wobble shared by all (paired)."""
    cells = ((1024, "bible"), (1024, "chats"), (2048, "code"))
    return {name: {c: {f"{c[1]}-{i}": kl + 0.01 * i for i in range(6)} for c in cells}
            for name, kl in per_candidate.items()}  # fmt: skip


def test_fidelity_narrows_the_accuracy_tied_set_and_can_replace_the_current_setting():
    """Step 3b: accuracy first; among the tied, one clearly further from the full cache
    leaves the set, so the current setting stays only if it is still tied."""
    acc = scores(full=(1, 1, 1), cur=(0.6, 0.6, 0.6), good=(0.62, 0.62, 0.62),
                 rival=(0.2, 0.2, 0.2), rand=(0, 0, 0))  # fmt: skip
    # "cur" is tied with "good" on accuracy but clearly further on fidelity: "good" wins.
    decision = choose_defaults.choose(acc, RULE, _kl(cur=0.5, good=0.3, rival=0.1, rand=0.9))
    assert decision["tied"] == ["cur", "good"]
    assert decision["fidelity_best"] == "good" and decision["tied_after_fidelity"] == ["good"]
    assert decision["winner"] == "good" and "further from the full cache" in decision["why"]
    # The closest of all ("rival") is not tied on accuracy: fidelity never brings it in.
    rival = next(r for r in decision["rows"] if r["candidate"] == "rival")
    assert rival["kl"] < 0.2 and not rival["tied_after_fidelity"]
    # Tied on both: the current setting stays (no change without evidence).
    both = choose_defaults.choose(acc, RULE, _kl(cur=0.30, good=0.30, rival=0.1, rand=0.9))
    assert both["winner"] == "cur" and "accuracy and fidelity" in both["why"]
    # Without fidelity evidence the rule is steps 1-5 as before.
    assert choose_defaults.choose(acc, RULE)["winner"] == "cur"
    # The floor tied with the best still means no winner, whatever fidelity says.
    flat = scores(full=(1, 1, 1), cur=(0.1, 0.1, 0.1), good=(0.1, 0.1, 0.1),
                  rival=(0.1, 0.1, 0.1), rand=(0.1, 0.1, 0.1))  # fmt: skip
    assert choose_defaults.choose(flat, RULE, _kl(cur=0.5, good=0.3, rival=0.1,
                                                  rand=0.9))["winner"] is None  # fmt: skip


def _fidelity_json(path: Path, length: int, kl: dict[str, float]) -> None:
    """An ``eval fidelity --arms`` result: the candidates at 0.1, aware, two kinds."""
    samples = [{"name": f"{k}-{i}", "kind": k} for k in ("bible", "code") for i in range(6)]
    per_request = {f"{name}@0.1/aware": {s["name"]: {"kl": v + 0.001 * n}
                                         for n, s in enumerate(samples)}
                   for name, v in kl.items()}  # fmt: skip
    per_request["full"] = {s["name"]: {"kl": 0.0} for s in samples}
    path.mkdir(parents=True, exist_ok=True)
    (path / "fidelity.json").write_text(json.dumps({
        "command": f"obcache-vllm eval fidelity --prompt-tokens {length}", "date": "d",
        "seconds": 60, "samples": samples, "per_request": per_request}))  # fmt: skip


def test_the_command_reads_step_3b_evidence_per_length_and_reports_it(tmp_path):
    rule = {**RULE, "budget": 0.1, "fidelity": {"kinds": ["bible", "code"],
                                                "lengths": [1024, 2048], "samples": 6,
                                                "tokens": 32}}  # fmt: skip
    rule_path = tmp_path / "rule.yaml"
    rule_path.write_text(yaml.safe_dump(rule))
    _lm_eval_json(tmp_path / "lm_eval.json", full=(1, 1, 1), cur=(0.2, 0.2, 0.2),
                  good=(0.6, 0.6, 0.6), rival=(0.62, 0.62, 0.62), rand=(0, 0, 0))
    args = ["--rule", str(rule_path), "--report-only", str(tmp_path / "lm_eval.json"),
            "--shipped", str(_shipped(tmp_path, None))]  # fmt: skip
    choose_defaults.main(args)  # no fidelity recorded: accuracy alone, and the report says so
    decision = json.loads((tmp_path / "decision.json").read_text())
    assert decision["winner"] == "rival" and decision["fidelity_best"] is None
    assert "No fidelity evidence" in (tmp_path / "DECISION.md").read_text()
    (tmp_path / "decision.json").unlink()
    _fidelity_json(tmp_path / "fidelity-1024", 1024, {"cur": 0.5, "good": 0.2, "rival": 0.4,
                                                      "rand": 0.9})  # fmt: skip
    with pytest.raises(SystemExit, match="1024"):  # one length of two: refused
        choose_defaults.main(args)
    _fidelity_json(tmp_path / "fidelity-2048", 2048, {"cur": 0.6, "good": 0.3, "rival": 0.5,
                                                      "rand": 0.9})  # fmt: skip
    choose_defaults.main(args)
    decision = json.loads((tmp_path / "decision.json").read_text())
    assert (decision["best"], decision["fidelity_best"], decision["winner"]) == (
        "rival", "good", "good")
    report = (tmp_path / "DECISION.md").read_text()
    assert "Closest to the full cache of the tied: `good`" in report
    assert "`obcache-vllm eval fidelity --prompt-tokens 2048`" in report
    row = next(line for line in report.splitlines() if line.startswith("| rival |"))
    assert row.endswith("| 0.456 | +0.200 [+0.200, +0.200] | no |")  # mean KL over 4 cells


def test_the_4k_and_gemma3_checks_send_the_rules_candidates_unchanged():
    """configs/lm_eval_4k_arms.json (make lm-eval-4k, make lm-eval-gemma3) is a subset of the
    rule's candidates at the rule's budget, field for field: it cannot drift from them."""
    rule = choose_defaults.load_rule()
    arms = json.loads((ROOT / "configs" / "lm_eval_4k_arms.json").read_text())
    assert {rule["floor"], rule["rival"], choose_defaults.shipped_query_aware()} <= set(arms)
    for name, fields in arms.items():
        assert fields == {"kv_budget": rule["budget"], **rule["candidates"][name]}, name


def test_a_length_the_rule_gains_is_required_and_run_alone(tmp_path, monkeypatch):
    """A rule that gained a length is not applied to evidence without it (refused, naming the
    command that adds it); ``--lengths`` runs the query-aware evidence at only that length,
    added to the recorded run (lm_eval_grid's ``--add-lengths-to``), and step 3b's there
    only; a length the rule does not ask for, or with a traffic kind, is refused."""
    rule = {**RULE, "budget": 0.1, "lengths": [1024, 2048, 4096], "tasks": ["niah", "hard"],
            "limit": 40, "max_gen_toks": 48,
            "fidelity": {"kinds": ["bible"], "lengths": [1024, 4096], "samples": 6, "tokens": 32},
            "traffic": {"agnostic": {"fields": {"kv_compress_at": -96}, "lengths": [1024]}}}
    rule_path = tmp_path / "rule.yaml"
    rule_path.write_text(yaml.safe_dump(rule))
    _lm_eval_json(tmp_path / "lm_eval.json", full=(1, 1, 1), cur=(0.2, 0.2, 0.2),
                  good=(0.6, 0.6, 0.6), rival=(0.62, 0.62, 0.62), rand=(0, 0, 0))
    shipped = str(_shipped(tmp_path, "cur"))
    with pytest.raises(SystemExit, match=r"no evidence at \[4096\].*--lengths 4096"):
        choose_defaults.main(["--rule", str(rule_path), "--report-only",
                              str(tmp_path / "lm_eval.json"), "--shipped", shipped])
    base = ["--rule", str(rule_path), "--out", str(tmp_path), "--shipped", shipped]
    with pytest.raises(SystemExit, match="8192"):
        choose_defaults.main([*base, "--only", "query_aware", "--lengths", "8192"])
    with pytest.raises(SystemExit, match="--lengths"):
        choose_defaults.main([*base, "--only", "agnostic", "--lengths", "4096"])
    ran = []

    def run(cmd, **_):
        ran.append([str(c) for c in cmd])
        raise SystemExit("stop here")  # the command is what this test checks

    monkeypatch.setattr(choose_defaults.subprocess, "run", run)
    with pytest.raises(SystemExit, match="stop here"):
        choose_defaults.main([*base, "--only", "query_aware,fidelity", "--lengths", "4096"])
    (grid,) = ran
    assert grid[grid.index("--lengths") + 1] == "4096"
    assert grid[grid.index("--add-lengths-to") + 1] == str(tmp_path / "lm_eval.json")
    # Step 3b at the new length only (the rest of its evidence is read as recorded).
    ran.clear()
    with pytest.raises(SystemExit, match="stop here"):
        choose_defaults.main([*base, "--only", "fidelity", "--lengths", "4096"])
    (fidelity,) = ran
    assert fidelity[fidelity.index("--prompt-tokens") + 1] == "4096"
    monkeypatch.setattr(choose_defaults, "_run_fidelity", lambda *a: ran.append(a[2]))
    ran.clear()  # each length's evidence runs alone, then the rule wants them all
    with pytest.raises(SystemExit, match="no evidence at"):
        choose_defaults.main([*base, "--only", "fidelity", "--lengths", "4096"])
    assert ran == [4096]


def test_a_length_may_run_its_own_tasks_added_to_the_others(tmp_path, monkeypatch):
    """``tasks_at``: a length with its own tasks is its own lm_eval_grid run, added to the
    first (``--add-lengths-to``), in a whole run and with ``--lengths``."""
    rule = {**RULE, "budget": 0.1, "lengths": [1024, 2048, 4096], "tasks": ["niah", "hard"],
            "tasks_at": {4096: ["niah"]}, "limit": 20, "max_gen_toks": 48}
    rule_path = tmp_path / "rule.yaml"
    rule_path.write_text(yaml.safe_dump(rule))
    ran = []

    def run(cmd, **_):
        cmd = [str(c) for c in cmd]
        ran.append({k: cmd[cmd.index(k) + 1] for k in ("--tasks", "--lengths")}
                   | {"add": "--add-lengths-to" in cmd})
        if len(ran) == 2:
            raise SystemExit("stop here")

    monkeypatch.setattr(choose_defaults.subprocess, "run", run)
    base = ["--rule", str(rule_path), "--out", str(tmp_path),
            "--shipped", str(_shipped(tmp_path, "cur"))]  # fmt: skip
    with pytest.raises(SystemExit, match="stop here"):
        choose_defaults.main([*base, "--only", "query_aware"])
    assert ran == [{"--tasks": "niah,hard", "--lengths": "1024,2048", "add": False},
                   {"--tasks": "niah", "--lengths": "4096", "add": True}]
    ran.clear()
    with pytest.raises(FileNotFoundError):  # nothing ran, so nothing recorded to read
        choose_defaults.main([*base, "--only", "query_aware", "--lengths", "4096"])
    assert ran == [{"--tasks": "niah", "--lengths": "4096", "add": True}]


def test_a_rule_for_another_model_points_both_evidences_at_it_and_writes_nothing(
        tmp_path, monkeypatch):  # fmt: skip
    """A rule naming another model (configs/choose_defaults-gemma-3-270m.yaml) serves that model
    for lm_eval_grid (its tokenizer, ``--model`` and the rule's ``max_model_len``, with
    ``--serve-args`` appended) and runs step 3b's fidelity on it; it may not have traffic
    kinds (measured on the default model only); the default model's rule adds nothing."""
    from obcache_vllm import extra_models

    gemma = choose_defaults.load_rule(ROOT / "configs" / "choose_defaults-gemma-3-270m.yaml")
    path = str(extra_models.model_path(extra_models.MODELS[gemma["model"]]))
    assert choose_defaults.model_args(choose_defaults.load_rule()) == ([], [])
    assert gemma["candidates"] == choose_defaults.load_rule()["candidates"]
    rule = {**gemma, "lengths": [1024], "tasks_at": {}, "fidelity": {**gemma["fidelity"],
                                                                     "lengths": [1024]}}
    rule_path = tmp_path / "rule.yaml"
    rule_path.write_text(yaml.safe_dump(rule))
    base = ["--rule", str(rule_path), "--out", str(tmp_path),
            "--shipped", str(_shipped(tmp_path, "snapkv-w32-dropkv"))]  # fmt: skip
    with_traffic = tmp_path / "traffic.yaml"
    with_traffic.write_text(yaml.safe_dump({**rule, "traffic": {"agnostic": {"fields": {}}}}))
    with pytest.raises(SystemExit, match="traffic kinds are measured on the default model only"):
        choose_defaults.main([*base[:1], str(with_traffic), *base[2:]])
    ran = []

    def run(cmd, **_):
        ran.append([str(c) for c in cmd])
        raise SystemExit("stop here")

    monkeypatch.setattr(choose_defaults.subprocess, "run", run)
    with pytest.raises(SystemExit, match="stop here"):
        choose_defaults.main([*base, "--only", "query_aware", "--serve-args", "--seed 1"])
    _lm_eval_json(tmp_path / "lm_eval.json", full=(1, 1, 1))  # step 3b runs after it is read
    with pytest.raises(SystemExit, match="stop here"):
        choose_defaults.main([*base, "--only", "fidelity"])
    grid, fidelity = ran
    assert grid[grid.index("--tokenizer") + 1] == path
    assert grid[grid.index("--serve-args") + 1] == f"--model {path} --max-model-len 4096 --seed 1"
    assert fidelity[fidelity.index("--model") + 1] == path


def test_a_rule_for_another_model_is_judged_against_and_writes_that_models_selection(tmp_path):
    """Its current setting is what the server ships for that model (its entry in the per-model
    block, else the shipped selection); ``--write`` puts its winner in that entry, leaving the
    shipped selection as it is, and the report says where it ships."""
    rule = {**RULE, "model": "gemma-3-270m", "budget": 0.1, "lengths": [1024, 2048],
            "tasks": ["niah", "hard"], "limit": 40, "max_gen_toks": 48}
    rule.pop("current")
    rule_path = tmp_path / "rule.yaml"
    rule_path.write_text(yaml.safe_dump(rule))
    _lm_eval_json(tmp_path / "out" / "lm_eval.json", full=(1, 1, 1), cur=(0.2, 0.2, 0.2),
                  good=(0.9, 0.9, 0.9), rival=(0.3, 0.3, 0.3), rand=(0, 0, 0))
    shipped = _shipped(tmp_path, "cur")
    shipped.write_text(shipped.read_text() + "\n" + choose_defaults.MODELS_BEGIN +
                       "\nmodels: {}\n" + choose_defaults.MODELS_END + "\n")
    query_aware = choose_defaults.shipped_query_aware(shipped)
    choose_defaults.main(["--rule", str(rule_path), "--report-only",
                          str(tmp_path / "out" / "lm_eval.json"), "--shipped", str(shipped),
                          "--write"])  # fmt: skip
    decision = json.loads((tmp_path / "out" / "decision.json").read_text())
    assert decision["current"] == "cur" and decision["winner"] == "good"
    assert choose_defaults.shipped_models(shipped) == {"gemma-3-270m": {"kv_pipeline": "snapkv"}}
    assert choose_defaults.shipped_for_model("gemma-3-270m", shipped) == "good"
    assert choose_defaults.shipped_query_aware(shipped) == query_aware  # untouched
    assert "Shipped for gemma-3-270m" in (tmp_path / "out" / "DECISION.md").read_text()
    assert choose_defaults.current_setting(rule, shipped) == "good"  # the next run's current
