"""Run requests on STOCK vLLM (obcache plugin disabled) and write the generated token ids.

Usage: ``python stock_runner.py IN.json OUT.json`` with ``VLLM_PLUGINS=`` (empty) in the
environment. IN.json: ``{"engine": {...LLM kwargs...}, "batches": [[{"prompt_token_ids": [...],
"max_tokens": n, "extra_args": {...}}, ...], ...]}`` (optional per request: ``temperature``
(default 0), ``seed``, ``ignore_eos``); each batch is one ``LLM.generate`` call,
so batch composition matches the plugin-side run. OUT.json: the token ids, batch by batch.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    if os.environ.get("VLLM_PLUGINS", None) != "":
        raise SystemExit("stock_runner must run with VLLM_PLUGINS= (empty): stock vLLM")
    from vllm import LLM, SamplingParams

    spec = json.loads(open(sys.argv[1]).read())
    llm = LLM(**spec["engine"])
    results = []
    for batch in spec["batches"]:
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in batch]
        params = [
            SamplingParams(
                temperature=r.get("temperature", 0),
                seed=r.get("seed"),
                ignore_eos=r.get("ignore_eos", False),
                max_tokens=r["max_tokens"],
                extra_args=r.get("extra_args"),
            )
            for r in batch
        ]
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([list(o.outputs[0].token_ids) for o in outs])
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
