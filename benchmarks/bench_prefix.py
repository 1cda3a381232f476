"""Budgets with the prefix cache, over HTTP: shared documents and multi-turn chat, stock vLLM in
the same run.

Each arm is a fresh ``obcache-vllm serve`` on loopback (stock: ``VLLM_PLUGINS=``, the plugin
disabled in the same install, prefix caching on as by default), the same requests in the same
order, streamed and greedy; the client measures time to first token (first SSE chunk with
text) and end-to-end latency; the server's ``/metrics`` give prefix-cache hits.

Workloads (``--workloads``):

* ``docs-one``: 6 questions over one ~2,300-token document, one client (a question is the
  document then a short question; completions API, token-id prompts).
* ``docs-pool``: ``docs`` documents x ``questions`` questions, ``clients`` clients taking the
  documents in turn, in a pool that holds fewer documents than there are uncompressed
  (``--pool-blocks``), so stock vLLM's LRU must drop and recompute documents.
* ``docs-pool-4``: the same with 8 documents and 4 clients.
* ``chat-one``: a 4-turn chat over a ~1,200-word system text, one client; every turn resends
  the whole conversation (the assistant's answers included), as OpenAI clients do.
* ``chat-pool``: ``sessions`` such chats x ``turns`` turns, ``clients`` clients, small pool.

Arms (``--arms``): ``stock``; ``compress_at`` (docs: ``kv_budget`` 0.25 of the document,
``kv_compress_at`` = its length: compressed once, reused by every later question);
``whole`` (``kv_budget`` 0.25 over the whole prompt, every request compresses its own);
``session`` (chat: ``kv_session``, the turns continue the previous turn's compressed cache);
``stateless`` (chat: ``kv_budget`` 0.25 + ``kv_decode``, every turn compressed anew);
``policy`` (docs and chat: requests as stock's, no kv_* field; the server's default budget
``OBCACHE_KV_BUDGET=0.25`` with the policy's default compress point ``auto``).
``ARM:before`` runs a plugin arm with the held-entry policy of the release before this one
(least recently used first, within the base share: ``loadtest.multiturn.HOLD_PRESETS``).
The plugin arms use the server's default scoring (configs/default.yaml: tova, obcache_key).

Usage::

    .venv/bin/python benchmarks/bench_prefix.py                  # all, ~30 min on 2 cores
    .venv/bin/python benchmarks/bench_prefix.py --workloads docs-one chat-one --quick

Outputs (``--out``, default results/bench-prefix): ``prefix.json`` (every request),
``prefix.md`` (TTFT p50/p99 of first and follow-up requests, throughput, hits, ratios to
stock).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.launch import launched  # noqa: E402
from loadtest.multiturn import HOLD_PRESETS  # noqa: E402
from loadtest.scrape import Snapshot  # noqa: E402
from loadtest.stream import post_streamed  # noqa: E402
from obcache_vllm.textgen import haystack  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = [
    "Question: which town is named first? Answer:",
    "Question: how many crates are mentioned last? Answer:",
    "Question: in which season does the record begin? Answer:",
    "Question: what was traded most often? Answer:",
    "Question: which year comes first? Answer:",
    "Question: name two towns that traded. Answer:",
]
CHAT_TURNS = [
    "Which towns appear in the records?",
    "What did they trade in the winter?",
    "Summarize the oldest record in one sentence.",
    "Which record mentions the most crates?",
    "Give one more detail about that town.",
    "What happened in the spring?",
    "Name a trade that appears twice.",
    "Thank you. One last fact, please.",
]


@dataclass
class Sample:
    workload: str
    arm: str
    group: int  # document or session
    index: int  # question or turn (0 = the first of its group)
    status: int
    ttft: float | None
    latency: float
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    obcache: dict | None = None
    text: str = ""


@dataclass
class ArmResult:
    workload: str
    arm: str
    samples: list[Sample] = field(default_factory=list)
    seconds: float = 0.0
    hits: float = 0.0
    queries: float = 0.0
    # The plugin's compressed-context counters over the arm: (kind, event) -> increase, so a
    # run says whether entries were made and lost, not only whether follow-ups found them.
    entries: dict = field(default_factory=dict)


def _arm_body(arm: str, workload: str, doc_tokens: int | None) -> dict:
    arm = arm.partition(":")[0]  # ARM:PRESET: a hold policy (loadtest.multiturn.HOLD_PRESETS)
    if arm in ("stock", "policy"):
        return {}
    if arm == "compress_at":
        return {"kv_budget": 0.25, "kv_compress_at": doc_tokens}
    if arm == "whole":
        return {"kv_budget": 0.25}
    if arm == "stateless":
        return {"kv_budget": 0.25, "kv_decode": True}
    if arm == "session":
        return {"kv_budget": 0.25, "kv_decode": True, "kv_session": True}
    raise ValueError(arm)


def _applies(arm: str, workload: str) -> bool:
    arm = arm.partition(":")[0]
    docs = workload.startswith("docs")
    return arm in ("stock", "policy") or (arm in ("compress_at", "whole")) == docs


async def _stream(session, url: str, path: str, body: dict):
    """POST a streamed request; (status, ttft, latency, usage, text)."""
    return await post_streamed(session, url + path, body)


def _sample(workload, arm, group, index, result) -> Sample:
    status, ttft, latency, usage, text = result
    details = usage.get("prompt_tokens_details") or {}
    return Sample(workload, arm, group, index, status, ttft, latency,
                  usage.get("prompt_tokens"), details.get("cached_tokens"),
                  usage.get("obcache"), text[:200])  # fmt: skip


async def _docs(url, workload, arm, docs, questions, clients, tokenizer, max_tokens):
    import aiohttp

    queue: asyncio.Queue = asyncio.Queue()
    for d in range(docs):
        queue.put_nowait(d)
    samples: list[Sample] = []

    async def client(session):
        while not queue.empty():
            d = queue.get_nowait()
            doc = tokenizer(haystack(75, seed=100 + d)).input_ids
            for q in range(questions):
                prompt = doc + tokenizer("\n" + QUESTIONS[q % len(QUESTIONS)]).input_ids
                body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                        "temperature": 0, **_arm_body(arm, workload, len(doc))}  # fmt: skip
                result = await _stream(session, url, "/v1/completions", body)
                samples.append(_sample(workload, arm, d, q, result))

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return samples


def _system_text(seed: int) -> str:
    return "You are a records clerk. The records:\n" + haystack(44, seed=seed)


async def _chat(url, workload, arm, sessions, turns, clients, max_tokens):
    import aiohttp

    queue: asyncio.Queue = asyncio.Queue()
    for s in range(sessions):
        queue.put_nowait(s)
    samples: list[Sample] = []

    async def client(session):
        while not queue.empty():
            s = queue.get_nowait()
            messages = [{"role": "system", "content": _system_text(200 + s)}]
            for t in range(turns):
                messages.append({"role": "user", "content": CHAT_TURNS[t % len(CHAT_TURNS)]})
                body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                        "temperature": 0, **_arm_body(arm, workload, None)}  # fmt: skip
                result = await _stream(session, url, "/v1/chat/completions", body)
                samples.append(_sample(workload, arm, s, t, result))
                messages.append({"role": "assistant", "content": result[4]})

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return samples


def _snapshot(url: str) -> Snapshot:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        return Snapshot.parse(resp.read().decode(), time.time())


def _metric(url: str, name: str) -> float:
    return _snapshot(url).value(name)


ENTRY_SERIES = (("vllm:obcache_compressed_entries_total", "event"),
                ("vllm:obcache_compressed_lookups_total", "result"))  # fmt: skip


def _entry_counts(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """Increases of the compressed-context counters, keyed "entries:created" etc."""
    out = {}
    for name, label in ENTRY_SERIES:
        for (sample, labels), value in after.samples.items():
            if sample != name:
                continue
            key = f"{name.split('_compressed_')[1].removesuffix('_total')}:{dict(labels)[label]}"
            out[key] = out.get(key, 0.0) + value - before.samples.get((sample, labels), 0.0)
    return out


WORKLOADS = {
    # name: (kind, groups, per group, clients, pool blocks (None: the server's default))
    "docs-one": ("docs", 1, 6, 1, None),
    "docs-pool": ("docs", 6, 4, 3, 192),
    # more clients than the pool holds documents for: a new document's compressed context
    # competes with held ones no client reads any more
    "docs-pool-4": ("docs", 8, 4, 4, 192),
    "chat-one": ("chat", 1, 4, 1, None),
    "chat-pool": ("chat", 6, 4, 3, 160),
}


def run_arm(workload: str, arm: str, args, tokenizer) -> ArmResult:
    kind, groups, per, clients, pool = WORKLOADS[workload]
    if args.quick:
        groups, per = min(groups, 2 if pool else 1), min(per, 3)
    server_args = ["--max-model-len", "4096", "--enable-prompt-tokens-details", "--seed", "0",
                   "--max-num-seqs", "8"]  # fmt: skip
    if pool:
        server_args += ["--num-gpu-blocks-override", str(pool)]
    base, _, preset = arm.partition(":")
    env = {"VLLM_PLUGINS": ""} if base == "stock" else dict(HOLD_PRESETS[preset] if preset else {})
    if base == "policy":
        env["OBCACHE_KV_BUDGET"] = "0.25"
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0"  # one core: the client and the server beside it
    out = args.out / f"{workload}.{arm}.server.log"
    result = ArmResult(workload, arm)
    with launched(server_args, env, out) as url:
        hits0 = _metric(url, "vllm:prefix_cache_hits_total")
        queries0 = _metric(url, "vllm:prefix_cache_queries_total")
        snap0 = _snapshot(url)
        started = time.perf_counter()
        if kind == "docs":
            coro = _docs(url, workload, arm, groups, per, clients, tokenizer, args.max_tokens)
        else:
            coro = _chat(url, workload, arm, groups, per, clients, args.max_tokens)
        result.samples = asyncio.run(coro)
        result.seconds = time.perf_counter() - started
        result.hits = _metric(url, "vllm:prefix_cache_hits_total") - hits0
        result.queries = _metric(url, "vllm:prefix_cache_queries_total") - queries0
        result.entries = _entry_counts(snap0, _snapshot(url))
    return result


def _pct(values, q):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summarize(result: ArmResult) -> dict:
    ok = [s for s in result.samples if s.status == 200]
    first = [s.ttft for s in ok if s.index == 0]
    follow = [s.ttft for s in ok if s.index > 0]
    blocks = [((s.obcache or {}).get("resident_tokens") or 0) for s in ok if s.obcache]
    return {
        "workload": result.workload,
        "arm": result.arm,
        "requests": len(result.samples),
        "errors": len(result.samples) - len(ok),
        "first_ttft_p50": _pct(first, 0.5),
        "followup_ttft_p50": _pct(follow, 0.5),
        "followup_ttft_p99": _pct(follow, 0.99),
        "followup_ttfts": follow,
        "request_throughput": len(ok) / result.seconds if result.seconds else None,
        "prefix_hit_rate": result.hits / result.queries if result.queries else None,
        "reused_followups": sum(1 for s in ok if s.index > 0 and (s.obcache or {}).get(
            "reused_tokens")),  # fmt: skip
        "resident_tokens_mean": statistics.mean(blocks) if blocks else None,
        "compressed_contexts": result.entries,
        "seconds": result.seconds,
    }


def markdown(summaries: list[dict]) -> str:
    lines = []
    by_workload: dict[str, list[dict]] = {}
    for s in summaries:
        by_workload.setdefault(s["workload"], []).append(s)
    for workload, rows in by_workload.items():
        stock = next((r for r in rows if r["arm"] == "stock"), None)
        lines += [f"### {workload}", "",
                  "| arm | first TTFT p50 (s) | follow-up TTFT p50 / p99 (s) | vs stock p50 | "
                  "req/s | vs stock | prefix hit rate | follow-ups reusing an entry | errors |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            def f(v, d=2):
                return "-" if v is None else f"{v:.{d}f}"

            ratio = tput = "-"
            if stock and r is not stock and r["followup_ttft_p50"] and stock["followup_ttft_p50"]:
                ratio = f"{r['followup_ttft_p50'] / stock['followup_ttft_p50']:.2f}x"
            if stock and r is not stock and r["request_throughput"] and stock["request_throughput"]:
                tput = f"{r['request_throughput'] / stock['request_throughput']:.2f}x"
            lines.append(
                f"| {r['arm']} | {f(r['first_ttft_p50'])} | {f(r['followup_ttft_p50'])} / "
                f"{f(r['followup_ttft_p99'])} | {ratio} | {f(r['request_throughput'], 3)} | "
                f"{tput} | {f(r['prefix_hit_rate'])} | {r['reused_followups']} | {r['errors']} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--arms", nargs="+",
                    default=["stock", "compress_at", "whole", "stateless", "session", "policy"])
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--quick", action="store_true", help="fewer groups and questions")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench-prefix")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    from obcache_vllm import model

    tokenizer = AutoTokenizer.from_pretrained(str(model.pull(log=lambda m: None)))
    summaries, raw = [], []
    for workload in args.workloads:
        for arm in args.arms:
            if not _applies(arm, workload):
                continue
            result = run_arm(workload, arm, args, tokenizer)
            summaries.append(summarize(result))
            raw.append({"summary": summaries[-1], "samples": [asdict(s) for s in result.samples]})
            print(markdown(summaries), flush=True)
    (args.out / "prefix.json").write_text(json.dumps(raw, indent=1) + "\n")
    (args.out / "prefix.md").write_text(markdown(summaries) + "\n")
    print(f"wrote {args.out / 'prefix.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
