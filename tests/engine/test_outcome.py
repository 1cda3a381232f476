"""The KV outcome a budgeted request reports (what the server puts in ``usage.obcache``).

The scheduler puts it on every engine output of a budgeted request
(``kv_transfer_params["obcache"]``); offline, the final ``RequestOutput`` carries it as is.
"""

from __future__ import annotations

from support.texts import haystack

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
