"""Re-sent contexts: unique chat contexts sent once, then each sent again, stock in the same run.

A retry, an agent re-sending its context, a client re-asking over the same document: the same
prompt twice. Stock vLLM serves a re-send from its prefix cache while the pool still holds the
first's blocks; obcache-vllm with the server's default budget (``OBCACHE_KV_BUDGET``, whose
``kv_compress_at: "auto"`` compresses a first sighting at all but its last token and a repeat at
the same point) serves it from the first's compressed cache, a quarter of the blocks.

``--contexts`` unique ~2,000-token chat contexts (a system text and one question), each sent
once (``--max-tokens``, greedy), then all sent again newest first, one at a time; a pool of
``--pool-blocks`` blocks of 32 tokens. Arms (``--arms``): ``stock`` (``VLLM_PLUGINS=``) and
``policy`` (no kv_* field, ``OBCACHE_KV_BUDGET=0.25``), each a fresh server.

A re-send is *served from cache* when the engine computed at most one block of its prompt:
``usage.prompt_tokens_details.cached_tokens`` (stock's prefix-cache hit) or
``usage.obcache.reused_tokens`` (an adopted compressed entry) covers all but 32 tokens of it.
Reported per arm (``resend.md``, every request in ``resend.json``): re-sends served from cache,
re-sends whose answer equals the first's, TTFT of the first sends and of the re-sends (p50),
ratios to stock::

    .venv/bin/python benchmarks/bench_resend.py --out results/bench-resend
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.launch import launched  # noqa: E402
from loadtest.stream import post_streamed  # noqa: E402
from obcache_vllm.textgen import haystack  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
ARMS = {"stock": {"VLLM_PLUGINS": ""}, "policy": {"OBCACHE_KV_BUDGET": "0.25"}}


def body(i: int, max_tokens: int) -> dict:
    system = f"You are the archivist of collection {i}. The records:\n" + haystack(64, seed=900 + i)
    ask = f"Which town appears first in collection {i}, and what was traded there?"
    return {"model": MODEL, "temperature": 0, "max_tokens": max_tokens, "seed": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": ask}]}  # fmt: skip


def from_cache(usage: dict) -> bool:
    prompt = usage.get("prompt_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reused = (usage.get("obcache") or {}).get("reused_tokens") or 0
    return prompt > 0 and max(cached, reused) >= prompt - 32


async def drive(url: str, contexts: int, max_tokens: int) -> list[dict]:
    import aiohttp

    rows = []
    async with aiohttp.ClientSession() as session:
        order = [(i, "first") for i in range(contexts)]
        order += [(i, "again") for i in reversed(range(contexts))]
        for i, send in order:
            status, ttft, latency, usage, text = await post_streamed(
                session, f"{url}/v1/chat/completions", body(i, max_tokens)
            )
            rows.append({"context": i, "send": send, "status": status, "ttft": ttft,
                         "latency": latency, "usage": usage, "text": text,
                         "from_cache": from_cache(usage)})  # fmt: skip
    return rows


def run_arm(arm: str, args) -> dict:
    server_args = ["--max-model-len", "4096", "--seed", "0", "--max-num-seqs", "8",
                   "--num-gpu-blocks-override", str(args.pool_blocks),
                   "--enable-prompt-tokens-details"]  # fmt: skip
    env = {**ARMS[arm], "VLLM_CPU_OMP_THREADS_BIND": "0"}  # one core: the client beside it
    with launched(server_args, env, args.out / f"{arm}.server.log") as url:
        rows = asyncio.run(drive(url, args.contexts, args.max_tokens))
    first = {r["context"]: r for r in rows if r["send"] == "first"}
    again = [r for r in rows if r["send"] == "again"]
    ok = all(r["status"] == 200 for r in rows)
    summary = {
        "arm": arm,
        "contexts": args.contexts,
        "pool_blocks": args.pool_blocks,
        "errors": sum(r["status"] != 200 for r in rows),
        "prompt_tokens_mean": statistics.fmean(r["usage"].get("prompt_tokens", 0) for r in rows),
        "served_from_cache": sum(r["from_cache"] for r in again),
        "same_answer": sum(r["text"] == first[r["context"]]["text"] for r in again) if ok else 0,
        "first_ttft_p50": statistics.median(first[i]["ttft"] for i in first) if ok else None,
        "again_ttft_p50": statistics.median(r["ttft"] for r in again) if ok else None,
    }
    return {"summary": summary, "requests": rows}


def markdown(summaries: list[dict]) -> str:
    stock = next((s for s in summaries if s["arm"] == "stock"), None)
    out = ["| arm | re-sends served from cache | vs stock | same answer as the first | "
           "first sends TTFT p50 (s) | re-sends TTFT p50 (s) | errors |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in summaries:
        ratio = "-"
        if stock is not None and s is not stock and stock["served_from_cache"]:
            ratio = f"{s['served_from_cache'] / stock['served_from_cache']:.2f}x"
        n = s["contexts"]
        first = "-" if s["first_ttft_p50"] is None else f"{s['first_ttft_p50']:.2f}"
        again = "-" if s["again_ttft_p50"] is None else f"{s['again_ttft_p50']:.2f}"
        out.append(f"| {s['arm']} | {s['served_from_cache']} / {n} | {ratio} | "
                   f"{s['same_answer']} / {n} | {first} | {again} | {s['errors']} |")  # fmt: skip
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--contexts", type=int, default=9)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--pool-blocks", type=int, default=200)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench-resend")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    raw = [run_arm(arm, args) for arm in args.arms]
    summaries = [r["summary"] for r in raw]
    (args.out / "resend.json").write_text(json.dumps(raw, indent=1) + "\n")
    (args.out / "resend.md").write_text(markdown(summaries))
    print(markdown(summaries))
    return 0 if all(s["errors"] == 0 for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
