"""Fidelity to the full cache: how much each budget changes the next-token distributions.

A 0/1 task score spends a whole request on one bit. Here every generated position is an
observation: the full cache and each option set run on the same prompt and the same
continuation, and at every position the two next-token distributions are compared over the
whole vocabulary.

1. The full cache decodes each prompt greedily (``--tokens`` tokens, EOS ignored); the
   worker's :class:`FidelityProcessor` keeps its log-probabilities at every position.
2. Every arm (a ``kv_*`` option set, plus the full cache again as a control) is teacher-forced
   on that continuation (:mod:`obcache_vllm.evidence.forcing`), so eviction runs at prefill
   and, with ``kv_decode``, at every decode step exactly as while generating. At each position
   the processor compares the arm's raw distribution q with the full cache's p:

   * ``kl``: KL(p || q) over the full vocabulary (nats);
   * ``agree``: whether q's argmax is p's (the continuation's token: greedy would pick it);
   * the first position where they disagree is where greedy decoding from this cache
     diverges from the full cache's (the continuation is the full cache's greedy one).

Per request the mean KL and agreement over its positions; per arm the mean over prompts with
a 95 % paired-bootstrap interval (prompts resampled, the same draw for every arm), and each
scorer's difference to ``attn`` at the same pipeline, budget and setting, also paired.

Inputs (``--kinds``): ``bible`` (books of the King James Bible, public domain, from Debian's
``bible-kjv``), ``code`` (Python's own standard-library source, shipped with every Python),
``needle`` (the package's seeded haystacks with a question), ``repeated`` (one passage over and
over: a redundant document), ``chats`` (multi-turn conversations through the model's chat
template: the user shares passages of the Bible or of code and asks about them, the assistant
turns are the model's own greedy replies, and the last turn asks for the words after a phrase
of an earlier passage; see :func:`chat_samples`). A sample is ``--prompt-tokens`` tokens of one
text (needles and chats: at most that); query-agnostic arms (``agnostic``) compress at
``--question-tokens`` before the prompt's end (the needle's question; the last tokens of prose
or code; a chat's last user turn), as ``kv_compress_at`` does for a question asked after a
document.

Needs the in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the command): the
processor runs in the worker and leaves its numbers in this module's :data:`STORE`.

Usage::

    obcache-vllm eval fidelity --samples 4 --budgets 0.1,0.2,0.4 --out results/fidelity
    obcache-vllm eval fidelity --report-only results/fidelity/fidelity.json

The pure parts (statistics, report) are tested without vLLM in
``tests/unit/test_fidelity_units.py``.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from obcache_vllm.evidence.eval import grid
from obcache_vllm.evidence.eval.cells import ranks, takes_window
from obcache_vllm.evidence.forcing import ForceTokensProcessor, track_rows
from obcache_vllm.options import FIRST_POINT

FIDELITY_KEY = "fidelity"
FIDELITY_FQCN = "obcache_vllm.evidence.fidelity:FidelityProcessor"
KINDS = ("bible", "code", "needle", "repeated", "chats")
SETTINGS = ("aware", "agnostic", "first")
PIPELINES = ("tova", "snapkv", "h2o", "streaming")


def host_of(pipeline: str) -> str | None:
    """The uniform pipeline whose scores ``pipeline`` reallocates (adakv: snapkv), or None:
    the reports pair its arms with the host's of the same scorer, budget and setting."""
    from obcache_vllm.scoring import pipeline_class

    try:
        return pipeline_class(pipeline).host
    except ValueError:
        return None
SCORERS = grid.SCORERS  # the evaluations' scorers, the rival (DropKV) and the floor among them
BOOTSTRAP = 2000
CODE_MODULES = ("argparse", "json.decoder", "dataclasses", "inspect", "typing", "textwrap")
BOOKS = ("Genesis", "Exodus", "Matthew", "Acts", "Isaiah", "Numbers", "John", "Luke")


# ---------------------------------------------------------------------------------------------
# The worker side


@dataclass
class FidelityStore:
    """What the processor leaves behind, by key (one process: the in-process engine).

    ``references[key][step]``: the full cache's log-probabilities [V] at output position
    ``step``. ``positions[name][step]``: (kl, agree, logprob of the reference's argmax) of an
    arm. Keyed by step and overwritten: vLLM also samples (and discards) a row whose prefill
    is still partial, and only the last write for a step is the real one.
    """

    references: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    positions: dict[str, dict[int, tuple[float, bool, float]]] = field(default_factory=dict)

    def clear(self) -> None:
        self.references.clear()
        self.positions.clear()


STORE = FidelityStore()


class FidelityProcessor(ForceTokensProcessor):
    """Teacher forcing (its base class) plus the fidelity comparison, before the forcing.

    A request opts in with ``extra_args["fidelity"] = ["ref", key]`` (the full cache: keep its
    log-probabilities per position under ``key``) or ``["cmp", key, name]`` (compare its raw
    distribution with ``key``'s at each position, under ``name``). It sees the logits before
    any processor changes them (it runs first: the forcing is its own ``apply`` afterwards).
    """

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self.fidelity: dict[int, tuple[list, list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        super().validate_params(sampling_params)
        spec = (getattr(sampling_params, "extra_args", None) or {}).get(FIDELITY_KEY)
        if spec is None:
            return
        ok = isinstance(spec, list) and (
            (len(spec) == 2 and spec[0] == "ref") or (len(spec) == 3 and spec[0] == "cmp")
        )
        if not ok or not all(isinstance(x, str) for x in spec):
            raise ValueError(f'{FIDELITY_KEY}: ["ref", key] or ["cmp", key, name], got {spec!r}')

    def update_state(self, batch_update) -> None:
        super().update_state(batch_update)
        track_rows(self.fidelity, batch_update, lambda params, outputs: (
            None if (spec := (getattr(params, "extra_args", None) or {}).get(FIDELITY_KEY))
            is None else (list(spec), outputs)))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (spec, outputs) in self.fidelity.items():
            if index >= logits.shape[0]:
                continue
            step = len(outputs)
            logprobs = torch.log_softmax(logits[index].float(), dim=-1)  # [V]
            if spec[0] == "ref":
                STORE.references.setdefault(spec[1], {})[step] = logprobs.cpu()
                continue
            ref = STORE.references.get(spec[1], {}).get(step)
            if ref is None:
                continue  # the reference stopped earlier (EOS is ignored: it does not)
            ref = ref.to(logprobs.device)
            kl = float((ref.exp() * (ref - logprobs)).sum())
            top = int(ref.argmax())
            agree = int(logprobs.argmax()) == top
            STORE.positions.setdefault(spec[2], {})[step] = (kl, agree, float(logprobs[top]))
        return super().apply(logits)


# ---------------------------------------------------------------------------------------------
# Samples and arms (pure)


@dataclass(frozen=True)
class Sample:
    """One prompt: ``ids`` and the query-agnostic compression point ``point`` (its last
    ``len(ids) - point`` tokens are the question)."""

    name: str
    kind: str
    ids: tuple[int, ...]
    point: int


@dataclass(frozen=True)
class Arm:
    """One option set: ``kv`` (the request's kv_* fields, a fractional budget) or the full
    cache (``kv`` None: the control)."""

    name: str
    pipeline: str | None = None
    scorer: str | None = None
    budget: float | None = None
    setting: str | None = None
    decode: bool = False
    # An error target (kv_budget {"max_error": e}) instead of the fractional ``budget``.
    max_error: float | None = None
    # A named selection (``--arms``): these kv_* fields whole, instead of the pipeline's and
    # scorer's with the grid's window.
    fields: dict | None = field(default=None, hash=False, compare=False)

    def kv(self, sample: Sample) -> dict | None:
        if self.budget is None and self.max_error is None:
            return None
        budget = self.budget if self.max_error is None else {"max_error": self.max_error}
        if self.fields is not None:
            kv = {**self.fields, "kv_budget": budget, "kv_decode": self.decode}
        else:
            kv = {"kv_budget": budget, "kv_pipeline": self.pipeline, "kv_scorer": self.scorer,
                  "kv_decode": self.decode}  # fmt: skip
            if takes_window(self.pipeline):
                kv["kv_window"] = 32
        if self.setting == "agnostic":
            kv["kv_compress_at"] = sample.point
        elif self.setting == "first":  # where "auto" compresses a prompt it has not seen
            kv["kv_compress_at"] = -FIRST_POINT
        return kv


def arms(pipelines, scorers, budgets, settings, decode: bool = False) -> list[Arm]:
    """The full-cache control then every (pipeline, scorer, budget, setting); streaming has no
    scorer, so it appears once per budget and setting."""
    out = [Arm("full")]
    for setting in settings:
        for budget in budgets:
            for pipeline in pipelines:
                for scorer in scorers if ranks(pipeline) else ["-"]:
                    name = f"{pipeline}+{scorer}@{budget:g}/{setting}"
                    out.append(Arm(name, pipeline, scorer if scorer != "-" else "attn",
                                   budget, setting, decode))  # fmt: skip
    return out


ARM_FIELDS_SET_HERE = ("kv_budget", "kv_compress_at", "kv_decode")


def named_arms(selections: dict[str, dict], budgets, settings,
               decode: bool = False) -> list[Arm]:  # fmt: skip
    """The full-cache control then every named selection (``{name: kv_* fields}``, e.g. the
    candidates of ``configs/choose_defaults.yaml``) at every budget and setting, each arm
    ``NAME@BUDGET/SETTING``. The budget, setting and ``--decode`` set the fields they own."""
    out = [Arm("full")]
    for name, fields in selections.items():
        if not name or any(ch in name for ch in "+@/ "):
            raise ValueError(f"arm name {name!r}: no '+', '@', '/' or spaces (they split "
                             "arm names in the reports)")  # fmt: skip
        owned = sorted(set(fields) & set(ARM_FIELDS_SET_HERE))
        if owned:
            raise ValueError(f"arm {name!r} sets {owned}: --budgets, --settings and --decode "
                             "set those")  # fmt: skip
        if not all(key.startswith("kv_") for key in fields):
            raise ValueError(f"arm {name!r}: only kv_* fields ({sorted(fields)})")
    for setting in settings:
        for budget in budgets:
            for name, fields in selections.items():
                out.append(Arm(f"{name}@{budget:g}/{setting}", fields.get("kv_pipeline"),
                               fields.get("kv_scorer"), budget, setting, decode,
                               fields=dict(fields)))  # fmt: skip
    return out


def _method(arm: str) -> tuple[str, str]:
    """(pipeline, scorer) of a grid arm ``PIPELINE+SCORER@...``; a named arm (``--arms``:
    no ``+``) is its own pipeline and scorer in the reports."""
    method = arm.split("@", 1)[0]
    pipeline, plus, scorer = method.partition("+")
    return (pipeline, scorer) if plus else (method, method)


def slices(ids: Sequence[int], count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens from ``ids`` at seeded, spread-out offsets."""
    if len(ids) < length:
        raise ValueError(f"text of {len(ids)} tokens is shorter than one {length}-token sample")
    rng = random.Random(seed)
    span = len(ids) - length
    starts = sorted(rng.randrange(span + 1) for _ in range(count))
    return [list(ids[s : s + length]) for s in starts]


def code_text() -> str:
    """Python's standard-library source of :data:`CODE_MODULES` (shipped with Python)."""
    import importlib
    import inspect

    return "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in CODE_MODULES)


CHAT_SYSTEM = "You are a careful reader. The user shares passages and asks about them."
CHAT_ASKS = (
    "Summarise this passage in two sentences.",
    "What is the main point of this passage?",
    "Name three people, places or terms that appear in it.",
    "What happens, or what does the code do, in this passage?",
)
CHAT_ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth")
CHAT_REPLY_TOKENS = 48


def chat_ids(tokenizer, messages, generation_prompt: bool) -> list[int]:
    """A conversation as the model's chat template writes it, tokenised once (the template's
    text carries the special tokens)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                         tokenize=False)  # fmt: skip
    return tokenizer(text, add_special_tokens=False).input_ids


def chat_phrase(passage: str, rng: random.Random, words: int = 6) -> str:
    """Up to ``words`` consecutive words of one line of ``passage``, verbatim (a line with at
    least four words, not the last line: the passage goes on after it)."""
    import re

    lines = passage.splitlines()[:-1] or passage.splitlines()
    lines = [ln for ln in lines if len(ln.split()) >= 4] or [passage]
    line = lines[rng.randrange(len(lines))]
    spans = [m.span() for m in re.finditer(r"\S+", line)]
    at = rng.randrange(max(1, len(spans) - words + 1))
    last = spans[min(len(spans), at + words) - 1]
    return line[spans[at][0] : last[1]]


def chat_samples(tokenizer, samples: int, prompt_tokens: int, reply, seed: int = 0) -> list[Sample]:
    """``samples`` multi-turn chats of at most ``prompt_tokens`` tokens, written as a chat
    client would: every user turn shares a passage (160-240 tokens of a KJV book for even
    chats, of Python's standard library for odd ones) with a question about it, and the
    assistant turn after it is the model's own greedy reply (``reply``: token-id prompts ->
    texts, at most :data:`CHAT_REPLY_TOKENS` tokens; the full cache). Turns are added while one
    more still fits; the last user turn quotes six words of an earlier passage and asks how it
    goes on, so the answer lies far back in the context. ``point`` is where that last turn
    starts (query-agnostic arms compress the conversation before the question)."""
    from obcache_vllm.evidence.perplexity import kjv_book

    rng = random.Random(seed + 3000)
    sources = [tokenizer(kjv_book(BOOKS[1])).input_ids, tokenizer(code_text()).input_ids]
    chats = []
    for i in range(samples):
        chats.append({"messages": [{"role": "system", "content": CHAT_SYSTEM}], "passages": [],
                      "source": sources[i % 2], "open": True})  # fmt: skip
    while any(c["open"] for c in chats):
        turn = [c for c in chats if c["open"]]
        for c in turn:
            length = rng.randrange(160, 241)
            start = rng.randrange(len(c["source"]) - length)
            passage = tokenizer.decode(c["source"][start : start + length]).strip()
            ask = CHAT_ASKS[len(c["passages"]) % len(CHAT_ASKS)]
            grown = [*c["messages"], {"role": "user", "content": f"{passage}\n\n{ask}"}]
            # Room for this turn, its reply and the closing question (about 60 tokens).
            room = len(chat_ids(tokenizer, grown, True)) + CHAT_REPLY_TOKENS + 80
            if room > prompt_tokens or len(c["passages"]) == len(CHAT_ORDINALS):
                c["open"] = False
                continue
            c["messages"], c["pending"] = grown, True
            c["passages"].append(passage)
        asking = [c for c in turn if c.pop("pending", False)]
        if not asking:
            continue
        texts = reply([chat_ids(tokenizer, c["messages"], True) for c in asking])
        for c, text in zip(asking, texts, strict=True):
            c["messages"].append({"role": "assistant", "content": text.strip()})
    out = []
    for i, c in enumerate(chats):
        if len(c["passages"]) < 2:
            raise ValueError(f"--prompt-tokens {prompt_tokens} leaves no room for two turns")
        which = rng.randrange(len(c["passages"]) - 1)  # never the last one: far back
        phrase = chat_phrase(c["passages"][which], rng)
        question = (f'In the {CHAT_ORDINALS[which]} passage I shared, what comes right after '
                    f'"{phrase}"? Quote the next sentence.')  # fmt: skip
        head = chat_ids(tokenizer, c["messages"], False)
        ids = chat_ids(tokenizer, [*c["messages"], {"role": "user", "content": question}], True)
        if ids[: len(head)] != head:  # the template must append, not rewrite
            raise ValueError("the chat template rewrites earlier turns: no compression point")
        out.append(Sample(f"chats{i}", "chats", tuple(ids), len(head)))
    return out


def make_samples(tokenizer, kinds, samples: int, prompt_tokens: int, question_tokens: int,
                 seed: int = 0, reply=None) -> list[Sample]:  # fmt: skip
    """``samples`` prompts of each kind, ``prompt_tokens`` long (needles and chats: at most).
    ``reply`` (token-id prompts -> greedy texts) writes the assistant turns of ``chats``."""
    out: list[Sample] = []
    for kind in kinds:
        if kind == "chats":
            if reply is None:
                raise ValueError("chats need an engine to write the assistant turns (reply)")
            out += chat_samples(tokenizer, samples, prompt_tokens, reply, seed)
            continue
        if kind == "needle":
            from obcache_vllm.textgen import needle_parts

            for i in range(samples):
                sentences = max(4, prompt_tokens // 30)
                context, question, _ = needle_parts(sentences, seed=seed + 1000 + i)
                ctx = tokenizer(context).input_ids[: prompt_tokens - 40]
                q = tokenizer(question, add_special_tokens=False).input_ids
                out.append(Sample(f"needle{i}", kind, tuple(ctx + q), len(ctx)))
            continue
        if kind == "repeated":  # redundant documents: one passage of 64-256 tokens, repeated
            from obcache_vllm.evidence.perplexity import kjv_book

            base = tokenizer(kjv_book(BOOKS[0])).input_ids
            rng = random.Random(seed + 2000)
            for i in range(samples):
                period = rng.randrange(64, 257)
                start = rng.randrange(len(base) - period)
                unit = base[start : start + period]
                ids = (unit * -(-prompt_tokens // period))[:prompt_tokens]
                out.append(Sample(f"{kind}{i}", kind, tuple(ids), len(ids) - question_tokens))
            continue
        if kind == "bible":
            from obcache_vllm.evidence.perplexity import kjv_book

            texts = [kjv_book(b) for b in BOOKS[: max(1, min(samples, len(BOOKS)))]]
        elif kind == "code":
            texts = [code_text()]
        else:
            raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
        per_text = -(-samples // len(texts))
        windows = []
        for t, text in enumerate(texts):
            windows += slices(tokenizer(text).input_ids, per_text, prompt_tokens, seed + t)
        for i, ids in enumerate(windows[:samples]):
            out.append(Sample(f"{kind}{i}", kind, tuple(ids), len(ids) - question_tokens))
    return out


# ---------------------------------------------------------------------------------------------
# Statistics (pure)


def request_stats(positions: dict[int, tuple[float, bool, float]], tokens: int) -> dict:
    """Per request: mean KL and agreement over its ``tokens`` positions, and the first
    position where the arm's argmax left the full cache's (``tokens``: never)."""
    missing = [s for s in range(tokens) if s not in positions]
    if missing:
        raise ValueError(f"positions {missing[:5]}... were not compared")
    rows = [positions[s] for s in range(tokens)]
    kls = [r[0] for r in rows]
    first = next((s for s, r in enumerate(rows) if not r[1]), tokens)
    return {
        "kl": sum(kls) / tokens,
        "kl_max": max(kls),
        "agree": sum(r[1] for r in rows) / tokens,
        "first_divergence": first,
        "kl_by_position": [round(k, 6) for k in kls],
    }


def bootstrap_draws(n: int, reps: int = BOOTSTRAP, seed: int = 0) -> list[list[int]]:
    """Index resamples of n paired observations (one draw shared by every arm: paired)."""
    rng = random.Random(seed)
    return [[rng.randrange(n) for _ in range(n)] for _ in range(reps)]


def interval(values: Sequence[float], draws: list[list[int]]) -> tuple[float, float, float]:
    """(mean, 2.5 %, 97.5 %) of the mean over bootstrap ``draws`` of ``values``."""
    means = sorted(sum(values[i] for i in d) / len(d) for d in draws)
    lo, hi = means[int(0.025 * len(means))], means[min(len(means) - 1, int(0.975 * len(means)))]
    return sum(values) / len(values), lo, hi


# The closest published rival (kvpress's DropKV): every scored arm of a run that has it is
# paired with it too.
RIVAL = "dropkv"


def summarize(per_request: dict[str, dict[str, dict]], samples: Sequence[str]) -> dict:
    """Per arm: mean and paired-bootstrap interval of KL, agreement, first divergence and
    kept fraction over ``samples``; per scored arm the difference to ``attn`` and to the
    rival (:data:`RIVAL`; same pipeline, budget and setting) with its paired interval. Arms
    missing a sample are left out."""
    draws = bootstrap_draws(len(samples))
    out: dict[str, dict] = {}
    for arm, rows in per_request.items():
        if any(s not in rows for s in samples):
            continue
        entry = {}
        for metric in ("kl", "agree", "first_divergence", "kept_fraction"):
            values = [rows[s][metric] for s in samples]
            entry[metric] = [round(x, 6) for x in interval(values, draws)]
        out[arm] = entry
    for arm in out:
        if "+" not in arm or "+attn@" in arm:
            continue
        pipeline, rest = arm.split("+", 1)
        base = f"{pipeline}+attn@{rest.split('@', 1)[1]}"
        if base not in out:
            continue
        diff = [per_request[arm][s]["kl"] - per_request[base][s]["kl"] for s in samples]
        out[arm]["kl_minus_attn"] = [round(x, 6) for x in interval(diff, draws)]
    for arm in out:  # against the closest rival, the same pipeline, budget and setting
        pipeline, _, rest = arm.partition("+")
        rival = f"{pipeline}+{RIVAL}@{rest.partition('@')[2]}"
        if rest and not rest.startswith(f"{RIVAL}@") and rival in out:
            diff = [per_request[arm][s]["kl"] - per_request[rival][s]["kl"] for s in samples]
            out[arm]["kl_minus_rival"] = [round(x, 6) for x in interval(diff, draws)]
    for arm in out:  # an allocation against its uniform host: same scorer, budget, setting
        pipeline, _, rest = arm.partition("+")
        host = f"{host_of(pipeline)}+{rest}" if host_of(pipeline) else None
        if host in out:
            diff = [per_request[arm][s]["kl"] - per_request[host][s]["kl"] for s in samples]
            out[arm]["kl_minus_host"] = [round(x, 6) for x in interval(diff, draws)]
    return out


# ---------------------------------------------------------------------------------------------
# Report (pure)


def _fmt(triple, digits=3) -> str:
    mean, lo, hi = triple
    return f"{mean:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _lengths(results: dict) -> str:
    """"1024 tokens each", or the range where needles and chats make them differ."""
    sizes = [s["tokens"] for s in results["samples"] if "tokens" in s]
    if not sizes or min(sizes) == max(sizes):
        return f"{sizes[0] if sizes else results['prompt_tokens']} tokens each"
    return f"{min(sizes)}-{max(sizes)} tokens (mean {sum(sizes) / len(sizes):.0f})"


def _reference_note(results: dict) -> str:
    dtype = results.get("kv_cache_dtype", "auto")
    ref = results.get("reference_kv_cache_dtype", dtype)
    if ref == dtype:
        return ""
    return (f" The full cache compared with is the `{ref}` KV cache's; every arm, `full` "
            f"included, runs on the `{dtype}` cache (`full`: what that cache alone costs).")


def render(results: dict) -> str:
    """fidelity.md: the command, the samples, one row per arm."""
    summary = results["summary"]
    estimate = results.get("estimate")
    with_rival = any("kl_minus_rival" in row for row in summary.values())
    lines = [
        f"Command: `{results['command']}`  ",
        *(f"{len(a['arms'])} arm{'s' * (len(a['arms']) != 1)} added {a['date']} "
          f"({a['seconds']:.0f} s, the full cache checked against the recorded one): "
          f"`{a['command']}`  "
          for a in results.get("added", [])),
        f"Model {results['model_name']}, {results['date']}, {results['seconds']:.0f} s; "
        f"{len(results['samples'])} prompts ({results['kinds']}), {_lengths(results)}, "
        f"{results['tokens']} forced tokens (the full cache's greedy "
        "continuation). Means over prompts with 95 % paired-bootstrap intervals."
        + (f" KL: the {results['estimate']} estimate, a lower bound." if estimate else "")
        + _reference_note(results),
        "",
        f"| arm | kept fraction | KL(full ‖ arm){' estimate' if estimate else ''}, nats/token | "
        "top-1 agreement | first divergence (token) | KL − attn's |"
        + (f" KL − {RIVAL}'s |" if with_rival else ""),
        "|---|---|---|---|---|---|" + ("---|" if with_rival else ""),
    ]

    def order(arm: str):
        if arm == "full":
            return ("", 0.0, "")
        pipeline, scorer = _method(arm)
        budget, setting = arm.split("@", 1)[1].split("/")
        return (setting, float(budget), pipeline + scorer if pipeline != scorer else pipeline)

    for arm in sorted(summary, key=order):
        s = summary[arm]
        diff = _fmt(s["kl_minus_attn"], 4) if "kl_minus_attn" in s else "-"
        rival = (_fmt(s["kl_minus_rival"], 4) if "kl_minus_rival" in s else "-") + " |"
        lines.append(
            f"| {arm} | {s['kept_fraction'][0]:.3f} | {_fmt(s['kl'], 4)} | "
            f"{_fmt(s['agree'], 3)} | {_fmt(s['first_divergence'], 1)} | {diff} |"
            + (f" {rival}" if with_rival else "")
        )
    paired = sorted((arm for arm in summary if "kl_minus_host" in summary[arm]), key=order)
    if paired:
        lines += [
            "",
            "Each reallocating arm against its uniform host's arm of the same scorer, budget and "
            "setting (the same kept tokens per layer), paired over the prompts:",
            "",
            "| arm | host | KL − host's | KL / host's |",
            "|---|---|---|---|",
        ]
        for arm in paired:
            pipeline, rest = arm.split("+", 1)
            host = f"{host_of(pipeline)}+{rest}"
            ratio = summary[arm]["kl"][0] / max(summary[host]["kl"][0], 1e-12)
            lines.append(f"| {arm} | {host} | {_fmt(summary[arm]['kl_minus_host'], 4)} | "
                         f"{ratio:.2f} |")  # fmt: skip
    check = results.get("topk_check")
    if check:
        lines += [
            "",
            f"The top-{check['k']} estimate (what `--server` measures) on the same engine, "
            f"prompts and arms, against the whole-vocabulary measure above: estimated KL / KL "
            f"{check['ratio']:.3f} pooled over {check['requests']} requests; the same top-1 "
            f"agreement in {check['agree_same']:.1%} of them and the same first divergence in "
            f"{check['first_same']:.1%}.",
            "",
            "| arm | estimated KL / KL | reference mass covered | same agreement | same first "
            "divergence |",
            "|---|---|---|---|---|",
        ]
        for arm in sorted(check["arms"], key=order):
            c = check["arms"][arm]
            ratio = "-" if c["ratio"] is None else f"{c['ratio']:.3f}"
            lines.append(f"| {arm} | {ratio} | {c['covered']:.3f} | {c['agree_same']:.0%} | "
                         f"{c['first_same']:.0%} |")  # fmt: skip
    return "\n".join(lines) + "\n"


# How far a later run's full-cache log-probs may be from the recorded ones for its arms to be
# added to the recorded run (float32 on the same build; batches differ, so not bit-equal).
ADD_TOLERANCE = 1e-3
# What must be the same for a later run's arms to be paired with a recorded run's.
SAME_SETUP = ("kinds", "prompt_tokens", "question_tokens", "tokens", "kv_cache_dtype",
              "reference_kv_cache_dtype")  # fmt: skip


def add_arms(recorded: dict, later: dict) -> dict:
    """``recorded`` (a fidelity.json) with the arms of ``later`` (a run on the same prompts
    whose other arms are new) added: the prompts, their lengths and the setup must be the same,
    and the later run's full cache must reproduce the recorded one's forced log-probs within
    :data:`ADD_TOLERANCE` on every prompt (the same continuation, the same reference), or
    ValueError. The summary is derived again; ``added`` records the later command."""
    for key in SAME_SETUP:
        if recorded.get(key, "auto") != later.get(key, "auto"):
            raise ValueError(f"{key}: {later.get(key)!r} differs from the recorded "
                             f"{recorded.get(key)!r}")  # fmt: skip
    if json.loads(json.dumps(later["samples"])) != recorded["samples"]:  # tuples as JSON has them
        raise ValueError("the prompts differ from the recorded ones (kinds, samples, seed)")
    for name, row in recorded["per_request"]["full"].items():
        got = later["per_request"]["full"][name]["logprobs"]
        gap = max((abs(a - b) for a, b in zip(got, row["logprobs"], strict=True)), default=0.0)
        if gap > ADD_TOLERANCE:
            raise ValueError(f"{name}: the full cache's log-probs differ from the recorded "
                             f"ones by {gap:.2g} (> {ADD_TOLERANCE}): not the same reference")
    new = [a for a in later["arms"] if a["name"] != "full"]
    clash = sorted({a["name"] for a in new} & set(recorded["per_request"]))
    if clash:
        raise ValueError(f"arms already recorded: {', '.join(clash)}")
    per_request = {**recorded["per_request"],
                   **{a["name"]: later["per_request"][a["name"]] for a in new}}  # fmt: skip
    names = [s["name"] for s in recorded["samples"]]
    return {**recorded, "arms": [*recorded["arms"], *new], "per_request": per_request,
            "summary": summarize(per_request, names),
            "added": [*recorded.get("added", []),
                      {"command": later["command"], "date": later["date"],
                       "seconds": later["seconds"], "arms": [a["name"] for a in new]}]}


def plot(results: dict, path: Path) -> Path | None:
    """Kept fraction against mean KL: one panel per setting, colour = scorer, line style =
    pipeline (two small legends instead of one entry per line)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        return None
    series: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    for arm, s in results["summary"].items():
        if arm == "full":
            continue
        pipeline, scorer = _method(arm)
        setting = arm.split("@", 1)[1].split("/", 1)[1]
        point = (s["kept_fraction"][0], s["kl"][0])
        series.setdefault((setting, pipeline, scorer), []).append(point)
    settings = sorted({k[0] for k in series}, key=lambda x: SETTINGS.index(x) if x in SETTINGS
                      else 99)  # fmt: skip
    pipelines = sorted({k[1] for k in series})
    scorers = sorted({k[2] for k in series})
    # Fixed across runs (a run without h2o draws snapkv as every other run does).
    known = sorted(PIPELINES) + sorted(set(pipelines) - set(PIPELINES))
    dashes = ["-", "--", ":", "-.", (0, (5, 1))]
    styles = {p: dashes[i % len(dashes)] for i, p in enumerate(known)}
    known = sorted(SCORERS) + sorted(set(scorers) - set(SCORERS) - {"-"})
    palette = plt.get_cmap("tab20").colors if len(known) > 10 else plt.get_cmap("tab10").colors
    colours = {c: palette[i % len(palette)] for i, c in enumerate(known)}
    colours["-"] = "black"  # streaming: no scorer
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 5), sharey=True,
                             squeeze=False)  # fmt: skip
    for ax, setting in zip(axes[0], settings, strict=True):
        for (s_name, pipeline, scorer), points in sorted(series.items()):
            if s_name != setting:
                continue
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3,
                    color=colours[scorer], linestyle=styles[pipeline], linewidth=1.2)  # fmt: skip
        ax.set_title(f"{setting}", fontsize=10)
        ax.set_xlabel("kept fraction of the prompt (per layer and KV head)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("KL(full || arm), nats per token (mean over prompts)")
    scorer_keys = [Line2D([], [], color=colours[c], label=c if c != "-" else "none (streaming)")
                   for c in scorers]  # fmt: skip
    pipe_keys = [Line2D([], [], color="grey", linestyle=styles[p], label=p) for p in pipelines]
    axes[0][0].legend(handles=scorer_keys, title="scorer", fontsize=7, loc="lower left")
    axes[0][-1].legend(handles=pipe_keys, title="pipeline", fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_reports(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "fidelity.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "fidelity.md").write_text(render(results))
    paths = [out / "fidelity.json", out / "fidelity.md"]
    png = plot(results, out / "fidelity.png")
    return paths + ([png] if png else [])


# ---------------------------------------------------------------------------------------------
# The run (vLLM)


def run(llm, samples: Sequence[Sample], arm_list: Sequence[Arm], tokens: int,
        progress=None, reference_llm=None) -> dict[str, dict[str, dict]]:  # fmt: skip
    """Both phases on one in-process engine built with ``logits_processors=[FIDELITY_FQCN]``
    (the reference on ``reference_llm`` when given: another ``--kv-cache-dtype``, built the
    same way); returns ``{arm: {sample: request stats + kept_fraction + usage}}``."""
    continuation = reference(reference_llm or llm, samples, tokens)
    return compare(llm, samples, arm_list, continuation, tokens, progress)


def reference(llm, samples: Sequence[Sample], tokens: int) -> dict[str, list[int]]:
    """Phase 1: the full cache's greedy continuation of each sample, its distributions kept
    in :data:`STORE` (``references``) for :func:`compare`."""
    from vllm import SamplingParams

    STORE.clear()
    ref_params = [
        SamplingParams(
            temperature=0,
            max_tokens=tokens,
            ignore_eos=True,
            detokenize=False,
            extra_args={FIDELITY_KEY: ["ref", s.name]},
        )  # fmt: skip
        for s in samples
    ]
    prompts = [{"prompt_token_ids": list(s.ids)} for s in samples]
    outs = llm.generate(prompts, ref_params, use_tqdm=False)
    continuation = {
        s.name: list(o.outputs[0].token_ids) for s, o in zip(samples, outs, strict=True)
    }
    for s in samples:
        if len(STORE.references.get(s.name, {})) < tokens:
            raise RuntimeError(f"{s.name}: the reference kept {len(STORE.references[s.name])} "
                               f"of {tokens} positions")  # fmt: skip
    return continuation


def compare(llm, samples: Sequence[Sample], arm_list: Sequence[Arm],
            continuation: dict[str, list[int]], tokens: int,
            progress=None) -> dict[str, dict[str, dict]]:  # fmt: skip
    """Phase 2: every arm teacher-forced on the reference's continuation, its distributions
    compared with the reference's at each position."""
    from obcache_vllm.evidence.forcing import forced_params

    requests, params, keys = [], [], []
    for arm in arm_list:
        for s in samples:
            name = f"{arm.name}|{s.name}"
            extra = {**(arm.kv(s) or {}), FIDELITY_KEY: ["cmp", s.name, name]}
            requests.append({"prompt_token_ids": list(s.ids)})
            params.append(forced_params(continuation[s.name], extra))
            keys.append((arm, s, name))
    outs = llm.generate(requests, params, use_tqdm=progress is not None)
    result: dict[str, dict[str, dict]] = {}
    for (arm, s, name), out in zip(keys, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        if got != continuation[s.name]:
            raise RuntimeError(f"{name}: forced tokens were not emitted")
        stats = request_stats(STORE.positions.get(name, {}), tokens)
        comp = out.outputs[0]  # the raw logprob vLLM returned for each forced token
        stats["logprobs"] = [
            round(float(lp[t].logprob), 6) for lp, t in zip(comp.logprobs, got, strict=True)
        ]
        usage = (out.kv_transfer_params or {}).get("obcache") or {}
        stats["kept_fraction"] = usage.get("prompt_tokens_kept", len(s.ids)) / len(s.ids)
        stats["usage"] = usage
        result.setdefault(arm.name, {})[s.name] = stats
    return result


def topk_check(exact: dict[str, dict[str, dict]], estimate: dict[str, dict[str, dict]],
               k: int) -> dict:  # fmt: skip
    """How the top-k estimate (what ``--server`` measures) compares with the whole-vocabulary
    measure on the same engine, prompts and arms: per arm the ratio of the mean KLs, and the
    share of requests whose top-1 agreement and first divergence are the same."""
    arms, pooled = {}, [0.0, 0.0, 0, 0, 0]
    for arm, by_sample in estimate.items():
        if arm == "full":
            continue
        est = sum(r["kl"] for r in by_sample.values())
        ex = sum(exact[arm][s]["kl"] for s in by_sample)
        agree = sum(r["agree"] == exact[arm][s]["agree"] for s, r in by_sample.items())
        first = sum(r["first_divergence"] == exact[arm][s]["first_divergence"]
                    for s, r in by_sample.items())  # fmt: skip
        n = len(by_sample)
        arms[arm] = {"ratio": est / ex if ex else None, "agree_same": agree / n,
                     "first_same": first / n, "covered": sum(r["covered"] for r in
                                                             by_sample.values()) / n}  # fmt: skip
        for i, v in enumerate((est, ex, agree, first, n)):
            pooled[i] += v
    return {"k": k, "arms": arms, "ratio": pooled[0] / pooled[1] if pooled[1] else None,
            "agree_same": pooled[2] / max(1, pooled[4]),
            "first_same": pooled[3] / max(1, pooled[4]), "requests": pooled[4]}  # fmt: skip


def greedy_replies(llm, max_tokens: int = CHAT_REPLY_TOKENS):
    """The full cache's greedy replies to token-id prompts (the assistant turns of chats)."""

    def reply(prompts: list[list[int]]) -> list[str]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].text for o in outs]

    return reply


def main(args) -> int:
    """``obcache-vllm eval fidelity`` (arguments from :mod:`obcache_vllm.evidence.eval.command`):
    in process, over the whole vocabulary; with ``--server``, the top-k estimate over HTTP
    (:mod:`obcache_vllm.evidence.fidelity_topk`)."""
    if args.report_only is not None:  # the summary is derived again: new columns show up
        results = json.loads(args.report_only.read_text())
        names = [sample["name"] for sample in results["samples"]]
        results["summary"] = summarize(results["per_request"], names)
        for path in write_reports(results, args.out):
            print(path)
        return 0
    recorded = None
    if getattr(args, "add_to", None) is not None:
        if args.server or args.check_topk:
            print("--add-to: in process only, without --check-topk", file=sys.stderr)
            return 2
        recorded = json.loads(args.add_to.read_text())
    from obcache_vllm.evidence.perplexity import in_process_engine

    if args.server:
        from obcache_vllm import model as model_mod

        args.model = args.model or str(model_mod.pull(log=lambda m: None))
    else:
        args.model = in_process_engine(args.model)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    if getattr(args, "arms", None) is not None:
        arm_list = named_arms(json.loads(args.arms.read_text()), args.budgets, args.settings,
                              args.decode)  # fmt: skip
    else:
        arm_list = arms(args.pipelines, args.scorers, args.budgets, args.settings, args.decode)
    if recorded is not None:  # the full cache again, as the check that the reference is the same
        have = recorded["per_request"]
        arm_list = [a for a in arm_list if a.name == "full" or a.name not in have]
        if len(arm_list) == 1:
            print(f"--add-to {args.add_to}: it has every arm asked for", file=sys.stderr)
            return 2

    def samples_with(reply):
        return make_samples(tok, args.kinds, args.samples, args.prompt_tokens,
                            args.question_tokens, args.seed, reply=reply)  # fmt: skip

    start = time.time()
    extra: dict = {}
    if args.server:
        from obcache_vllm.evidence import fidelity_topk

        got = fidelity_topk.main(args, tok, samples_with, arm_list)
        samples, per_request = got.pop("samples"), got.pop("per_request")
        extra = got  # the estimate's label
    else:
        import gc

        from vllm import LLM

        def engine(kv_cache_dtype: str):
            return LLM(model=args.model, dtype="float32", enforce_eager=True, block_size=32,
                       seed=0, max_model_len=args.prompt_tokens + args.tokens + 64,
                       max_num_seqs=args.max_batch, max_num_batched_tokens=args.chunk,
                       kv_cache_dtype=kv_cache_dtype, logits_processors=[FIDELITY_FQCN],
                       logprobs_mode="raw_logprobs")  # fmt: skip

        dtype = getattr(args, "kv_cache_dtype", "auto")
        ref_dtype = getattr(args, "reference_kv_cache_dtype", None) or dtype
        if ref_dtype != dtype:  # the reference first, in an engine of its own
            ref_llm = engine(ref_dtype)
            samples = samples_with(greedy_replies(ref_llm))
            print(f"fidelity: the {ref_dtype} cache's reference", file=sys.stderr)
            continuation = reference(ref_llm, samples, args.tokens)
            del ref_llm
            gc.collect()
            llm = engine(dtype)
            print(f"fidelity: {len(samples)} prompts x {len(arm_list)} arms", file=sys.stderr)
            per_request = compare(llm, samples, arm_list, continuation, args.tokens, True)
        else:
            llm = engine(dtype)
            samples = samples_with(greedy_replies(llm))
            print(f"fidelity: {len(samples)} prompts x {len(arm_list)} arms", file=sys.stderr)
            per_request = run(llm, samples, arm_list, args.tokens, progress=True)
        if args.check_topk:
            from obcache_vllm.evidence import fidelity_topk

            checked = [a for a in arm_list if not a.decode and a.max_error is None]
            estimate = fidelity_topk.run(fidelity_topk.EngineClient(llm), samples, checked,
                                         args.tokens, args.check_topk)  # fmt: skip
            extra["topk_check"] = topk_check(per_request, estimate, args.check_topk)
    names = [s.name for s in samples]
    results = {
        "command": "obcache-vllm eval fidelity " + " ".join(args.argv),
        "model_name": Path(args.model).name,
        "date": time.strftime("%Y-%m-%d"),
        "seconds": time.time() - start,
        "kinds": ",".join(args.kinds),
        "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto"),
        "reference_kv_cache_dtype": (getattr(args, "reference_kv_cache_dtype", None)
                                     or getattr(args, "kv_cache_dtype", "auto")),
        "prompt_tokens": args.prompt_tokens,
        "question_tokens": args.question_tokens,
        "tokens": args.tokens,
        **extra,
        "samples": [
            {"name": s.name, "kind": s.kind, "tokens": len(s.ids), "point": s.point}
            for s in samples
        ],  # fmt: skip
        "arms": [asdict(a) for a in arm_list],
        "per_request": per_request,
        "summary": summarize(per_request, names),
    }
    if recorded is not None:
        try:
            results = add_arms(recorded, results)
        except ValueError as exc:
            print(f"--add-to {args.add_to}: {exc}; nothing written", file=sys.stderr)
            return 2
        args.out = args.add_to.parent
    for path in write_reports(results, args.out):
        print(path)
    return 0
