"""RULER-style long-context tasks, generated offline from a seed (stdlib only, no tokenizer).

Four synthetic retrieval tasks after RULER (Hsieh et al., 2024), on the narrative haystack of
:mod:`obcache_vllm.textgen`:

  niah_single     one "special magic number" needle; ask for it
  niah_multikey   four needles with different keys; ask for one key's number
  niah_multivalue four numbers for the same key; ask for all of them
  vt              variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ...;
                  ask for every variable that holds the value

A :class:`Sample` is split into ``context`` (the document: what query-agnostic compression sees)
and ``question`` (asked after it), plus the ``answer_prefix`` the model continues from. The
score of a generation is the fraction of the expected strings it contains (RULER's
``string_match_all``); single-answer tasks score 0 or 1.

Lengths are nominal token counts: the haystack has ``round(length / TOKENS_PER_SENTENCE)``
sentences (about 27 SmolLM2 tokens each); the harness records the real token counts.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass

from obcache_vllm.textgen import haystack

TOKENS_PER_SENTENCE = 27
# Short enough that the needles and the question never dominate the nominal length.
_ADJECTIVES = [
    "amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly",
    "keen", "lucky", "mellow", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy",
    "upper", "vivid", "wild", "young", "zesty", "bold", "crisp", "deep", "early", "fancy",
]
_NOUNS = [
    "falcon", "river", "lantern", "meadow", "harbor", "violin", "compass", "orchard", "glacier",
    "canyon", "pepper", "willow", "anchor", "beacon", "cobalt", "dragon", "ember", "fern",
    "garnet", "hazel", "island", "jasper", "kettle", "lotus", "marble", "nectar", "otter",
]
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class Sample:
    """One generated prompt: ``context`` + ``question`` (+ ``answer_prefix``) and its answers."""

    task: str
    length: int
    index: int
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]

    def to_json(self) -> dict:
        return {**asdict(self), "answers": list(self.answers)}

    @classmethod
    def from_json(cls, data: dict) -> Sample:
        return cls(**{**data, "answers": tuple(data["answers"])})


def _rng(task: str, length: int, index: int, seed: int) -> random.Random:
    # A string seed is hashed deterministically by random.Random (sha512), unlike hash().
    return random.Random(f"{task}/{length}/{index}/{seed}")


def _key(rng: random.Random, taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if key not in taken:
            taken.add(key)
            return key


def _number(rng: random.Random, taken: set[str]) -> str:
    while True:
        value = str(rng.randint(1_000_000, 9_999_999))
        if value not in taken:
            taken.add(value)
            return value


def _insert(sentences: list[str], inserts: list[str], rng: random.Random) -> str:
    """Insert each string at a random sentence boundary (depth uniform over the document)."""
    out = list(sentences)
    for text in inserts:
        out.insert(rng.randint(0, len(out)), text)
    return " ".join(out)


def _filler(length: int, rng: random.Random, reserve: int) -> list[str]:
    count = max(1, round(length / TOKENS_PER_SENTENCE) - reserve)
    text = haystack(count, rng.randint(0, 2**31))
    return [s + "." for s in text[:-1].split(". ")]


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def niah_single(length: int, index: int, seed: int) -> Sample:
    rng = _rng("niah_single", length, index, seed)
    key, value = _key(rng, set()), _number(rng, set())
    context = _insert(_filler(length, rng, 1), [_needle(key, value)], rng)
    return Sample(
        "niah_single", length, index, context,
        f"What is the special magic number for {key} mentioned in the provided text?",
        f"The special magic number for {key} mentioned in the provided text is", (value,),
    )  # fmt: skip


def niah_multikey(length: int, index: int, seed: int, num_keys: int = 4) -> Sample:
    rng = _rng("niah_multikey", length, index, seed)
    keys_taken: set[str] = set()
    values_taken: set[str] = set()
    pairs = [(_key(rng, keys_taken), _number(rng, values_taken)) for _ in range(num_keys)]
    context = _insert(_filler(length, rng, num_keys), [_needle(k, v) for k, v in pairs], rng)
    key, value = pairs[rng.randrange(num_keys)]
    return Sample(
        "niah_multikey", length, index, context,
        f"What is the special magic number for {key} mentioned in the provided text?",
        f"The special magic number for {key} mentioned in the provided text is", (value,),
    )  # fmt: skip


def niah_multivalue(length: int, index: int, seed: int, num_values: int = 4) -> Sample:
    rng = _rng("niah_multivalue", length, index, seed)
    key = _key(rng, set())
    taken: set[str] = set()
    values = [_number(rng, taken) for _ in range(num_values)]
    context = _insert(_filler(length, rng, num_values), [_needle(key, v) for v in values], rng)
    return Sample(
        "niah_multivalue", length, index, context,
        f"What are all the special magic numbers for {key} mentioned in the provided text?",
        f"The special magic numbers for {key} mentioned in the provided text are", tuple(values),
    )  # fmt: skip


def variable_tracking(length: int, index: int, seed: int, hops: int = 4) -> Sample:
    rng = _rng("vt", length, index, seed)
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choice(_LETTERS) for _ in range(5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10_000, 99_999))
    chain = [f"VAR {names[0]} = {value}."] + [
        f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)
    ]
    sentences = _filler(length, rng, hops + 1)
    # The chain keeps its order: sorted random boundaries, inserted back to front.
    spots = sorted(rng.randint(0, len(sentences)) for _ in chain)
    for spot, text in reversed(list(zip(spots, chain, strict=True))):
        sentences.insert(spot, text)
    return Sample(
        "vt", length, index, " ".join(sentences),
        f"Find all variables that are assigned the value {value} in the text above.",
        f"Answer: According to the chain of variable assignments in the text above, "
        f"{hops + 1} variables are assigned the value {value}, they are:",
        tuple(names),
    )  # fmt: skip


TASKS: dict[str, Callable[[int, int, int], Sample]] = {
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "vt": variable_tracking,
}
TASK_NAMES: tuple[str, ...] = tuple(TASKS)


def generate(task: str, length: int, count: int, seed: int) -> list[Sample]:
    """``count`` samples of ``task`` at nominal ``length`` tokens; the same for the same seed."""
    try:
        make = TASKS[task]
    except KeyError:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASK_NAMES)}") from None
    if length < TOKENS_PER_SENTENCE * 4 or count < 1:
        raise ValueError(f"need length >= {TOKENS_PER_SENTENCE * 4} and count >= 1")
    return [make(length, i, seed) for i in range(count)]


def score(sample: Sample, generated: str) -> float:
    """Fraction of the expected answers found in ``generated`` (case-insensitive substring)."""
    text = generated.lower()
    return sum(a.lower() in text for a in sample.answers) / len(sample.answers)


# Marker replaced by the context when rendering a chat template (never occurs in a sample).
_CONTEXT_MARK = "\x00CONTEXT\x00"


def render(
    sample: Sample, chat_template: Callable[[str], str] | None = None
) -> tuple[str, str]:
    """The prompt as ``(context_part, question_part)``: their concatenation is the full prompt.

    ``context_part`` ends with the document, so a compression point at its last token sees
    nothing of the question. ``chat_template(user_message) -> text`` renders a chat prompt
    (with the generation prompt); without it the prompt is plain text.
    """
    user = f"{_CONTEXT_MARK}\n\n{sample.question}"
    if chat_template is None:
        text = user + "\n" + sample.answer_prefix
    else:
        text = chat_template(user) + sample.answer_prefix
    head, mark, tail = text.partition(_CONTEXT_MARK)
    if not mark:
        raise ValueError("the chat template dropped the user message")
    return head + sample.context, tail
