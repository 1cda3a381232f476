#!/usr/bin/env python
"""Choose the server's shipped selection defaults by a rule stated before the run.

    make choose-defaults               # run the evidence, apply the rule, report
    python scripts/choose_defaults.py --only query_agnostic   # one traffic kind's evidence
    python scripts/choose_defaults.py --only fidelity   # step 3b's evidence, the rest recorded
    python scripts/choose_defaults.py --only query_aware,fidelity --lengths 4096
                                       # a length the rule gained, added to the recorded ones
    make choose-defaults WRITE=1       # ... and write the winner into obcache_vllm/default.yaml
    python scripts/choose_defaults.py --report-only results/choose-defaults/lm_eval.json

The rule, its candidates and its evidence are ``configs/choose_defaults.yaml`` (read it: the
rule is written there in words, and :func:`choose` is that rule). The evidence is
``scripts/lm_eval_grid.py`` run with the candidates as named arms (lm-evaluation-harness RULER
tasks through ``obcache-vllm serve``, the full cache included, the same documents for every
arm); step 3b's is ``obcache-vllm eval fidelity --arms`` with the candidates, in
``OUT/fidelity-LENGTH/``. Writes ``OUT/lm_eval.json`` and ``OUT/lm_eval.md`` (lm_eval_grid's),
``OUT/decision.json`` and ``OUT/DECISION.md``; each traffic kind of the rule (``traffic:``)
gets its own evidence in ``OUT/KIND/`` and its own winner, a section of the report (the query-
aware winner is the one shipped); with ``--write``, the winner's fields replace the block
between the markers in ``obcache_vllm/default.yaml``, and the winner of the kind marked
``ships: query_agnostic`` replaces the ``query_agnostic`` block there (what the server applies
to a request that sets ``kv_compress_at`` to a position and no selection field;
``tests/unit/test_choose_defaults.py`` checks that the shipped file holds the recorded
winners).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from lm_eval_grid import added_what, recorded_lengths  # noqa: E402

RULE = ROOT / "configs" / "choose_defaults.yaml"
SHIPPED = ROOT / "obcache_vllm" / "default.yaml"
BEGIN = "# -- chosen by scripts/choose_defaults.py (configs/choose_defaults.yaml): do not edit"
END = "# -- end of the chosen block"
SELECTION = ("kv_scorer", "kv_pipeline", "kv_window", "kv_per_head")
# The block a traffic kind marked ``ships: query_agnostic`` writes (config.QUERY_AGNOSTIC_KEY).
AGNOSTIC_BEGIN = ("# -- chosen for query-agnostic requests by scripts/choose_defaults.py "
                  "(configs/choose_defaults.yaml): do not edit")  # fmt: skip
AGNOSTIC_END = "# -- end of the query-agnostic block"
AGNOSTIC_KEY = "query_agnostic"
# The block a rule for another model writes (config.MODELS_KEY): one selection per model.
MODELS_BEGIN = ("# -- chosen per model by scripts/choose_defaults.py "
                "(configs/choose_defaults-<model>.yaml): do not edit")  # fmt: skip
MODELS_END = "# -- end of the per-model block"
MODELS_KEY = "models"


def load_rule(path: Path = RULE) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def cell_scores(results: dict) -> dict[str, dict[tuple[str, int], dict[int, float]]]:
    """``{arm: {(task, length): {doc_id: score}}}`` from lm_eval_grid's ``lm_eval.json``."""
    return {arm: {(task, int(length)): {int(d): float(v) for d, v in docs.items()}
                  for task, per in run["scores"].items() for length, docs in per.items()}
            for arm, run in results["runs"].items()}  # fmt: skip


def fidelity_scores(runs: dict[int, dict]) -> dict[str, dict[tuple[int, str], dict[str, float]]]:
    """``{candidate: {(length, kind): {prompt: KL}}}`` from ``eval fidelity --arms`` results
    per prompt length (arms ``NAME@BUDGET/aware``; the full cache left out)."""
    out: dict[str, dict[tuple[int, str], dict[str, float]]] = {}
    for length, results in runs.items():
        kind_of = {s["name"]: s["kind"] for s in results["samples"]}
        for arm, rows in results["per_request"].items():
            if arm == "full":
                continue
            name = arm.split("@", 1)[0]
            for prompt, row in rows.items():
                out.setdefault(name, {}).setdefault((int(length), kind_of[prompt]), {})[
                    prompt] = float(row["kl"])
    return out


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def paired(arm: dict, best: dict, cells, resamples: int = 2000, seed: int = 0):
    """Mean over cells of (arm - best) on the documents both scored, with a 95 % bootstrap
    that resamples documents within each cell (each cell weighs the same)."""
    diffs = {c: [arm[c][d] - best[c][d] for d in sorted(set(arm[c]) & set(best[c]))]
             for c in cells}  # fmt: skip
    diffs = {c: v for c, v in diffs.items() if v}
    if not diffs:
        return None
    rng = random.Random(seed)
    point = _mean(_mean(v) for v in diffs.values())
    means = sorted(_mean(_mean(rng.choices(v, k=len(v))) for v in diffs.values())
                   for _ in range(resamples))  # fmt: skip
    return point, means[int(0.025 * resamples)], means[min(resamples - 1, int(0.975 * resamples))]


def narrow_by_fidelity(tied: list[str], kl: dict, rows: list[dict]) -> tuple[str, list[str]]:
    """Step 3b: the fidelity best (the tied candidate with the lowest mean KL over the cells)
    and the tied candidates whose paired KL difference to it has an interval reaching 0.
    Every candidate's row gets its mean KL and its difference to the fidelity best."""
    cells = sorted({c for name in kl for c in kl[name]})
    mean_kl = {name: _mean(_mean(kl[name][c].values()) for c in cells if c in kl[name])
               for name in kl}  # fmt: skip
    missing = [name for name in tied if name not in kl]
    if missing:
        raise SystemExit(f"fidelity evidence: no arm for tied candidates {missing}")
    best = min(tied, key=lambda n: (mean_kl[n], tied.index(n)))
    kept = []
    for row in rows:
        name = row["candidate"]
        if name not in kl:
            continue
        diff = paired(kl[name], kl[best], cells)
        row["kl"], row["kl_diff_to_fidelity_best"] = mean_kl[name], diff
        if name in tied and (name == best or diff[1] <= 0):
            kept.append(name)
        row["tied_after_fidelity"] = name in kept
    return best, kept


def choose(scores: dict, rule: dict, fidelity: dict | None = None) -> dict:
    """The rule of ``configs/choose_defaults.yaml`` applied to per-document scores (see there):
    the counted cells, every candidate's score and paired difference to the best, the tied
    set (narrowed by step 3b where ``fidelity``, :func:`fidelity_scores`, is given), the
    winner (None: insufficient evidence, the current setting stays)."""
    full = scores["full"]
    cells = sorted(c for c in full if _mean(full[c].values()) >= rule["min_full"])
    candidates = [name for name in rule["candidates"] if name in scores]
    score = {name: _mean(_mean(scores[name][c].values()) for c in cells if c in scores[name])
             for name in candidates}  # fmt: skip
    eligible = [n for n in candidates if n != rule["floor"]]
    best = max(eligible, key=lambda n: (score[n], -eligible.index(n))) if cells else None
    rows, tied = [], []
    for name in candidates:
        diff = None if best is None else paired(scores[name], scores[best], cells)
        is_tied = name == best or (diff is not None and diff[2] >= 0)
        if is_tied and name in eligible:
            tied.append(name)
        rows.append({"candidate": name, "score": score[name], "diff_to_best": diff,
                     "tied_with_best": is_tied, "fields": rule["candidates"][name],
                     "role": ("floor" if name == rule["floor"] else "rival" if name == rule["rival"]
                              else "current" if name == rule["current"] else "")})  # fmt: skip
    floor_tied = best is not None and next(r for r in rows
                                           if r["candidate"] == rule["floor"])["tied_with_best"]
    fidelity_best, kept = None, tied
    if fidelity and best is not None:
        fidelity_best, kept = narrow_by_fidelity(tied, fidelity, rows)
    if best is None or floor_tied:
        winner, why = None, ("no cell where the full cache scores at least min_full" if best is None
                             else "the floor (random) is tied with the best: the tasks do not "
                             "tell a real score from none")  # fmt: skip
    elif rule["current"] in kept:
        winner, why = rule["current"], ("the current setting is tied with the best"
                                        + (" on accuracy and fidelity" if fidelity else ""))
    elif fidelity:
        winner, why = fidelity_best, ("the closest to the full cache of the candidates tied "
                                      "with the best on accuracy, and the current setting is "
                                      + ("not tied with the best" if rule["current"] not in tied
                                         else "further from the full cache"))  # fmt: skip
    else:
        winner, why = best, "the best, and the current setting is not tied with it"
    return {"cells": [list(c) for c in cells], "best": best, "tied": tied, "winner": winner,
            "why": why, "rows": rows, "fidelity_best": fidelity_best,
            "tied_after_fidelity": kept if fidelity else None}  # fmt: skip


def render(decision: dict, rule: dict, results: dict, fidelity_runs: dict | None = None) -> str:
    scores = cell_scores(results)
    with_kl = decision.get("fidelity_best") is not None
    cells = [tuple(c) for c in decision["cells"]]
    head = " | ".join(f"{t} @ {n}" for t, n in cells)
    lines = [  # no heading: the Choosing page includes this file under its own
        f"Rule and candidates: `{rule.get('path', 'configs/choose_defaults.yaml')}`; evidence: "
        f"`{results['command']}` ({rule.get('model') or results['model']}, {results['date']}, "
        f"{results['machine']}, "
        f"{results['seconds'] / 60:.0f} min)"
        + "".join(f"; {added_what(a)} added {a['date']}: `{a['command']}` ({a['seconds'] / 60:.0f} "
                  "min)" for a in results.get("added", []))
        + f"; {rule['budget']:g} of each prompt kept, the question in the prompt. Reproduce: "
        f"`make {rule.get('make', 'choose-defaults')}`.",
        "",
        f"Counted cells (the full cache at least {rule['min_full']}): "
        + (", ".join(f"{t} at {n} tokens" for t, n in cells) or "none") + ".",
        "",
        f"| candidate | role | {head} | score | Δ best [95 %] | tied |"
        + (" KL(full ‖ ·) | Δ KL fidelity best [95 %] | tied after fidelity |" if with_kl else ""),
        "|---|---|" + "---|" * len(cells) + "---|---|---|" + ("---|---|---|" if with_kl else ""),
    ]
    full = scores["full"]
    lines.append("| full cache | | " + " | ".join(f"{_mean(full[c].values()):.2f}" for c in cells)
                 + " | | | |" + (" 0 | | |" if with_kl else ""))
    for row in decision["rows"]:
        name = row["candidate"]
        accs = " | ".join(f"{_mean(scores[name][c].values()):.2f}" if c in scores[name] else ""
                          for c in cells)  # fmt: skip
        diff = row["diff_to_best"]
        diff_text = "" if diff is None else f"{diff[0]:+.2f} [{diff[1]:+.2f}, {diff[2]:+.2f}]"
        line = (f"| {name} | {row['role']} | {accs} | {row['score']:.3f} | {diff_text} | "
                f"{'yes' if row['tied_with_best'] else 'no'} |")
        if with_kl:
            kl_diff = row.get("kl_diff_to_fidelity_best")
            kl_text = "" if kl_diff is None else \
                f"{kl_diff[0]:+.3f} [{kl_diff[1]:+.3f}, {kl_diff[2]:+.3f}]"  # fmt: skip
            kl = f"{row['kl']:.3f}" if "kl" in row else ""
            tied_after = ("yes" if row.get("tied_after_fidelity") else "no") \
                if row["tied_with_best"] and row["candidate"] in decision["tied"] else ""
            line += f" {kl} | {kl_text} | {tied_after} |"
        lines.append(line)
    winner = decision["winner"]
    lines += ["", f"Best: `{decision['best']}`. Tied with it: "
              + ", ".join(f"`{n}`" for n in decision["tied"]) + ".", ""]
    if with_kl:
        runs = fidelity_runs or {}
        commands = "; ".join(f"`{r['command']}` ({r['date']}, {r['seconds'] / 60:.0f} min)"
                             for _, r in sorted(runs.items()))  # fmt: skip
        kinds = rule["fidelity"]["kinds"]
        lines += [
            "Fidelity (step 3b), among the tied: mean KL(full ‖ candidate) in nats per token over "
            f"{rule['fidelity']['tokens']} forced tokens, {rule['budget']:g} of each prompt "
            f"kept, the question in the prompt, {rule['fidelity']['samples']} prompts per kind "
            f"({', '.join(kinds)}) at {', '.join(map(str, sorted(runs)))} tokens, each (length, "
            f"kind) cell weighing the same; evidence: {commands}.", "",
            f"Closest to the full cache of the tied: `{decision['fidelity_best']}`. Still tied: "
            + ", ".join(f"`{n}`" for n in decision["tied_after_fidelity"]) + ".", ""]
    elif rule.get("fidelity") and decision.get("best") is not None and fidelity_runs is not None:
        lines += ["No fidelity evidence is recorded with this run (it predates step 3b): "
                  "accuracy alone decided.", ""]
    lines += [  # the verdict
              f"**Winner: `{winner}`** ({decision['why']})." if winner else
              f"**No winner** ({decision['why']}): the current setting stays.", ""]  # fmt: skip
    if winner:
        lines.append((f"Shipped for {rule['model']} (`default.yaml`'s `{MODELS_KEY}`) as: "
                      if model_args(rule)[0] else "Shipped as: ") + ", ".join(
            f"`{k}: {json.dumps(v)}`" for k, v in rule["candidates"][winner].items()) + ".")
    return "\n".join(lines) + "\n"


def shipped_block(fields: dict, winner: str) -> str:
    """The block of ``default.yaml`` the winner's fields make (between the markers)."""
    lines = [BEGIN, f"# winner: {winner} (results/choose-defaults/DECISION.md)"]
    lines += [f"{key}: {json.dumps(fields[key])}" for key in SELECTION if key in fields]
    return "\n".join(lines + [END])


def agnostic_block(fields: dict, winner: str, kind: str) -> str:
    """The ``query_agnostic`` block of ``default.yaml`` (between its markers): one YAML
    mapping of the selection fields (JSON is YAML)."""
    mapping = ", ".join(f"{json.dumps(k)}: {json.dumps(fields[k])}" for k in SELECTION
                        if k in fields)  # fmt: skip
    return "\n".join([AGNOSTIC_BEGIN,
                      f"# winner: {winner} (results/choose-defaults/DECISION.md, {kind})",
                      f"{AGNOSTIC_KEY}: {{{mapping}}}", AGNOSTIC_END])  # fmt: skip


def _replace_block(text: str, begin: str, end: str, block: str, path: Path) -> str:
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path}: no block between the markers {begin!r} and {end!r}")
    return pattern.sub(lambda _: block, text)


def write_shipped(fields: dict, winner: str, path: Path = SHIPPED) -> None:
    path.write_text(_replace_block(path.read_text(), BEGIN, END, shipped_block(fields, winner),
                                   path))  # fmt: skip


def write_agnostic(fields: dict, winner: str, kind: str, path: Path = SHIPPED) -> None:
    block = agnostic_block(fields, winner, kind)
    path.write_text(_replace_block(path.read_text(), AGNOSTIC_BEGIN, AGNOSTIC_END, block, path))


def shipped_models(path: Path = SHIPPED) -> dict[str, dict]:
    """``default.yaml``'s per-model selections (its ``models`` mapping; empty where none)."""
    import yaml

    return (yaml.safe_load(path.read_text()) or {}).get(MODELS_KEY) or {}


def shipped_for_model(model: str, path: Path = SHIPPED) -> str | None:
    """The winner named for ``model`` in ``default.yaml``'s per-model block, or None."""
    return _named_winner(path, MODELS_BEGIN, MODELS_END, re.escape(model))


def write_model(fields: dict, winner: str, model: str, out: str, path: Path = SHIPPED) -> None:
    """The winner of a rule for ``model`` into ``default.yaml``'s per-model block, beside the
    other models' selections (each named by a comment line: winner and report)."""
    text = path.read_text()
    named = dict(re.findall(r"^# (\S+): (\S+ \(.*\))$", _block(text, MODELS_BEGIN, MODELS_END),
                            re.M))  # fmt: skip
    models = {**shipped_models(path),
              model: {k: fields[k] for k in SELECTION if k in fields}}  # fmt: skip
    named[model] = f"{winner} ({out}/DECISION.md)"
    lines = [MODELS_BEGIN, *(f"# {m}: {named[m]}" for m in sorted(models) if m in named)]
    mapping = ", ".join(f"{json.dumps(m)}: {{" + ", ".join(
        f"{json.dumps(k)}: {json.dumps(v)}" for k, v in models[m].items()) + "}"
        for m in sorted(models))  # fmt: skip
    lines += [f"{MODELS_KEY}: {{{mapping}}}", MODELS_END]
    path.write_text(_replace_block(text, MODELS_BEGIN, MODELS_END, "\n".join(lines), path))


def _block(text: str, begin: str, end: str) -> str:
    """The text between the markers ``begin`` and ``end`` ("" where there is no block)."""
    start = text.find(begin)
    return "" if start < 0 else text[start:text.find(end, start)]


def _named_winner(path: Path, begin: str, end: str, label: str = "winner") -> str | None:
    """The setting a ``# LABEL: NAME (...)`` line names in the block of ``path`` between
    ``begin`` and ``end`` (``label``: a regex; ``winner``, or a model's name in the per-model
    block), or None (no block, or one naming none)."""
    match = re.search(rf"^# {label}: (\S+) ", _block(path.read_text(), begin, end), re.M)
    return match.group(1) if match else None


def shipped_agnostic(path: Path = SHIPPED) -> str | None:
    """The winner named in ``default.yaml``'s query-agnostic block, or None (no block, or
    one that ships nothing)."""
    return _named_winner(path, AGNOSTIC_BEGIN, AGNOSTIC_END)


def shipped_query_aware(path: Path = SHIPPED) -> str | None:
    """The winner named in ``default.yaml``'s chosen block (the query-aware selection the
    server ships now), or None (no block, or one naming none)."""
    return _named_winner(path, BEGIN, END)


def current_setting(rule: dict, shipped: Path = SHIPPED, recorded: dict | None = None) -> str:
    """The setting the query-aware evidence is judged against (rule step 4: no change without
    evidence): what the server ships now, the winner named in ``default.yaml``'s chosen block.
    A decision re-applied to its recorded evidence (``--report-only``) keeps the current it
    was made against (``recorded``, its ``decision.json``), so re-rendering a past run does
    not rewrite its history; a rule file may name one (``current:``) only where the shipped
    file names none."""
    if recorded and recorded.get("current"):
        return recorded["current"]
    own = shipped_for_model(rule["model"], shipped) if model_args(rule)[0] else None
    current = own or shipped_query_aware(shipped) or rule.get("current")
    if current is None:
        raise SystemExit(f"{shipped}: no `# winner:` in the chosen block, and the rule names "
                         "no `current:` setting to judge the evidence against")
    if current not in rule["candidates"]:
        raise SystemExit(f"the current setting {current!r} (what {shipped} ships) is not a "
                         "candidate of the rule: add it, so the evidence can keep it")
    return current


def shipping_kind(rule: dict) -> str | None:
    """The traffic kind whose winner is shipped as the ``query_agnostic`` block (at most one)."""
    kinds = [k for k, spec in (rule.get("traffic") or {}).items()
             if spec.get("ships") == AGNOSTIC_KEY]  # fmt: skip
    if len(kinds) > 1:
        raise SystemExit(f"rule: more than one traffic kind ships {AGNOSTIC_KEY}: {kinds}")
    return kinds[0] if kinds else None


def _shown(path: Path) -> str:
    """A path as the reports show it: relative to the checkout where it lies in it (the
    command is run from the checkout's root, as make runs it)."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def tasks_at(rule: dict, length: int) -> list[str]:
    """The tasks the rule runs at ``length``: ``tasks_at`` where it names the length, else
    ``tasks``."""
    return list((rule.get("tasks_at") or {}).get(int(length), rule["tasks"]))


def model_args(rule: dict) -> tuple[list[str], list[str]]:
    """The arguments that point the evidence at the rule's ``model`` where it is not the
    default model: ``(lm_eval_grid's, eval fidelity's)``; both empty for the default model (or a
    rule naming none). ``max_model_len`` (the rule's) bounds the served context, which an extra
    model's own config may set far above what the CPU pool holds."""
    from obcache_vllm import extra_models, model

    name = rule.get("model")
    if not name or name == model.MODEL_NAME:
        return [], []
    if name not in extra_models.MODELS:
        raise SystemExit(f"rule model {name!r}: not {model.MODEL_NAME} nor one of "
                         f"{sorted(extra_models.MODELS)}")
    path = str(extra_models.model_path(extra_models.MODELS[name]))
    serve = f"--model {path}" + (f" --max-model-len {rule['max_model_len']}"
                                 if rule.get("max_model_len") else "")  # fmt: skip
    return ["--tokenizer", path, "--serve-args", serve], ["--model", path]


def _run_evidence(rule: dict, out: Path, extra: dict, limit, serve_args: str,
                  lengths=None) -> Path:  # fmt: skip
    """lm_eval_grid with every candidate as a named arm, at the rule's lengths (``extra``: a
    traffic kind's fields), one run per set of tasks (``tasks_at``), each after the first added
    to it (lm_eval_grid's ``--add-lengths-to``); ``lengths``: only these, all added to
    ``out``'s recorded run of the same arms."""
    out.mkdir(parents=True, exist_ok=True)
    arms = {name: {"kv_budget": rule["budget"], **fields, **extra}
            for name, fields in rule["candidates"].items()}  # fmt: skip
    (out / "arms.json").write_text(json.dumps(arms, indent=1) + "\n")
    groups: dict[tuple[str, ...], list[int]] = {}
    for length in lengths or rule["lengths"]:
        groups.setdefault(tuple(tasks_at(rule, length)), []).append(int(length))
    for n, (tasks, group) in enumerate(groups.items()):
        cmd = [sys.executable, str(ROOT / "scripts" / "lm_eval_grid.py"),
               "--arms", _shown(out / "arms.json"), "--tasks", ",".join(tasks),
               "--lengths", ",".join(map(str, group)), "--limit", str(limit or rule["limit"]),
               "--max-gen-toks", str(rule["max_gen_toks"]), "--out", _shown(out)]  # fmt: skip
        if lengths or n:
            cmd += ["--add-lengths-to", _shown(out / "lm_eval.json")]
        grid_model, _ = model_args(rule)
        if serve_args and grid_model:
            grid_model[-1] += " " + serve_args
        elif serve_args:
            grid_model = ["--serve-args", serve_args]
        subprocess.run(cmd + grid_model, check=True, cwd=ROOT)
    return out / "lm_eval.json"


def check_lengths(rule: dict, results: dict, source: Path) -> None:
    """Refuse evidence that lacks a length the rule asks for (a rule that gained a length is
    applied to evidence at that length too, not to the lengths it had)."""
    missing = sorted(set(map(int, rule.get("lengths", []))) - recorded_lengths(results))
    if missing:
        raise SystemExit(f"{source}: no evidence at {missing} tokens, which the rule asks for "
                         f"(run --only query_aware --lengths {','.join(map(str, missing))})")


def _fidelity_dir(out: Path, length: int) -> Path:
    return out / f"fidelity-{length}"


def _run_fidelity(rule: dict, out: Path, length: int) -> Path:
    """Step 3b's evidence at one prompt length: ``obcache-vllm eval fidelity --arms`` with
    every candidate at the rule's budget, the question in the prompt."""
    spec = rule["fidelity"]
    where = _fidelity_dir(out, length)
    where.mkdir(parents=True, exist_ok=True)
    (where / "arms.json").write_text(json.dumps(rule["candidates"], indent=1) + "\n")
    cmd = [sys.executable, "-m", "obcache_vllm.cli", "eval", "fidelity",
           "--arms", _shown(where / "arms.json"), "--kinds", ",".join(spec["kinds"]),
           "--samples", str(spec["samples"]), "--prompt-tokens", str(length),
           "--tokens", str(spec["tokens"]), "--budgets", f"{rule['budget']:g}",
           "--settings", "aware", "--out", _shown(where), *model_args(rule)[1]]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT)
    return where / "fidelity.json"


def load_fidelity(rule: dict, out: Path) -> dict[int, dict] | None:
    """The recorded fidelity runs per length (None: the rule has no step 3b; an empty dict:
    it has, and none is recorded in ``out``)."""
    if not rule.get("fidelity"):
        return None
    runs = {}
    for length in rule["fidelity"]["lengths"]:
        path = _fidelity_dir(out, length) / "fidelity.json"
        if path.exists():
            runs[int(length)] = json.loads(path.read_text())
    if runs and len(runs) != len(rule["fidelity"]["lengths"]):
        raise SystemExit(f"{out}: fidelity evidence for {sorted(runs)} tokens only; the rule "
                         f"asks for {rule['fidelity']['lengths']} (run --only fidelity)")
    return runs


def traffic_rule(rule: dict, kind: str, shipped: str | None,
                 agnostic: str | None = None) -> dict:  # fmt: skip
    """The rule for one traffic kind: the same, with what the server applies to that traffic
    as its current (the shipped query-aware winner; for the kind that ships the
    ``query_agnostic`` block, that block's winner ``agnostic`` where one is shipped); a kind
    may set its own ``lengths``, ``limit`` and ``budget``, and add ``candidates``."""
    spec = rule["traffic"][kind]
    current = shipped or rule.get("current")
    if spec.get("ships") == AGNOSTIC_KEY and agnostic:
        current = agnostic
    kind_rule = {**rule, "current": current}
    kind_rule.update({k: spec[k] for k in ("lengths", "limit", "budget") if k in spec})
    kind_rule["candidates"] = {**rule["candidates"], **spec.get("candidates", {})}
    return kind_rule


def render_traffic(kind: str, decision: dict, rule: dict, results: dict) -> str:
    fields = ", ".join(f"`{k}: {json.dumps(v)}`"
                       for k, v in rule["traffic"][kind]["fields"].items())  # fmt: skip
    text = render(decision, rule, results).replace(
        "the question in the prompt. Reproduce: `make choose-defaults`.",
        f"the prompt compressed before its question: every candidate also sends {fields}. "
        "Reproduce: `make choose-defaults`.")
    if rule["traffic"][kind].get("ships") == AGNOSTIC_KEY:
        text = text.replace("Shipped as: ", "Shipped for requests that set `kv_compress_at` to a "
                            "position and no selection field (default.yaml's "
                            f"`{AGNOSTIC_KEY}`): ")  # fmt: skip
    else:
        text = text.replace("Shipped as: ",
                            f"Recommended for {kind.replace('_', '-')} traffic: ")  # fmt: skip
    return f"### {kind.replace('_', '-').capitalize()} traffic\n\n" + text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rule", type=Path, default=RULE)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "choose-defaults")
    p.add_argument("--limit", type=int, default=None, help="documents per cell (default: rule)")
    p.add_argument("--only", default=None,
                   help="run only these evidences (comma-separated: query_aware, fidelity "
                   "and the rule's traffic kinds), the others read from OUT")
    p.add_argument("--report-only", type=Path, default=None,
                   help="apply the rule to an lm_eval.json (its traffic kinds beside it in "
                   "KIND/lm_eval.json), running nothing")
    p.add_argument("--write", action="store_true", help="write the winner into default.yaml")
    p.add_argument("--shipped", type=Path, default=SHIPPED, help=argparse.SUPPRESS)  # tests
    p.add_argument("--serve-args", default="")
    p.add_argument("--lengths", type=lambda t: [int(x) for x in t.split(",")], default=None,
                   help="run the query-aware and fidelity evidence at only these of the rule's "
                   "lengths, added to the lengths recorded in OUT (a length the rule gained)")
    args = p.parse_args(argv)
    rule = {**load_rule(args.rule), "path": _shown(args.rule)}
    other_model = bool(model_args(rule)[0])
    if other_model and rule.get("traffic"):
        raise SystemExit(f"{args.rule}: traffic kinds are measured on the default model only")
    kinds = list(rule.get("traffic") or {})
    evidences = ["query_aware", *(["fidelity"] if rule.get("fidelity") else []), *kinds]
    only = set(args.only.split(",")) if args.only else set(evidences)
    unknown = only - set(evidences)
    if unknown:
        raise SystemExit(f"--only: unknown {sorted(unknown)}; known: {', '.join(evidences)}")
    if args.lengths:
        extra = sorted(set(args.lengths) - set(rule["lengths"])
                       - set((rule.get("fidelity") or {}).get("lengths", [])))
        if extra:
            raise SystemExit(f"--lengths: {extra} not among the rule's lengths")
        if only - {"query_aware", "fidelity"} or args.report_only is not None:
            raise SystemExit("--lengths: with --only query_aware and/or fidelity")
    out = args.out if args.report_only is None else args.report_only.parent
    source = args.report_only or out / "lm_eval.json"
    if args.report_only is None and "query_aware" in only:
        source = _run_evidence(rule, out, {}, args.limit, args.serve_args,
                               [n for n in args.lengths or [] if n in rule["lengths"]] or None)
    results = json.loads(source.read_text())
    recorded = None
    if args.report_only is not None and (out / "decision.json").exists():
        recorded = json.loads((out / "decision.json").read_text())
    rule = {**rule, "current": current_setting(rule, args.shipped, recorded)}
    if args.report_only is None and "fidelity" in only:
        for length in rule["fidelity"]["lengths"]:
            if not args.lengths or int(length) in args.lengths:
                _run_fidelity(rule, out, int(length))
    check_lengths(rule, results, source)  # after the runs: each length's evidence runs alone
    fidelity_runs = load_fidelity(rule, out)
    fidelity = fidelity_scores(fidelity_runs) if fidelity_runs else None
    decision = choose(cell_scores(results), rule, fidelity)
    decision["current"] = rule["current"]
    decision["rule"] = str(args.rule.relative_to(ROOT)) if args.rule.is_relative_to(ROOT) \
        else str(args.rule)  # fmt: skip
    report = render(decision, rule, results, fidelity_runs)
    decision["traffic"] = {}
    ships = shipping_kind(rule)
    for kind in kinds:
        kind_rule = traffic_rule(rule, kind, decision["winner"], shipped_agnostic(args.shipped))
        was = ((recorded or {}).get("traffic") or {}).get(kind, {}).get("current")
        if was:  # re-applied to recorded evidence: judged against what it was judged against
            kind_rule["current"] = was
        if args.report_only is None and kind in only:
            _run_evidence(kind_rule, out / kind, rule["traffic"][kind]["fields"], args.limit,
                          args.serve_args)  # fmt: skip
        path = out / kind / "lm_eval.json"
        if not path.exists():
            continue
        kind_results = json.loads(path.read_text())
        decision["traffic"][kind] = choose(cell_scores(kind_results), kind_rule)
        decision["traffic"][kind]["current"] = kind_rule["current"]
        report += "\n" + render_traffic(kind, decision["traffic"][kind], kind_rule, kind_results)
    (out / "decision.json").write_text(json.dumps(decision, indent=1) + "\n")
    (out / "DECISION.md").write_text(report)
    print(report)
    if args.write and decision["winner"] and other_model:
        write_model(rule["candidates"][decision["winner"]], decision["winner"], rule["model"],
                    _shown(out), args.shipped)  # fmt: skip
        print(f"wrote {decision['winner']} into {args.shipped}'s {MODELS_KEY} for "
              f"{rule['model']}")
    elif args.write and decision["winner"]:
        write_shipped(rule["candidates"][decision["winner"]], decision["winner"], args.shipped)
        print(f"wrote {decision['winner']} into {args.shipped}")
    won = decision["traffic"].get(ships, {}).get("winner") if ships else None
    if args.write and won:
        fields = traffic_rule(rule, ships, None)["candidates"][won]
        write_agnostic(fields, won, ships, args.shipped)
        print(f"wrote {won} into {args.shipped}'s {AGNOSTIC_KEY} block ({ships})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
