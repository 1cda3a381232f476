"""The offline ``LLM`` with the plugin, engine settings from the spec: greedy tokens and
``usage.obcache`` of one prompt (token ids) under each request's ``extra_args``, one request at
a time. Run as a script by tests/server/test_offline_defaults.py. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    spec = json.loads(sys.argv[1])
    llm = LLM(**spec["engine"])
    runs = []
    for extra in spec["requests"]:
        params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True,
                                extra_args=extra)  # fmt: skip
        out = llm.generate([{"prompt_token_ids": spec["prompt"]}], params, use_tqdm=False)[0]
        runs.append({"tokens": list(out.outputs[0].token_ids),
                     "usage": (out.kv_transfer_params or {}).get("obcache")})  # fmt: skip
    print("OFFLINE_PROBE " + json.dumps(runs), flush=True)


if __name__ == "__main__":
    main()
