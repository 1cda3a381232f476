"""Does the engine survive a request? (a fresh engine per run: a death must not end the session).

Run as a script by test_fuzz_findings.py: ``python survival_probe.py SPEC.json`` with
``{"engine": {...LLM kwargs...}, "requests": [{"prompt_token_ids": [...], "max_tokens": n,
"extra_args": {...}}, ...]}``. Each request is generated alone, in order, then one plain
greedy request. Prints one JSON line: per request, its tokens or the error it raised; and
whether the plain request after them was served (the engine is alive).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    spec = json.loads(open(sys.argv[1]).read())
    llm = LLM(**spec["engine"])
    results = []
    for r in spec["requests"]:
        params = SamplingParams(
            temperature=0, max_tokens=r["max_tokens"], extra_args=r.get("extra_args")
        )
        try:
            out = llm.generate(
                [{"prompt_token_ids": r["prompt_token_ids"]}], params, use_tqdm=False
            )
            results.append({"tokens": list(out[0].outputs[0].token_ids)})
        except Exception as exc:  # noqa: BLE001 - what the engine does is the finding
            results.append({"error": f"{type(exc).__name__}: {exc}"[:500]})
    try:
        plain = llm.generate(
            ["The capital of France is"],
            SamplingParams(temperature=0, max_tokens=4),
            use_tqdm=False,
        )
        alive = len(plain[0].outputs[0].token_ids) == 4
    except Exception:  # noqa: BLE001
        alive = False
    print("SURVIVAL_PROBE " + json.dumps({"results": results, "alive": alive}))


if __name__ == "__main__":
    main()
