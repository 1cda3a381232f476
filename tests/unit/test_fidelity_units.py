"""The fidelity evaluation's pure parts: arms, samples, per-request statistics, the paired
bootstrap and the report (no vLLM; the engine run is tests/engine/test_fidelity.py)."""

from __future__ import annotations

import math

import pytest

from obcache_vllm.evidence import fidelity as fid


def test_arms_cover_the_grid_once_with_the_control_first():
    arms = fid.arms(["tova", "streaming"], ["attn", "obcache_key"], [0.1, 0.2],
                    ["aware", "agnostic"])  # fmt: skip
    assert arms[0].name == "full" and arms[0].kv(fid.Sample("s", "code", (1,) * 10, 8)) is None
    names = [a.name for a in arms[1:]]
    assert len(names) == len(set(names)) == 2 * 2 * (2 + 1)  # streaming once per cell
    sample = fid.Sample("s", "needle", tuple(range(100)), 80)
    agnostic = next(a for a in arms if a.name == "tova+obcache_key@0.1/agnostic")
    assert agnostic.kv(sample) == {"kv_budget": 0.1, "kv_pipeline": "tova",
                                   "kv_scorer": "obcache_key", "kv_decode": False,
                                   "kv_compress_at": 80}  # fmt: skip
    aware = next(a for a in arms if a.name == "streaming+-@0.2/aware")
    assert "kv_compress_at" not in aware.kv(sample)
    # "first": where kv_compress_at "auto" compresses a prompt it has not seen
    (first,) = [a for a in fid.arms(["tova"], ["attn"], [0.2], ["first"]) if a.budget]
    assert first.kv(sample)["kv_compress_at"] == -1


def test_slices_are_seeded_windows_of_the_text():
    ids = list(range(1000))
    a = fid.slices(ids, 3, 100, seed=1)
    assert a == fid.slices(ids, 3, 100, seed=1) and a != fid.slices(ids, 3, 100, seed=2)
    for w in a:
        assert len(w) == 100 and w == list(range(w[0], w[0] + 100))
    with pytest.raises(ValueError, match="shorter"):
        fid.slices(ids[:50], 1, 100, seed=0)


def test_request_stats_and_first_divergence():
    positions = {0: (0.0, True, -0.1), 1: (0.5, True, -0.2), 2: (1.0, False, -3.0),
                 3: (0.1, True, -0.1)}  # fmt: skip
    s = fid.request_stats(positions, 4)
    assert s["kl"] == pytest.approx(1.6 / 4) and s["kl_max"] == 1.0
    assert s["agree"] == 0.75 and s["first_divergence"] == 2
    assert fid.request_stats({0: (0.0, True, 0.0)}, 1)["first_divergence"] == 1  # never
    with pytest.raises(ValueError, match="not compared"):
        fid.request_stats({0: (0.0, True, 0.0)}, 2)


def test_paired_bootstrap_interval_brackets_the_mean_and_pairs_the_draws():
    draws = fid.bootstrap_draws(5, reps=500, seed=3)
    mean, lo, hi = fid.interval([1.0, 2.0, 3.0, 4.0, 5.0], draws)
    assert mean == 3.0 and lo < mean < hi and 1.0 <= lo and hi <= 5.0
    assert fid.interval([2.0] * 5, draws) == (2.0, 2.0, 2.0)
    # A constant paired difference has a zero-width interval even when the values vary a lot.
    rows = {s: {"kl": float(i), "agree": 1.0, "first_divergence": 4, "kept_fraction": 0.2}
            for i, s in enumerate("abcde")}  # fmt: skip
    shifted = {s: dict(r, kl=r["kl"] + 0.5) for s, r in rows.items()}
    per_request = {"tova+attn@0.2/aware": rows, "tova+obcache_key@0.2/aware": shifted}
    summary = fid.summarize(per_request, list("abcde"))
    assert summary["tova+obcache_key@0.2/aware"]["kl_minus_attn"] == [0.5, 0.5, 0.5]
    assert "kl_minus_attn" not in summary["tova+attn@0.2/aware"]
    # A reallocation against its uniform host (adakv against snapkv), the same pairing.
    hosted = {"snapkv+attn@0.2/aware": rows, "adakv+attn@0.2/aware": shifted}
    paired = fid.summarize(hosted, list("abcde"))
    assert paired["adakv+attn@0.2/aware"]["kl_minus_host"] == [0.5, 0.5, 0.5]
    assert "kl_minus_host" not in paired["snapkv+attn@0.2/aware"]
    assert summary["tova+attn@0.2/aware"]["kl"][1] < 2.0 < summary["tova+attn@0.2/aware"]["kl"][2]


def test_named_arms_send_their_fields_whole_at_every_budget_and_setting(tmp_path):
    """``--arms``: a selection measured whole (its own window and per-head choice, not the
    grid's window 32), named NAME@BUDGET/SETTING, reported and plotted beside the control."""
    selections = {"tova-shared-w1": {"kv_pipeline": "tova", "kv_per_head": False,
                                     "kv_window": 1, "kv_scorer": "obcache_key"},
                  "snap": {"kv_pipeline": "snapkv", "kv_scorer": "dropkv"}}  # fmt: skip
    arms = fid.named_arms(selections, [0.1, 0.3], ["aware", "agnostic"])
    assert arms[0].name == "full" and len(arms) == 1 + 2 * 2 * 2
    sample = fid.Sample("s", "needle", tuple(range(100)), 80)
    tova = next(a for a in arms if a.name == "tova-shared-w1@0.1/agnostic")
    assert tova.kv(sample) == {"kv_pipeline": "tova", "kv_per_head": False, "kv_window": 1,
                               "kv_scorer": "obcache_key", "kv_budget": 0.1,
                               "kv_decode": False, "kv_compress_at": 80}  # fmt: skip
    snap = next(a for a in arms if a.name == "snap@0.3/aware")
    assert "kv_window" not in snap.kv(sample) and snap.kv(sample)["kv_budget"] == 0.3
    for bad, match in (({"a+b": {}}, "no '\\+'"), ({"a": {"kv_budget": 0.2}}, "kv_budget"),
                       ({"a": {"budget": 0.2}}, "only kv_")):
        with pytest.raises(ValueError, match=match):
            fid.named_arms(bad, [0.1], ["aware"])
    rows = {s: {"kl": 0.1, "agree": 0.9, "first_divergence": 7, "kept_fraction": 0.1}
            for s in "ab"}  # fmt: skip
    per_request = {"full": {s: {**rows[s], "kl": 0.0} for s in "ab"}}
    per_request.update({a.name: rows for a in arms[1:]})
    results = {"command": "c", "model_name": "m", "date": "d", "seconds": 1.0,
               "kinds": "code", "prompt_tokens": 64, "tokens": 8,
               "samples": [{"name": "a"}, {"name": "b"}], "per_request": per_request,
               "summary": fid.summarize(per_request, ["a", "b"])}  # fmt: skip
    fid.write_reports(results, tmp_path)
    text = (tmp_path / "fidelity.md").read_text()
    assert all(f"| {a.name} |" in text for a in arms)
    pytest.importorskip("matplotlib")
    assert (tmp_path / "fidelity.png").stat().st_size > 0


def test_report_renders_every_arm(tmp_path):
    rows = {s: {"kl": 0.1, "agree": 0.9, "first_divergence": 7, "kept_fraction": 0.2}
            for s in "ab"}  # fmt: skip
    full = {s: {"kl": 0.0, "agree": 1.0, "first_divergence": 8, "kept_fraction": 1.0}
            for s in "ab"}  # fmt: skip
    per_request = {"full": full, "tova+attn@0.2/aware": rows, "snapkv+attn@0.1/agnostic": rows}
    results = {"command": "obcache-vllm eval fidelity", "model_name": "m", "date": "d",
               "seconds": 1.0, "kinds": "code", "prompt_tokens": 64, "tokens": 8,
               "samples": [{"name": "a"}, {"name": "b"}], "per_request": per_request,
               "summary": fid.summarize(per_request, ["a", "b"])}  # fmt: skip
    paths = fid.write_reports(results, tmp_path)
    text = (tmp_path / "fidelity.md").read_text()
    for arm in per_request:
        assert f"| {arm} |" in text
    assert text.index("| full |") < text.index("agnostic") < text.index("/aware |")
    assert (tmp_path / "fidelity.json").exists() and len(paths) >= 2


def _run(arms: dict[str, float], full_logprobs=(-1.0, -2.0), **setup) -> dict:
    """A fidelity.json of two prompts: each arm's KL its value (plus 0.01 on prompt b)."""
    def row(kl, logprobs=None):
        return {"kl": kl, "agree": 1.0, "first_divergence": 8, "kept_fraction": 0.2,
                "logprobs": list(logprobs or [])}

    per_request = {"full": {s: row(0.0, full_logprobs) for s in "ab"}}
    per_request.update({a: {"a": row(kl), "b": row(kl + 0.01)} for a, kl in arms.items()})
    return {"command": f"obcache-vllm eval fidelity {' '.join(arms)}", "model_name": "m",
            "date": "d", "seconds": 1.0, "kinds": "code", "prompt_tokens": 64, "tokens": 2,
            "question_tokens": 32, "kv_cache_dtype": "auto", "reference_kv_cache_dtype": "auto",
            "samples": [{"name": "a", "kind": "code", "tokens": 64, "point": None},
                        {"name": "b", "kind": "code", "tokens": 64, "point": None}],
            "arms": [{"name": n} for n in ["full", *arms]], "per_request": per_request,
            "summary": fid.summarize(per_request, ["a", "b"]), **setup}  # fmt: skip


def test_every_scored_arm_is_paired_with_the_rival_where_the_run_has_it(tmp_path):
    """``KL − dropkv's``: each scored arm against the rival of the same pipeline, budget and
    setting, paired over the prompts; the column is shown only where a run has the rival."""
    run = _run({"tova+attn@0.1/aware": 0.2, "tova+obcache_key@0.1/aware": 0.15,
                "tova+dropkv@0.1/aware": 0.1, "snapkv+obcache_key@0.1/aware": 0.3})
    summary = run["summary"]
    assert summary["tova+obcache_key@0.1/aware"]["kl_minus_rival"][0] == pytest.approx(0.05)
    assert summary["tova+attn@0.1/aware"]["kl_minus_rival"][0] == pytest.approx(0.1)
    assert "kl_minus_rival" not in summary["tova+dropkv@0.1/aware"]
    assert "kl_minus_rival" not in summary["snapkv+obcache_key@0.1/aware"]  # no snapkv rival
    text = fid.render(run)
    assert "| KL − dropkv's |" in text
    assert text.count("| - |") >= 2  # full, and snapkv's arm without a rival
    assert "dropkv's" not in fid.render(_run({"tova+attn@0.1/aware": 0.2}))


def test_a_later_runs_arms_join_a_recorded_run_on_the_same_reference(tmp_path):
    """``--add-to``: arms a recorded run predates (random, the rival) join its table, paired
    with its arms over the same prompts (``random`` gets its KL − attn's); refused, with
    nothing changed, when the later run's full cache is not the recorded one, the prompts or
    the setup differ, or an arm is already there."""
    recorded = _run({"tova+attn@0.1/aware": 0.2})
    later = _run({"tova+random@0.1/aware": 0.5}, full_logprobs=(-1.0, -2.0002))
    merged = fid.add_arms(recorded, later)
    assert [a["name"] for a in merged["arms"]] == ["full", "tova+attn@0.1/aware",
                                                   "tova+random@0.1/aware"]  # fmt: skip
    assert merged["per_request"]["full"] == recorded["per_request"]["full"]
    diff = merged["summary"]["tova+random@0.1/aware"]["kl_minus_attn"]
    assert diff[0] == pytest.approx(0.3) and diff[1] == pytest.approx(0.3)
    assert merged["added"] == [{"command": later["command"], "date": "d", "seconds": 1.0,
                                "arms": ["tova+random@0.1/aware"]}]  # fmt: skip
    fid.write_reports(merged, tmp_path)
    text = (tmp_path / "fidelity.md").read_text()
    assert "| tova+random@0.1/aware |" in text
    assert f"1 arm added d (1 s, the full cache checked against the recorded one): " \
        f"`{later['command']}`" in text  # fmt: skip
    with pytest.raises(ValueError, match="log-probs differ"):
        fid.add_arms(recorded, _run({"tova+random@0.1/aware": 0.5}, full_logprobs=(-1.0, -2.1)))
    other = _run({"tova+random@0.1/aware": 0.5})
    other["samples"][1]["tokens"] = 63
    with pytest.raises(ValueError, match="prompts differ"):
        fid.add_arms(recorded, other)
    with pytest.raises(ValueError, match="tokens"):
        fid.add_arms(recorded, _run({"tova+random@0.1/aware": 0.5}, tokens=4))
    with pytest.raises(ValueError, match="already recorded"):
        fid.add_arms(recorded, _run({"tova+attn@0.1/aware": 0.2}))
    assert [a["name"] for a in recorded["arms"]] == ["full", "tova+attn@0.1/aware"]


def test_code_text_is_pythons_own_source():
    text = fid.code_text()
    assert "class ArgumentParser" in text and len(text) > 100_000


def test_the_command_line_knows_the_same_kinds_and_scorers():
    from obcache_vllm.evidence.eval import command, grid

    assert command.FIDELITY_KINDS == fid.KINDS and command.FIDELITY_SETTINGS == fid.SETTINGS
    assert tuple(grid.SCORERS) == fid.SCORERS


# --- the top-k estimate over HTTP (obcache_vllm.evidence.fidelity_topk) ---------------------


def _listing(logp, k: int, extra: int | None = None):
    """What the API returns for one position: the top k, plus token ``extra`` (the prompt's
    own token, at its true rank)."""
    import torch

    order = torch.argsort(logp, descending=True).tolist()
    rank = {t: r + 1 for r, t in enumerate(order)}
    named = order[:k] + ([extra] if extra is not None and extra not in order[:k] else [])
    return {t: (float(logp[t]), rank[t]) for t in named}


def test_topk_kl_is_a_lower_bound_that_is_exact_with_the_whole_vocabulary():
    import torch

    from obcache_vllm.evidence import fidelity_topk as ft

    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        p = torch.log_softmax(torch.randn(64, generator=gen, dtype=torch.float64) * 3, -1)
        noise = torch.randn(64, generator=gen, dtype=torch.float64) * (trial % 5) * 0.5
        q = torch.log_softmax(p + noise, -1)
        exact = float((p.exp() * (p - q)).sum())
        k = 1 + trial % 20
        token = int(p.argmax())
        got = ft.position_estimate(_listing(p, k, token), _listing(q, k, token))
        assert -1e-9 <= got["kl"] <= exact + 1e-6, (trial, got, exact)
        assert got["agree"] == (int(q.argmax()) == token)
        assert got["logprob"] == pytest.approx(float(q[token]))
        whole = ft.position_estimate(_listing(p, 64), _listing(q, 64))
        assert whole["kl"] == pytest.approx(exact, abs=1e-6)
        assert whole["covered"] == pytest.approx(1.0)


def test_topk_estimate_of_identical_lists_is_zero_and_missing_tokens_go_to_the_rest_bin():
    from obcache_vllm.evidence import fidelity_topk as ft

    ref = {1: (-0.1, 1), 2: (-2.5, 2), 3: (-4.0, 3)}
    got = ft.position_estimate(ref, dict(ref))
    assert got["kl"] == pytest.approx(0.0, abs=1e-12) and got["agree"]
    arm = {2: (-0.2, 1), 4: (-2.0, 2)}  # the reference's top token is not in the arm's list
    got = ft.position_estimate(ref, arm)
    assert not got["agree"] and got["logprob"] is None
    assert got["covered"] == pytest.approx(math.exp(-2.5))
    assert got["kl"] > 0.5


def test_prompt_logprobs_are_parsed_and_the_continuation_positions_picked():
    from obcache_vllm.evidence import fidelity_topk as ft

    entry = {"17": {"logprob": -0.5, "rank": 1, "decoded_token": "a"},
             "3": {"logprob": -9.0, "rank": 41, "decoded_token": "b"}}  # fmt: skip
    pos = ft.parse_position(entry)
    assert pos == {17: (-0.5, 1), 3: (-9.0, 41)} and ft.top1(pos) == 17
    assert ft.parse_position(None) is None
    listing = [None, {1: (0.0, 1)}, {2: (0.0, 1)}, {3: (0.0, 1)}]
    assert ft.request_positions(listing, 2, 2) == [{2: (0.0, 1)}, {3: (0.0, 1)}]
    with pytest.raises(ValueError, match="position 0"):
        ft.request_positions(listing, 0, 2)


def test_arm_fields_compress_at_the_prompts_end_or_at_the_question():
    from obcache_vllm.evidence import fidelity_topk as ft

    sample = fid.Sample("s", "code", tuple(range(100)), 70)
    aware = fid.Arm("a", "tova", "obcache_key", 0.2, "aware")
    agnostic = fid.Arm("b", "snapkv", "attn", 0.2, "agnostic")
    assert ft.arm_fields(fid.Arm("full"), sample, 100) is None
    assert ft.arm_fields(aware, sample, 100)["kv_compress_at"] == 100
    fields = ft.arm_fields(agnostic, sample, 100)
    assert fields["kv_compress_at"] == 70 and fields["kv_window"] == 32
    with pytest.raises(ValueError, match="kv_decode"):
        ft.arm_fields(fid.Arm("c", "tova", "attn", 0.2, "aware", decode=True), sample, 100)
    with pytest.raises(ValueError, match="error targets"):
        ft.arm_fields(fid.Arm("d", "tova", "attn", None, "aware", max_error=0.1), sample, 100)


def test_chats_are_template_conversations_asking_about_an_earlier_passage(model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    asked = []

    def reply(prompts):
        asked.append(len(prompts))
        return [f"Reply {len(p)}." for p in prompts]

    samples = fid.make_samples(tok, ["chats"], 2, 900, 32, seed=3, reply=reply)
    again = fid.make_samples(tok, ["chats"], 2, 900, 32, seed=3, reply=reply)
    assert samples == again and len(samples) == 2
    assert len(asked) >= 2  # one reply call per round, every open chat in it
    for s in samples:
        assert s.kind == "chats" and len(s.ids) <= 900
        text = tok.decode(s.ids)
        assert text.count("<|im_start|>user") >= 3 and text.count("Reply ") >= 2
        question = tok.decode(s.ids[s.point :])
        assert question.startswith("<|im_start|>user") and "passage I shared" in question
        assert text.rstrip().endswith("<|im_start|>assistant")
        phrase = question.split('"')[1]
        assert phrase in tok.decode(s.ids[: s.point])  # the quoted words are far back
    with pytest.raises(ValueError, match="reply"):
        fid.make_samples(tok, ["chats"], 1, 900, 32)


def test_the_report_names_the_estimate():
    row = {"kept_fraction": [1, 1, 1], "kl": [0, 0, 0], "agree": [1, 1, 1],
           "first_divergence": [2, 2, 2]}  # fmt: skip
    results = {"command": "c", "model_name": "m", "date": "d", "seconds": 1.0, "kinds": "code",
               "prompt_tokens": 10, "tokens": 2, "samples": [{}], "estimate": "top-20 over HTTP",
               "summary": {"full": row}}  # fmt: skip
    text = fid.render(results)
    assert "top-20 over HTTP estimate, a lower bound" in text and "KL(full ‖ arm) estimate" in text


def test_topk_check_pairs_the_two_measures_and_renders():
    exact = {"tova+attn@0.1/aware": {"s0": {"kl": 0.2, "agree": 0.9, "first_divergence": 3},
                             "s1": {"kl": 0.2, "agree": 1.0, "first_divergence": 8}}}
    estimate = {"full": {}, "tova+attn@0.1/aware": {
        "s0": {"kl": 0.1, "agree": 0.9, "first_divergence": 3, "covered": 0.9},
        "s1": {"kl": 0.2, "agree": 0.8, "first_divergence": 8, "covered": 0.7}}}  # fmt: skip
    check = fid.topk_check(exact, estimate, 20)
    assert check["ratio"] == pytest.approx(0.75) and check["requests"] == 2
    assert check["agree_same"] == 0.5 and check["first_same"] == 1.0
    assert check["arms"]["tova+attn@0.1/aware"]["covered"] == pytest.approx(0.8)
    row = {"kept_fraction": [1, 1, 1], "kl": [0, 0, 0], "agree": [1, 1, 1],
           "first_divergence": [2, 2, 2]}  # fmt: skip
    text = fid.render({"command": "c", "model_name": "m", "date": "d", "seconds": 1.0,
                       "kinds": "code", "prompt_tokens": 10, "tokens": 2, "samples": [{}],
                       "summary": {"full": row}, "topk_check": check})  # fmt: skip
    assert "estimated KL / KL 0.750 pooled over 2 requests" in text
    assert "| tova+attn@0.1/aware | 0.750 | 0.800 | 50% | 100% |" in text
