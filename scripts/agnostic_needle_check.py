#!/usr/bin/env python
"""Which part of a selection loses RULER's needle when the context is compressed without its
question: the HF reference (no vLLM) on the leaderboard's own prompts, one selection at a time.

    .venv/bin/python scripts/agnostic_needle_check.py --docs 0,2

Reads the prompts of ``niah_single_1`` from ``results/leaderboard/raw`` (any arm: lm-eval
logs every prompt; its samples files are not committed, ``make leaderboard`` writes them),
compresses each 96 tokens before its end (``kv_compress_at: -96``, as the
leaderboard does) with each selection below at ``--budget`` of the compressed part, and prints
the reference's continuation beside the needle, and beside what vLLM answered in the
leaderboard's snapkv arm (the same prompt and selection: the two agree where the engine is
faithful). The selections vary one thing at a time from the shipped query-aware default
(snapkv, window 32, a ranking per KV head): the window, the ranking, the pipeline, the score.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SELECTIONS = {
    "snapkv w32 per head attn": {"kv_pipeline": "snapkv", "kv_per_head": True, "kv_window": 32,
                                 "kv_scorer": "attn"},
    "snapkv w32 per head obcache_key": {"kv_pipeline": "snapkv", "kv_per_head": True,
                                        "kv_window": 32, "kv_scorer": "obcache_key"},
    "snapkv w32 one ranking attn": {"kv_pipeline": "snapkv", "kv_per_head": False,
                                    "kv_window": 32, "kv_scorer": "attn"},
    "snapkv w1 per head attn": {"kv_pipeline": "snapkv", "kv_per_head": True, "kv_window": 1,
                                "kv_scorer": "attn"},
    "tova w1 per head attn": {"kv_pipeline": "tova", "kv_per_head": True, "kv_window": 1,
                              "kv_scorer": "attn"},
    "snapkv w32 per head random": {"kv_pipeline": "snapkv", "kv_per_head": True,
                                   "kv_window": 32, "kv_scorer": "random"},
}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", default="0,2", help="document ids of niah_single_1")
    p.add_argument("--budget", type=float, default=0.75, help="kept fraction (0.75: 25 %% removed)")
    p.add_argument("--raw", type=Path, default=ROOT / "results" / "leaderboard" / "raw")
    p.add_argument("--vllm-arm", default="snapkv_attn_0.25")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from obcache_vllm.admission import parse_kv_options
    from obcache_vllm.evidence import hf_reference as ref
    from obcache_vllm.model import default_model_path

    torch.set_num_threads(1)
    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model, _ = ref.load_model(path)
    pattern = str(args.raw / args.vllm_arm / "*" / "*" / "samples_niah_single_1_*.jsonl")
    samples = {s["doc_id"]: s for s in map(json.loads, open(glob.glob(pattern)[0]))}
    tail = 96
    for doc in (int(d) for d in args.docs.split(",")):
        sample = samples[doc]
        ids = torch.tensor(tok(sample["arguments"]["gen_args_0"]["arg_0"]).input_ids)
        state = ref.prefill(model, ids[:-tail], query_window=-1)
        needle = sample["target"]
        needle = needle[0] if isinstance(needle, list) else needle  # lm-eval logs it as text
        print(f"doc {doc}: needle {needle}; vLLM ({args.vllm_arm}) "
              f"{sample['resps'][0][0][:16]!r}")  # fmt: skip
        for name, fields in SELECTIONS.items():
            options = parse_kv_options({**fields, "kv_budget": args.budget,
                                        "kv_compress_at": -tail}, len(ids))  # fmt: skip
            _, kept = ref.select_kept(state, options, 32)
            tokens, _ = ref.generate(model, state, kept, 10, rest=ids[-tail:])
            print(f"  {name:34s} {tok.decode(tokens)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
