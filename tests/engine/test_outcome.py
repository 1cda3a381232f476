"""The KV outcome a budgeted request reports (what the server puts in ``usage.obcache``).

The scheduler puts it on every engine output of a budgeted request
(``kv_transfer_params["obcache"]``); offline, the final ``RequestOutput`` carries it as is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from support.texts import haystack

# One reply per mode, shown in the REST reference (scripts/gen_reference.py); the test below
# compares it with the engine's (OBCACHE_WRITE_EXAMPLES=1 rewrites it).
EXAMPLES = Path(__file__).resolve().parents[2] / "results" / "usage" / "examples.json"
# Modes whose kept counts follow the scores (not block arithmetic alone): compared by key.
SCORE_DEPENDENT = {"target", "adakv"}

BS = 32


def test_final_output_carries_the_scheduler_record(llm, engine) -> None:
    from vllm import SamplingParams

    prompt = haystack(12, seed=11)
    params = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True,
        extra_args={"kv_budget": 64, "kv_scorer": "attn", "kv_pipeline": "snapkv"},
    )  # fmt: skip
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    kv = out.kv_transfer_params["obcache"]
    record = engine.scheduler.obcache_finished[-1]
    n = len(out.prompt_token_ids)
    assert kv == {
        "resident_tokens": record.resident_tokens,
        "evicted_tokens": record.tokens_evicted,
        "freed_blocks": record.blocks_freed,
        "evictions": 1,
        "prompt_tokens_kept": record.kept_prompt,
        "budget": 64,
        "scorer": "attn",
        "pipeline": "snapkv",
    }
    assert record.prompt_len == n and 64 <= record.kept_prompt < 64 + BS
    assert record.tokens_evicted == n - record.kept_prompt == record.blocks_freed * BS
    assert record.resident_tokens == record.kept_prompt + 6 - 1
    assert (record.scorer, record.pipeline) == ("attn", "snapkv")


def test_unbudgeted_output_carries_nothing(llm) -> None:
    from vllm import SamplingParams

    out = llm.generate(["Hello there"], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.kv_transfer_params is None


def test_the_kept_count_follows_the_documented_rule_in_every_mode(llm) -> None:
    """``ledger.KEPT_RULE`` (rendered in the REST reference) on the real engine: a fixed
    budget keeps ``budget <= kept < budget + 32``; a short prompt keeps everything; an error
    target's ``budget`` is its choice and its floor is ``budget_floor``; with
    ``kv_compress_at`` the tail after the point is kept whole; adakv reports the mean over
    heads."""
    from vllm import SamplingParams

    prompt = haystack(20, seed=12)
    n = len(llm.get_tokenizer()(prompt)["input_ids"])
    cases = {
        "fixed": {"kv_budget": 100},
        "short": {"kv_budget": n + 50},
        "target": {"kv_budget": {"max_error": 0.05}, "kv_scorer": "attn", "kv_pipeline": "tova"},
        "compress_at": {"kv_budget": 64, "kv_compress_at": n - 40},
        "adakv": {"kv_budget": 96, "kv_pipeline": "adakv"},
    }
    outs = llm.generate(
        # a cache salt each: no request reads another's blocks from the prefix cache
        [{"prompt": prompt, "cache_salt": f"rule-{name}"} for name in cases],
        [SamplingParams(temperature=0, max_tokens=2, extra_args=x) for x in cases.values()],
        use_tqdm=False,
    )
    kv = {name: o.kv_transfer_params["obcache"] for name, o in zip(cases, outs, strict=True)}
    assert all(len(o.prompt_token_ids) == n for o in outs)

    fixed = kv["fixed"]
    assert fixed["budget"] <= fixed["prompt_tokens_kept"] < fixed["budget"] + BS, fixed
    assert "budget_floor" not in fixed

    short = kv["short"]
    assert short["prompt_tokens_kept"] == n and short["evicted_tokens"] == 0, short

    target = kv["target"]
    assert target["budget"] == target["chosen_budget"] == target["prompt_tokens_kept"], target
    assert target["budget_floor"] <= target["budget"] < n and (n - target["budget"]) % BS == 0

    at = kv["compress_at"]
    tail = n - at["compress_at"]
    assert at["budget"] <= at["prompt_tokens_kept"] - tail < at["budget"] + BS, at

    ada = kv["adakv"]
    assert ada["evicted_tokens"] > 0 and ada["prompt_tokens_kept"] < n, ada

    examples = {name: {"request": cases[name], "prompt_tokens": n, "obcache": kv[name]}
                for name in cases}  # fmt: skip
    if os.environ.get("OBCACHE_WRITE_EXAMPLES") == "1":
        EXAMPLES.parent.mkdir(parents=True, exist_ok=True)
        EXAMPLES.write_text(json.dumps(examples, indent=1) + "\n")
    shown = json.loads(EXAMPLES.read_text())
    assert shown.keys() == examples.keys()
    for name, example in examples.items():
        assert shown[name]["request"] == example["request"], name
        assert shown[name]["obcache"].keys() == example["obcache"].keys(), name
        if name not in SCORE_DEPENDENT:
            assert shown[name] == example, (name, shown[name], example)
