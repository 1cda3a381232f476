"""Offline: vLLM's ``LLM`` in your own process, one request with a KV budget.

    .venv/bin/python examples/offline.py                 # budget 128, the default model
    .venv/bin/python examples/offline.py --budget 0.25 --model /path/to/hf-model

The plugin is active in any vLLM process once obcache-vllm is installed; the options go in
``SamplingParams.extra_args``. Settings that matter on CPU, set before vLLM starts:

* ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV pool): without it vLLM sizes the pool from the
  machine's memory and refuses to start when something else already holds memory;
* ``VLLM_USE_V2_MODEL_RUNNER=0``: the model runner this project hooks (``obcache-vllm serve``
  sets it too);
* ``block_size``: eviction frees whole blocks, so a compressed prompt keeps K tokens with
  ``budget <= K < budget + block_size``. vLLM's CPU default is 128; the server uses 32;
* ``enforce_eager=True``: no torch.compile, as ``obcache-vllm serve``. vLLM's default compiles
  the model first, which took about four and a half minutes of start-up on a 2-core machine.

The ``if __name__ == "__main__":`` guard is needed: vLLM starts processes that re-import this
file.
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=128, help="tokens (>= 1) or a fraction")
    ap.add_argument("--model", default=None, help="HF model directory (default: the default "
                    "model, provisioned as `obcache-vllm model pull` does)")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")

    from vllm import LLM, SamplingParams

    from obcache_vllm import model
    from obcache_vllm.textgen import haystack

    path = args.model or str(model.pull(log=lambda message: None))
    llm = LLM(model=path, block_size=32, max_model_len=4096, enforce_eager=True)
    budget = int(args.budget) if args.budget >= 1 else args.budget
    prompt = haystack(20, seed=0) + "\nQuestion: which town is named first? Answer:"
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                            extra_args={"kv_budget": budget, "kv_scorer": "obcache_key"})
    out = llm.generate([prompt], params)[0]
    print("answer:", out.outputs[0].text.strip())
    print("usage.obcache:", out.kv_transfer_params["obcache"])  # the request's KV outcome


if __name__ == "__main__":
    main()
