"""Stock vLLM (obcache plugin disabled) in this process, answering batches of requests.

Usage: ``python stock_runner.py ENGINE_KWARGS_JSON`` with ``VLLM_PLUGINS=`` (empty) in the
environment; the tests' :class:`support.engine.StockReference` starts it once per engine
setting. Each line on stdin is a JSON list of batches, ``[[{"prompt_token_ids": [...],
"max_tokens": n}, ...], ...]`` (a request may also carry ``temperature`` (default 0), ``seed``,
``ignore_eos`` and ``extra_args``); each batch is one ``LLM.generate`` call, so batch
composition matches the plugin-side run. The answer is one stdout line, ``@@stock@@`` and the
token ids, batch by batch, as JSON. The prefix cache is emptied before each line, so each answer
is what a fresh engine gives. vLLM's own output goes to stderr. End of input: exit.

Between answers the runner stops itself (SIGSTOP; the parent continues it with a request): an
idle in-process engine still wakes every few milliseconds, and on a 2-core machine those
wake-ups stall the plugin engine's OpenMP barriers (a 1,000-token generation beside an idle
runner took 104.7 s, against 69.8 s without one). It dies with its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys

MARK = "@@stock@@"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def run_batches(llm, batches: list[list[dict]]) -> list[list[list[int]]]:
    from vllm import SamplingParams

    results = []
    for batch in batches:
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
    return results


def main() -> None:
    if os.environ.get("VLLM_PLUGINS", None) != "":
        raise SystemExit("stock_runner must run with VLLM_PLUGINS= (empty): stock vLLM")
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's logging and prints go to stderr, the protocol keeps stdout
    from vllm import LLM

    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # not left stopped, orphaned
    llm = LLM(**json.loads(sys.argv[1]))
    os.kill(os.getpid(), signal.SIGSTOP)  # loaded: idle until the first request
    for line in sys.stdin:
        if not line.strip():
            continue
        if not llm.reset_prefix_cache():
            raise SystemExit("stock_runner: the prefix cache could not be reset")
        answers.write(MARK + json.dumps(run_batches(llm, json.loads(line))) + "\n")
        answers.flush()
        os.kill(os.getpid(), signal.SIGSTOP)


if __name__ == "__main__":
    main()
