"""Quality over turns: multi-turn chats scored with a full cache, a budget recomputed each turn,
and a budget carried over turns (``kv_session``).

A conversation (seeded, offline text): a system text of filler records with two facts in it
("The code of the <color> box is NNNN."), then a first user turn that states two more facts
and asks for an acknowledgement; every later turn asks for one of the four values ("What is the
code of the red box? Answer with the number only."), alternating between the system text's
facts and the first turn's. The model's own answers are appended to the history, as a chat
client does. A turn is correct when its answer contains the value.

Arms, all greedy on the same conversations, turn by turn with every conversation of the arm in
one batch (the offline engine, prefix caching on):

* ``full``: no budget;
* ``recompute@B``: ``kv_budget`` B (a fraction of each turn's prompt) + ``kv_decode``, every turn
  compressed anew from the whole conversation;
* ``session@B``: the same options + ``kv_session``: each turn continues the cache its previous
  turn left.

Usage::

    obcache-vllm eval sessions --conversations 30 --turns 8 --budgets 0.25,0.5

Writes ``results/eval-sessions/sessions.json`` (every answer) and ``sessions.md`` (accuracy
per arm and turn, with the number of answers). vLLM is imported when the command runs.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass

from obcache_vllm.textgen import haystack

COLORS = ["red", "blue", "green", "white", "black", "gray", "pink", "brown", "golden", "silver"]
OBJECTS = ["box", "door", "chest", "gate", "crate", "safe"]


@dataclass(frozen=True)
class Fact:
    color: str
    thing: str
    value: str

    @property
    def statement(self) -> str:
        return f"The code of the {self.color} {self.thing} is {self.value}."

    @property
    def question(self) -> str:
        return f"What is the code of the {self.color} {self.thing}? Answer with the number only."


@dataclass(frozen=True)
class Conversation:
    system: str
    first_turn: str
    facts: tuple[Fact, ...]  # two in the system text, then two in the first turn

    def question(self, turn: int) -> tuple[str, Fact]:
        """The user message of turn ``turn`` >= 2 and the fact it asks about."""
        fact = self.facts[(turn - 2) % len(self.facts)]
        return fact.question, fact


def conversation(seed: int, sentences: int = 30) -> Conversation:
    rng = random.Random(seed)
    pairs = rng.sample([(c, o) for c in COLORS for o in OBJECTS], 4)
    facts = tuple(Fact(c, o, str(rng.randint(1000, 9999))) for c, o in pairs)
    records = haystack(sentences, seed=1000 + seed).split(". ")
    third = len(records) // 3
    records.insert(third, facts[0].statement.rstrip("."))
    records.insert(2 * third, facts[1].statement.rstrip("."))
    system = "You are a careful clerk. The records:\n" + ". ".join(records)
    first = (f"Please note two more codes. {facts[2].statement} {facts[3].statement} "
             "Reply with OK.")  # fmt: skip
    return Conversation(system, first, facts)


@dataclass
class Answer:
    arm: str
    conversation: int
    turn: int
    expected: str
    text: str
    correct: bool
    usage: dict | None


def _arms(budgets) -> dict[str, dict | None]:
    arms: dict[str, dict | None] = {"full": None}
    for b in budgets:
        base = {"kv_budget": b, "kv_decode": True}
        arms[f"recompute@{b:g}"] = base
        arms[f"session@{b:g}"] = {**base, "kv_session": True}
    return arms


def run(llm, conversations: int, turns: int, budgets, max_tokens: int = 12) -> list[Answer]:
    from vllm import SamplingParams

    convs = [conversation(s) for s in range(conversations)]
    answers: list[Answer] = []
    for arm, kv in _arms(budgets).items():
        llm.reset_prefix_cache()  # every arm starts cold
        histories = [[{"role": "system", "content": c.system},
                      {"role": "user", "content": c.first_turn}] for c in convs]  # fmt: skip
        for turn in range(1, turns + 1):
            expected = []
            if turn > 1:
                for c, history in zip(convs, histories, strict=True):
                    question, fact = c.question(turn)
                    history.append({"role": "user", "content": question})
                    expected.append(fact.value)
            params = SamplingParams(temperature=0, max_tokens=max_tokens,
                                    extra_args=dict(kv) if kv else None)  # fmt: skip
            outs = llm.chat(histories, params, use_tqdm=False)
            for i, (out, history) in enumerate(zip(outs, histories, strict=True)):
                text = out.outputs[0].text
                history.append({"role": "assistant", "content": text})
                if turn > 1:
                    usage = (out.kv_transfer_params or {}).get("obcache")
                    answers.append(Answer(arm, i, turn, expected[i], text,
                                          expected[i] in text, usage))  # fmt: skip
        print(f"[eval sessions] {arm}: {_accuracy([a for a in answers if a.arm == arm]):.2f}",
              flush=True)  # fmt: skip
    return answers


def _accuracy(answers) -> float:
    return sum(a.correct for a in answers) / max(1, len(answers))


def table(answers: list[Answer], turns: int) -> str:
    arms = list(dict.fromkeys(a.arm for a in answers))
    head = "| arm | all turns | " + " | ".join(f"turn {t}" for t in range(2, turns + 1)) + " |"
    lines = [head, "|" + "---|" * (turns + 1)]
    for arm in arms:
        mine = [a for a in answers if a.arm == arm]
        cells = [f"{_accuracy([a for a in mine if a.turn == t]):.2f}" for t in range(2, turns + 1)]
        lines.append(f"| {arm} | **{_accuracy(mine):.2f}** (n={len(mine)}) | "
                     + " | ".join(cells) + " |")  # fmt: skip
    by_source = ["", "| arm | facts in the system text | facts in the first turn |",
                 "|---|---|---|"]  # fmt: skip
    for arm in arms:
        mine = [a for a in answers if a.arm == arm]
        system = [a for a in mine if (a.turn - 2) % 4 < 2]
        first = [a for a in mine if (a.turn - 2) % 4 >= 2]
        by_source.append(f"| {arm} | {_accuracy(system):.2f} (n={len(system)}) | "
                         f"{_accuracy(first):.2f} (n={len(first)}) |")  # fmt: skip
    return "\n".join(lines + by_source) + "\n"


def main(args) -> int:
    from vllm import LLM

    from obcache_vllm import model

    path = args.model or str(model.pull(log=lambda m: None))
    llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=4096, block_size=32,
              seed=0, max_num_seqs=64, max_num_batched_tokens=2048)  # fmt: skip
    started = time.time()
    answers = run(llm, args.conversations, args.turns, args.budgets)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"conversations": args.conversations, "turns": args.turns, "budgets": args.budgets,
            "seconds": round(time.time() - started), "date": time.strftime("%Y-%m-%d"),
            "command": "obcache-vllm eval sessions " + " ".join(
                f"--{k.replace('_', '-')} {','.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in (("conversations", args.conversations), ("turns", args.turns),
                             ("budgets", args.budgets)))}  # fmt: skip
    (args.out / "sessions.json").write_text(
        json.dumps({"meta": meta, "answers": [asdict(a) for a in answers]}, indent=1) + "\n")
    md = (f"Multi-turn retrieval, {args.conversations} conversations x {args.turns} turns, "
          f"greedy, the default model; `{meta['command']}` ({meta['date']}, "
          f"{meta['seconds']} s).\n\n" + table(answers, args.turns))  # fmt: skip
    (args.out / "sessions.md").write_text(md)
    print(md)
    return 0
