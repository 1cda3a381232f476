"""Multi-turn chats on the simulated engine: the hold policy's simulator.

The load of ``python -m loadtest multiturn`` (vLLM's multi-turn client's loop: ``clients``
closed-loop clients, each cycling round-robin over its share of ``active`` conversations, a
finished conversation replaced from a queue, each answer fed back into the next turn's
prompt), run on :class:`~.engine.Sim`: vLLM's real scheduler, block pool and prefix cache,
obcache-vllm's real admission, ledger, prefix adapter and :class:`HeldEntries`, a symbolic
model. Only time is not the server's: a client sends its next turn one step after its last
answer, and a step stands for any forward pass, long prefill or single decode. What it
measures is therefore what the policy decides, not speed: which follow-ups find their
conversation's entry, and the blocks held, step by step.

Token counts are the load's divided by ``scale`` with blocks ``32 / scale`` tokens, so a
conversation spans the same number of blocks as on the server at a quarter of the cost.

    from support.sched_sim.chats import ChatLoad, simulate
    simulate(ChatLoad(pool_blocks=96, victims="lru"))
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from loadtest import multiturn
from obcache_vllm.config import DEFAULT_ENTRY_SHARE_MAX

from .engine import Sim, SimConfig

# The conversation shapes of loadtest.multiturn.SHAPES (server tokens), and its common prefix.
SHAPES = {
    **multiturn.SHAPES,
    # vllm with one of light's parameters: which of them makes the difference
    "vllm-light-turns": {"turns": (6, 8), "doc": (800, 1200), "answers": (32, 48)},
    "vllm-light-doc": {"turns": (12, 16), "doc": (500, 700), "answers": (32, 48)},
    "vllm-light-answers": {"turns": (12, 16), "doc": (800, 1200), "answers": (40, 60)},
}
SYSTEM_TOKENS = 300  # loadtest.multiturn.SYSTEM
USER_TOKENS = (60, 100)
TEMPLATE_TOKENS = 12  # chat template and the question's lead-in, per user turn


@dataclass(frozen=True)
class ChatLoad:
    """One simulated run: the load and the engine's hold policy."""

    pool_blocks: int = 96
    victims: str = "reuse"  # HeldEntries.victims
    share: float = 0.25  # OBCACHE_ENTRY_POOL_SHARE
    share_max: float | None = DEFAULT_ENTRY_SHARE_MAX  # OBCACHE_ENTRY_POOL_SHARE_MAX (None: the
    # base share only)
    shape: str = "vllm"
    conversations: int = 8
    clients: int = 2
    active: int = 4
    budget: float = 0.25
    scale: int = 4
    seed: int = 0
    max_steps: int = 200_000
    extra: dict = field(default_factory=dict)  # more kv_* fields of every request
    verify: bool = True  # the KV oracle on every compaction


@dataclass
class ChatResult:
    follow_ups: int = 0
    continued: int = 0
    requests: int = 0
    steps: int = 0
    preemptions: int = 0
    held_blocks: list[int] = field(default_factory=list)  # per step
    counts: dict = field(default_factory=dict)  # the prefix adapter's counters
    violations: int = 0
    refused: int = 0  # requests the front end refused (a conversation longer than the model)

    @property
    def continued_share(self) -> float:
        return self.continued / self.follow_ups if self.follow_ups else 1.0


def _conversations(load: ChatLoad) -> list[dict]:
    rng = random.Random(load.seed)
    shape = SHAPES[load.shape]
    s = load.scale

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 97) for _ in range(max(1, round(n / s)))]

    convs = []
    for _ in range(load.conversations):
        turns = rng.randint(*shape["turns"])
        doc = rng.randint(*shape["doc"])
        users = [tokens(rng.randint(*USER_TOKENS) + TEMPLATE_TOKENS) for _ in range(turns)]
        users[0] = tokens(doc) + users[0]
        answers = [max(1, round(rng.randint(*shape["answers"]) / s)) for _ in range(turns)]
        convs.append({"users": users, "answers": answers})
    return convs


def simulate(load: ChatLoad) -> ChatResult:
    """Run the chats to the end; every harness invariant is checked after every step."""
    bs = 32 // load.scale
    cfg = SimConfig(num_blocks=load.pool_blocks + 1, block_size=bs, max_num_seqs=8,
                    max_batched_tokens=2048 // load.scale,
                    max_model_len=(load.pool_blocks - 1) * bs, share=load.share,
                    share_max=load.share if load.share_max is None else load.share_max,
                    victims=load.victims, verify=load.verify)  # fmt: skip
    sim = Sim(cfg)
    system = [random.Random(777).randrange(1, 97) for _ in range(SYSTEM_TOKENS // load.scale)]
    fields = {"kv_budget": load.budget, "kv_session": True, **load.extra}
    queue = list(enumerate(_conversations(load)))
    per_client = max(1, load.active // load.clients)
    mine: list[list] = [[] for _ in range(load.clients)]  # [conv, prompt, turn] per client
    cursor = [0] * load.clients
    in_flight: dict[str, tuple[int, list]] = {}  # request id -> (client, its slot)
    out = ChatResult()
    n = 0

    def send(client: int) -> None:
        nonlocal n
        slots = mine[client]
        while len(slots) < per_client and queue:
            index, conv = queue.pop(0)
            slots.append([index, conv, list(system), 0])
        if not slots:
            return
        cursor[client] %= len(slots)
        slot = slots[cursor[client]]
        _, conv, history, t = slot
        prompt = history + conv["users"][t]
        slot[2] = prompt
        req_id = f"c{slot[0]}t{t}r{n}"
        n += 1
        room = cfg.max_model_len - len(prompt)  # vLLM's front end: 400 past the model's length
        if room < 1 or sim.add(req_id, prompt, min(conv["answers"][t], room), fields).refused:
            out.refused += 1  # as the load does on an error: the conversation ends here
            slots.remove(slot)
            send(client)
            return
        in_flight[req_id] = (client, slot)

    for c in range(load.clients):
        send(c)
    while in_flight and sim.steps < load.max_steps:
        sim.step()
        out.preemptions += len(sim.trace[-1][2])
        out.held_blocks.append(sim.scheduler.obcache_prefix.held_blocks)
        for req_id in [r for r in in_flight if sim.results[r].finish is not None]:
            client, slot = in_flight.pop(req_id)
            result = sim.results[req_id]
            out.requests += 1
            t = slot[3]
            if t >= 1:
                out.follow_ups += 1
                if (result.outcome or {}).get("reused_from") == "session":
                    out.continued += 1
            slot[2] = slot[2] + result.tokens  # the answer, fed back
            slot[3] = t + 1
            slots = mine[client]
            if slot[3] >= len(slot[1]["users"]):
                slots.remove(slot)
            else:
                cursor[client] += 1
            send(client)
    out.steps = sim.steps
    out.counts = {f"{k}_{w}": v for (k, w), v in sim.scheduler.obcache_prefix.counts.items()}
    out.violations = len(sim.violations)
    return out
