"""The concurrent stress of KV reuse, short form (the long one: ``make stress``).

Seeded cases of requests in flight together over shared documents (see support/stress.py for
what is drawn and what must hold). ``OBCACHE_STRESS_SEED`` picks another seed; every failure
names its case and the command that replays it.
"""

from __future__ import annotations

import os

import pytest
from support.engine import POOL_BLOCKS, run_stock
from support.stress import Stress, draw_case, replay
from support.texts import haystack

SEED = os.environ.get("OBCACHE_STRESS_SEED", "suite")
CASES = int(os.environ.get("OBCACHE_STRESS_SUITE_CASES", "10"))

pytestmark = pytest.mark.slow


def corpus(tokenizer, sizes=((21, 709), (22, 517), (23, 117))):
    """Three documents whose lengths are not multiples of the block size (the last short
    enough that two prompts prefill in one step), and questions. ``sizes``: (seed, tokens)."""
    docs = [tokenizer(haystack(60, seed=s)).input_ids[:n] for s, n in sizes]
    questions = [tokenizer(f" Question: {q}? Answer:").input_ids for q in (
        "which town traded the most crates", "in which season did it happen",
        "who carried the glass", "what came first")]  # fmt: skip
    return docs, questions


def test_concurrent_reuse_stress(engine, tokenizer, engine_kwargs):
    assert engine.llm.reset_prefix_cache()
    stress = Stress(engine, POOL_BLOCKS)
    docs, questions = corpus(tokenizer)
    problems, unbudgeted, totals = [], {}, {}
    for index in range(CASES):
        case = draw_case(SEED, index, docs, questions)
        outcome = stress.check(case)
        print(f"case {case.seed}: {case.describe()} -> {dict(outcome.stats)}")
        for key, value in outcome.stats.items():
            totals[key] = totals.get(key, 0) + value
        if outcome.problems:
            problems.append(f"case {case.seed} [{case.describe()}]: {outcome.problems}; "
                            f"{replay(SEED, index)}")  # fmt: skip
        for spec in case.specs:
            if spec.kv is None and spec.follows is None and spec.name in outcome.tokens:
                unbudgeted[(tuple(spec.prompt), spec.max_tokens)] = outcome.tokens[spec.name]
    print("totals", totals)
    assert not problems, "\n".join(problems)
    # What the stress must have exercised to mean anything.
    assert totals.get("compress_at_hit", 0) >= 3 and totals.get("session_hit", 0) >= 1
    assert totals.get("preemptions", 0) >= 1 and totals.get("aborted", 0) >= 1
    assert engine.runner.obcache.oracle.checks > 0
    # Unbudgeted requests in flight with all of this: stock vLLM's tokens, each alone.
    specs = sorted(unbudgeted)
    stock = run_stock(engine_kwargs, [[{"prompt_token_ids": list(p), "max_tokens": m}]
                                      for p, m in specs])  # fmt: skip
    assert [unbudgeted[s] for s in specs] == [out for (out,) in stock]
