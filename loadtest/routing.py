"""Routing policies measured: shared documents and session chats through vllm-router.

``python -m loadtest routing --out results/routing`` starts, for each policy in turn, a fresh
fleet on loopback: ``--workers`` ``obcache-vllm serve`` workers (each its own engine on its
own core, the server's default-budget policy ``OBCACHE_KV_BUDGET=0.25``, a small pool, vLLM's
KV events published over ZMQ) behind ``vllm-router --policy P``, and drives the same mixed
load through the router:

* **documents** (``/v1/completions``, clients unchanged: no kv_* field, no header):
  ``--docs`` documents of ~900 tokens, ``--questions`` questions each, sent by ``--doc-clients``
  clients one at a time, round by round over the documents (a document's questions come
  ``--docs`` requests apart, from different clients), so a document's questions meet on one
  worker only if the router sends them there;
* **chats** (``/v1/chat/completions``): ``--chats`` conversations of ``--turns`` turns, each
  resending the conversation so far with vLLM's ``X-Session-ID`` header, the header the
  router's ``consistent_hash`` hashes (the id also makes every turn a session on the worker).

Policies (``--policies``): ``round_robin``; ``consistent_hash`` (the session header, else a
hash of the body); ``kv_aware``: the router subscribes to every worker's KV events
(``--kv-event-source URL=tcp://...``, ``--kv-event-block-size 32``, ``--kv-event-model``) and
sends a request to the worker holding the longest cached prefix of its tokens, weighed
against load. For HTTP workers the router turns a request into tokens by calling the
worker's ``/v1/completions/render`` or ``/v1/chat/completions/render``, which vLLM registers
with ``--enable-scale-out``; the worker must bind its event socket (``tcp://*:PORT``).
``VLLM_ROUTER_TOKENIZER`` (the model's local directory) is set too; whether the router needs
it once the workers render was not tested.

Reported per policy and workload (``routing.md``; every request in ``routing.json``):
requests/s over the whole run, TTFT p50/p99 (streamed), requests served per worker (balance:
the busiest worker's share), and reuse: document questions that adopted a compressed document
(``usage.obcache.reused_tokens``) or read vLLM's prefix cache (``cached_tokens``), chat turns
after the first that continued their session (``reused_from == "session"``).

Loopback only, bounded counts; a fleet of 2 workers runs on a 2-core machine with the client
and the router beside them, so absolute times are the machine's, and the policies are compared
with each other in one run.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from contextlib import ExitStack
from pathlib import Path

from loadtest.fleet import MODEL, router, router_counts
from loadtest.launch import free_port, launched
from loadtest.multiturn import percentile
from loadtest.stream import post_streamed
from obcache_vllm.textgen import haystack

BLOCK_SIZE = 32  # obcache-vllm serve's block size on CPU; the router's must match
WORKER_ARGS = (
    "--max-model-len", "3008", "--num-gpu-blocks-override", "96", "--max-num-seqs", "8",
    "--seed", "0", "--enable-prompt-tokens-details",
    # vLLM's /v1/completions/render and /v1/chat/completions/render: how kv_aware tokenizes a
    # request it sends to an HTTP worker (without them its lookups find no tokens).
    "--enable-scale-out",
)  # fmt: skip
QUESTIONS = ["Which towns appear in the records?", "What was traded in the winter?",
             "Which record mentions the most crates?", "What happened in the spring?",
             "Who is named first?", "Which season comes last?"]  # fmt: skip
ASKS = ["Summarize the records.", "Which towns traded grain?", "What came next?",
        "And after that?", "Which year is it?", "Anything else?"]  # fmt: skip


def _document(index: int, seed: int) -> str:
    return "Records:\n" + haystack(30, seed=seed * 1000 + index)


async def _docs_client(session, url, client, clients, docs, questions, max_tokens, rows):
    # Round by round over the documents: a document's questions come ``len(docs)`` requests
    # apart, from different clients.
    items = [(d, r) for r in range(questions) for d in range(len(docs))]
    for d, r in items[client::clients]:
        body = {
            "model": MODEL,
            "max_tokens": max_tokens,
            "temperature": 0,
            "prompt": f"{docs[d]}\nQuestion: {QUESTIONS[r % len(QUESTIONS)]}\nAnswer:",
        }
        status, ttft, latency, usage, _ = await post_streamed(
            session, f"{url}/v1/completions", body
        )
        ob = usage.get("obcache") or {}
        details = usage.get("prompt_tokens_details") or {}
        rows.append({"workload": "docs", "doc": d, "question": r, "status": status,
                     "ttft": ttft, "latency": latency,
                     "reused_tokens": ob.get("reused_tokens", 0),
                     "cached_tokens": details.get("cached_tokens") or 0})  # fmt: skip


async def _chat(session, url, index, turns, seed, max_tokens, rows):
    messages = [{"role": "system", "content": "Records:\n" + haystack(24, seed=seed * 1000 + 500
                                                                      + index)}]  # fmt: skip
    for turn in range(turns):
        messages = [*messages, {"role": "user", "content": ASKS[turn % len(ASKS)]}]
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0}  # fmt: skip
        status, ttft, latency, usage, text = await post_streamed(
            session,
            f"{url}/v1/chat/completions",
            body,
            {"X-Session-ID": f"routing-{seed}-chat-{index}"},
        )
        ob = usage.get("obcache") or {}
        rows.append({"workload": "chats", "chat": index, "turn": turn + 1, "status": status,
                     "ttft": ttft, "latency": latency,
                     "continued": ob.get("reused_from") == "session"})  # fmt: skip
        if status != 200:
            return
        messages = [*messages, {"role": "assistant", "content": text}]


async def drive(url: str, args, seed: int) -> list[dict]:
    """The mixed load through ``url``; one row per request."""
    import aiohttp

    docs = [_document(i, seed) for i in range(args.docs)]
    rows: list[dict] = []
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(
            *(_docs_client(session, url, c, args.doc_clients, docs, args.questions,
                           args.max_tokens, rows) for c in range(args.doc_clients)),
            *(_chat(session, url, i, args.turns, seed, args.max_tokens, rows)
              for i in range(args.chats)),
        )  # fmt: skip
    return rows


def _served(url: str) -> float:
    from loadtest.fleet import _scrape
    from loadtest.scrape import REQUEST_SUCCESS

    return _scrape(url).value(REQUEST_SUCCESS)


def run_policy(policy: str, args, seed: int) -> dict:
    """A fresh fleet behind ``vllm-router --policy policy``, the load, the summary."""
    out: Path = args.out
    ports = [free_port() for _ in range(args.workers)]
    cores = os.cpu_count() or 1
    with ExitStack() as stack:
        urls = []
        for i in range(args.workers):
            # vLLM binds a wildcard endpoint and connects to any other, and the router's
            # subscriber connects: the worker must bind (tcp://*), or no event arrives.
            events = {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://*:{ports[i]}"}  # fmt: skip
            env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(i % cores),
                   **({"VLLM_PLUGINS": ""} if args.stock else {"OBCACHE_KV_BUDGET": "0.25"})}
            worker_args = (*WORKER_ARGS, "--kv-events-config", json.dumps(events))
            urls.append(
                stack.enter_context(
                    launched(worker_args, env, out / f"{policy}.worker{i}.server.log")
                )
            )
        extra: list[str] = []
        router_env = {}
        if policy == "kv_aware":
            for url, port in zip(urls, ports, strict=True):
                extra += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{port}"]
            extra += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", MODEL,
                      *args.router_args]
            from obcache_vllm import model as model_mod

            router_env["VLLM_ROUTER_TOKENIZER"] = str(model_mod.pull(log=lambda m: None))
        front, metrics = stack.enter_context(
            router(urls, policy, out / f"{policy}.router.log", extra_args=extra, env=router_env)
        )
        before = [_served(u) for u in urls]
        started = time.perf_counter()
        rows = asyncio.run(drive(front, args, seed))
        seconds = time.perf_counter() - started
        served = [_served(u) - b for u, b in zip(urls, before, strict=True)]
        import urllib.request

        with urllib.request.urlopen(f"{metrics}/metrics", timeout=10) as resp:
            router_text = resp.read().decode()
        (out / f"{policy}.router.metrics.txt").write_text(router_text)
    summary = {"policy": policy, "seconds": round(seconds, 1), "served_per_worker": served,
               "router_per_worker": router_counts(router_text, urls),
               "balance": max(served) / max(1, sum(served))}  # fmt: skip
    for workload in ("docs", "chats"):
        mine = [r for r in rows if r["workload"] == workload]
        ok = [r for r in mine if r["status"] == 200]
        ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
        entry = {"requests": len(mine), "errors": len(mine) - len(ok),
                 "request_throughput": len(ok) / seconds,
                 "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99)}  # fmt: skip
        if workload == "docs":
            entry["adopted"] = sum(r["reused_tokens"] > 0 for r in ok)
            entry["prefix_hits"] = sum(r["cached_tokens"] > 0 for r in ok)
        else:
            follow = [r for r in ok if r["turn"] > 1]
            entry["follow_ups"] = len(follow)
            entry["continued"] = sum(r["continued"] for r in follow)
        summary[workload] = entry
    return {"summary": summary, "requests": rows}


def markdown(summaries: list[dict], args) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1000:.0f}"

    lines = [
        f"{args.workers} workers (default budget 0.25, 96-block pools, one core each) behind "
        f"vllm-router; per policy a fresh fleet and the same load: {args.docs} documents x "
        f"{args.questions} questions from {args.doc_clients} clients, and {args.chats} chats x "
        f"{args.turns} turns with `X-Session-ID`, all at once, {args.max_tokens} tokens each.",
        "",
        "| policy | req/s (all) | docs TTFT p50 / p99 (ms) | docs adopted / prefix hits | "
        "chats TTFT p50 / p99 (ms) | turns continued | served per worker | busiest share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        d, c = s["docs"], s["chats"]
        total = (d["requests"] - d["errors"] + c["requests"] - c["errors"]) / s["seconds"]
        lines.append(
            f"| {s['policy']} | {total:.3f} | {ms(d['ttft_p50'])} / {ms(d['ttft_p99'])} | "
            f"{d['adopted']} / {d['prefix_hits']} of {d['requests']} | "
            f"{ms(c['ttft_p50'])} / {ms(c['ttft_p99'])} | "
            f"{c['continued']} of {c['follow_ups']} | {s['served_per_worker']} | "
            f"{s['balance']:.2f} |"
        )
    errors = sum(s["docs"]["errors"] + s["chats"]["errors"] for s in summaries)
    lines += ["", f"Errors: {errors}."]
    return "\n".join(lines) + "\n"


def main(args) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for policy in args.policies:
        # The same documents and chats for every policy, each on a fresh fleet.
        results.append(run_policy(policy, args, seed=args.seed))
        print(json.dumps(results[-1]["summary"]), flush=True)
    summaries = [r["summary"] for r in results]
    (args.out / "routing.json").write_text(json.dumps(results, indent=1) + "\n")
    text = markdown(summaries, args)
    (args.out / "routing.md").write_text(text)
    print(text)
    errors = sum(s["docs"]["errors"] + s["chats"]["errors"] for s in summaries)
    return 1 if errors else 0
