"""Multi-turn chats at the pool's limit, the shape of vLLM's multi-turn benchmark, stock in the
same run.

vLLM's multi-turn serving benchmark client (in vLLM's repository, not in the wheel) drives
synthetic chats: a prefix common to every conversation, a prefix of each conversation's own,
user turns of 120-160 tokens, answers forced to 80-120 tokens (``min_tokens`` =
``max_tokens``) and fed back as the next turn's history, ``--num-clients`` clients with one
request in flight each, each cycling round-robin over its share of
``--max-active-conversations`` and replacing a finished conversation from a shared queue.
This module does the same, smaller for a CPU (defaults below), with text from
:func:`obcache_vllm.textgen.haystack` instead of a book:

* common prefix ~300 tokens (a system message shared by every conversation), each
  conversation's own document ~600 tokens in its first user turn, user turns ~60-100 tokens,
  answers 40-60 tokens, 6-8 user turns: prompts grow from ~1,000 to ~1,900 tokens
  (``--shape light``, the default); ``--shape vllm``: vLLM's client's parameters as users run
  it on a CPU-sized pool, 800-1,200-token documents, 32-48-token answers, 12-16 user turns
  (prompts up to ~3,000 tokens; a conversation past ``--max-model-len`` ends in an error);
* ``--conversations 8 --clients 2 --active 4``, ``/v1/chat/completions``, streamed with usage,
  greedy, ``seed`` 0.

Arms (``--arms``), each a fresh ``obcache-vllm serve`` with ``--num-gpu-blocks-override``
``--pool-blocks`` (96 blocks of 32 tokens: two or three conversations uncompressed):
``stock`` (``VLLM_PLUGINS=``), ``session`` (every request ``{"kv_budget": 0.25,
"kv_session": true}``), ``policy`` (no kv_* field; the server's default budget
``OBCACHE_KV_BUDGET=0.25``, whose ``auto`` compress point serves a turn that extends an earlier
prompt as a session: a chat's third and later turns continue), ``policy-session-id`` (the same,
each conversation's requests carrying vLLM's ``X-Session-ID`` header, as a client of
vllm-router's ``consistent_hash`` sends it: every turn is a session from the first).
``ARM:before`` runs a plugin arm with the held-entry policy of earlier versions
(:data:`HOLD_PRESETS`), ``--env NAME=VALUE`` sets any server variable of every plugin arm.

Reported per arm (``multiturn.md``, every request in ``multiturn.json``): requests/s, TTFT
mean/p50/p99 of all requests and of turns >= 2, the follow-up turns that continued their session
(``usage.obcache.reused_from == "session"``), the compressed-context lookups and entries the
server counted, the blocks held for entries (mean and max, sampled each second), preemptions,
ratios to stock::

    .venv/bin/python -m loadtest multiturn --out results/multiturn
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass

from loadtest.launch import launched
from loadtest.scrape import Snapshot
from loadtest.stream import post_streamed
from obcache_vllm.textgen import haystack

MODEL = "SmolLM2-135M-Instruct"
TOKENS_PER_SENTENCE = 30.5  # haystack sentences, SmolLM2's tokenizer (loadtest.scenario)
# arm -> (server environment, kv_* fields of every request, X-Session-ID per conversation)
ARMS = {
    "stock": ({"VLLM_PLUGINS": ""}, {}, False),
    "session": ({}, {"kv_budget": 0.25, "kv_session": True}, False),
    "policy": ({"OBCACHE_KV_BUDGET": "0.25"}, {}, False),
    "policy-session-id": ({"OBCACHE_KV_BUDGET": "0.25"}, {}, True),
}


@dataclass
class Turn:
    arm: str
    conversation: int
    turn: int  # 1-based user turn
    client: int
    status: int
    ttft: float | None
    latency: float
    prompt_tokens: int | None
    completion_tokens: int | None
    obcache: dict | None


def _sentences(tokens: int) -> int:
    return max(1, round(tokens / TOKENS_PER_SENTENCE))


@dataclass(frozen=True)
class Conversation:
    index: int
    document: str
    questions: tuple[str, ...]
    answer_tokens: tuple[int, ...]


# Conversation shapes (``--shape``): ranges of user turns, the first turn's document tokens and
# the answers' tokens. ``light`` is this module's original load; ``vllm`` the parameters of
# vLLM's multi-turn client as users run it on a CPU-sized pool (docs/user_guide/sessions.md).
SHAPES = {
    "light": {"turns": (6, 8), "doc": (500, 700), "answers": (40, 60)},
    "vllm": {"turns": (12, 16), "doc": (800, 1200), "answers": (32, 48)},
}


def conversations(
    count: int, seed: int = 0, turns: tuple[int, int] = (6, 8), doc: tuple[int, int] = (500, 700),
    answers: tuple[int, int] = (40, 60),
) -> list[Conversation]:  # fmt: skip
    """The synthetic conversations (same arguments: the same conversations); ``turns``,
    ``doc`` (the document's tokens) and ``answers`` (tokens) are ranges drawn from."""
    rng = random.Random(seed)
    out = []
    lo, hi = turns
    for c in range(count):
        n_turns = rng.randint(lo, hi)
        document = haystack(_sentences(rng.randint(*doc)), seed=1000 + c)
        questions = tuple(
            f"{c * 100 + t} is a nice number. Rewrite this and add a detail: "
            + haystack(_sentences(rng.randint(60, 100)), seed=5000 + c * 100 + t)
            for t in range(n_turns)
        )
        answer_tokens = tuple(rng.randint(*answers) for _ in range(n_turns))
        out.append(Conversation(c, document, questions, answer_tokens))
    return out


SYSTEM = "You are a careful archivist. House rules and reference:\n" + haystack(
    _sentences(300), seed=777
)


async def drive(url: str, arm: str, body: dict, convs: list[Conversation], clients: int,
                active: int, session_ids: bool = False) -> list[Turn]:  # fmt: skip
    """vLLM's multi-turn client loop: each client cycles round-robin over its active share."""
    import aiohttp

    queue = list(convs)
    turns: list[Turn] = []
    per_client = max(1, active // clients)

    async def client(index: int, session) -> None:
        mine: list[tuple[Conversation, list[dict], int]] = []
        cursor = 0
        while True:
            while len(mine) < per_client and queue:
                conv = queue.pop(0)
                mine.append((conv, [{"role": "system", "content": SYSTEM}], 0))
            if not mine:
                return
            cursor %= len(mine)
            conv, messages, t = mine[cursor]
            user = conv.questions[t] if t else conv.document + "\n\n" + conv.questions[0]
            messages = [*messages, {"role": "user", "content": user}]
            n = conv.answer_tokens[t]
            request = {"model": MODEL, "messages": messages, "temperature": 0, "seed": 0,
                       "max_tokens": n, "min_tokens": n, **body}  # fmt: skip
            headers = {"X-Session-ID": f"conversation-{conv.index}"} if session_ids else None
            status, ttft, latency, usage, text = await post_streamed(
                session, f"{url}/v1/chat/completions", request, headers
            )
            turns.append(Turn(arm, conv.index, t + 1, index, status, ttft, latency,
                              usage.get("prompt_tokens"), usage.get("completion_tokens"),
                              usage.get("obcache")))  # fmt: skip
            messages = [*messages, {"role": "assistant", "content": text}]
            if status != 200 or t + 1 >= len(conv.questions):
                mine.pop(cursor)
            else:
                mine[cursor] = (conv, messages, t + 1)
                cursor += 1

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(i, session) for i in range(clients)))
    return turns


def _scrape(url: str) -> Snapshot:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        return Snapshot.parse(resp.read().decode(), time.time())


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values`` by nearest rank; None when empty."""
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


# Hold policies an arm may name after a colon (``session:before``): the server environment.
# ``before`` is the policy of the release before the reuse-ranked holds: least recently used
# first, within the base share (OBCACHE_ENTRY_POOL_SHARE, 0.25) only.
HOLD_PRESETS = {
    "before": {"OBCACHE_ENTRY_VICTIMS": "lru", "OBCACHE_ENTRY_POOL_SHARE_MAX": "0.25"},
    "lru": {"OBCACHE_ENTRY_VICTIMS": "lru"},
}


def arm_names() -> list[str]:
    """Every arm ``--arms`` accepts: the arms, and each non-stock arm with a hold preset."""
    return [*ARMS, *(f"{a}:{p}" for a in ARMS if a != "stock" for p in HOLD_PRESETS)]


def run_arm(arm: str, args) -> dict:
    base, _, preset = arm.partition(":")
    env, body, session_ids = ARMS[base]
    env = {**env, **HOLD_PRESETS.get(preset, {})}
    max_len = str((args.pool_blocks - 1) * 32)  # the pool must hold one whole request (and
    # its null block)
    server_args = ["--max-model-len", max_len, "--seed", "0", "--max-num-seqs", "8",
                   "--num-gpu-blocks-override", str(args.pool_blocks),
                   "--enable-prompt-tokens-details"]  # fmt: skip
    env = {**env, "VLLM_CPU_OMP_THREADS_BIND": "0"}  # one core: the client beside it
    if base != "stock":
        env.update(dict(kv.split("=", 1) for kv in getattr(args, "env", None) or ()))
    shape = SHAPES[getattr(args, "shape", "light")]
    convs = conversations(args.conversations, args.seed, **shape)
    with launched(server_args, env, args.out / f"{arm}.server.log") as url:
        before = _scrape(url)
        started = time.perf_counter()
        held: list[tuple[float, float]] = []  # (seconds, vllm:obcache_held_blocks)
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(1.0):
                try:
                    held.append((round(time.perf_counter() - started, 1),
                                 _scrape(url).value("vllm:obcache_held_blocks")))  # fmt: skip
                except OSError:
                    pass

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            turns = asyncio.run(drive(url, arm, body, convs, args.clients, args.active,
                                      session_ids))  # fmt: skip
        finally:
            stop.set()
            sampler.join()
        seconds = time.perf_counter() - started
        after = _scrape(url)

    def delta(name: str, **labels) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    ok = [t for t in turns if t.status == 200]
    follow = [t for t in ok if t.turn >= 2]
    continued = [t for t in follow if (t.obcache or {}).get("reused_from") == "session"]
    ttft = [t.ttft for t in ok if t.ttft is not None]
    ttft2 = [t.ttft for t in follow if t.ttft is not None]
    summary = {
        "arm": arm,
        "requests": len(turns),
        "errors": len(turns) - len(ok),
        "seconds": round(seconds, 1),
        "request_throughput": len(ok) / seconds,
        "ttft_mean": statistics.fmean(ttft) if ttft else None,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "follow_ttft_p50": percentile(ttft2, 50),
        "follow_ttft_p99": percentile(ttft2, 99),
        "follow_ups": len(follow),
        "continued": len(continued),
        "prompt_tokens_mean": statistics.fmean(t.prompt_tokens for t in ok if t.prompt_tokens),
        "lookups_hit": delta("vllm:obcache_compressed_lookups_total", result="hit"),
        "lookups_miss": delta("vllm:obcache_compressed_lookups_total", result="miss"),
        "entries_created": delta("vllm:obcache_compressed_entries_total", event="created"),
        "entries_released": delta("vllm:obcache_compressed_entries_total", event="released"),
        "entries_evicted": delta("vllm:obcache_compressed_entries_total", event="evicted"),
        "preemptions": delta("vllm:num_preemptions_total"),
        "held_blocks_mean": statistics.fmean(v for _, v in held) if held else 0.0,
        "held_blocks_max": max((v for _, v in held), default=0.0),
        "shape": getattr(args, "shape", "light"),
        "pool_blocks": args.pool_blocks,
        "env": sorted(f"{k}={v}" for k, v in env.items() if k.startswith("OBCACHE_ENTRY")),
    }
    return {"summary": summary, "turns": [asdict(t) for t in turns], "held_blocks": held}


def markdown(summaries: list[dict]) -> str:
    stock = next((s for s in summaries if s["arm"] == "stock"), None)

    def ms(v):
        return "-" if v is None else f"{v * 1000:.0f}"

    def ratio(s, key):
        if stock is None or s is stock or not stock.get(key) or s.get(key) is None:
            return "-"
        return f"{s[key] / stock[key]:.2f}x"

    out = ["| arm | req/s | vs stock | TTFT mean / p50 / p99 (ms) | turns >= 2 TTFT p50 / p99 "
           "(ms) | p50 vs stock | follow-ups continued | lookups hit / miss | entries created "
           "/ released / evicted | held blocks mean / max | preemptions | errors |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in summaries:
        cont = f"{s['continued']} / {s['follow_ups']}" if s["arm"] != "stock" else "-"
        out.append(
            f"| {s['arm']} | {s['request_throughput']:.3f} | {ratio(s, 'request_throughput')} | "
            f"{ms(s['ttft_mean'])} / {ms(s['ttft_p50'])} / {ms(s['ttft_p99'])} | "
            f"{ms(s['follow_ttft_p50'])} / {ms(s['follow_ttft_p99'])} | "
            f"{ratio(s, 'follow_ttft_p50')} | {cont} | "
            f"{s['lookups_hit']:.0f} / {s['lookups_miss']:.0f} | {s['entries_created']:.0f} / "
            f"{s['entries_released']:.0f} / {s['entries_evicted']:.0f} | "
            f"{s.get('held_blocks_mean', 0):.0f} / {s.get('held_blocks_max', 0):.0f} | "
            f"{s['preemptions']:.0f} | {s['errors']} |"
        )
    return "\n".join(out) + "\n"


def main(args) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    # Arms of an earlier run into the same --out are kept unless this run measures them again.
    done = args.out / "multiturn.json"
    kept = json.loads(done.read_text()) if done.is_file() else []
    raw = [r for r in kept if r["summary"]["arm"] not in args.arms]
    for arm in args.arms:
        raw.append(run_arm(arm, args))
        summaries = [r["summary"] for r in raw]
        print(markdown(summaries), flush=True)
        (args.out / "multiturn.json").write_text(json.dumps(raw, indent=1) + "\n")
        (args.out / "multiturn.md").write_text(markdown(summaries))
    return 0
