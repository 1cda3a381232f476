"""Deterministic long texts for tests and benchmarks (offline, seeded; stdlib only).

Narrative sentences about towns and goods, with optional key facts ("needles"). No downloads
and no system packages, so every benchmark and test is reproducible from its seed.
"""

from __future__ import annotations

import random

_NAMES = [
    "Avalon", "Brightwater", "Cedar Hollow", "Duskmere", "Elmstead", "Fairhaven", "Greywick",
    "Harrowgate", "Ironvale", "Juniper Ford", "Kestrel Bay", "Larkspur", "Millbrook", "Northcote",
]
_TRADES = ["wool", "salt", "copper", "timber", "glass", "honey", "linen", "amber", "barley"]
_VERBS = ["traded", "stored", "shipped", "counted", "sold", "carried", "weighed", "taxed"]
_SEASONS = ["spring", "summer", "autumn", "winter"]


def haystack(num_sentences: int, seed: int) -> str:
    """``num_sentences`` sentences (about 27 tokens each with the SmolLM2 tokenizer)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_sentences):
        town, other = rng.sample(_NAMES, 2)
        out.append(
            f"In the {rng.choice(_SEASONS)} of year {rng.randint(1100, 1900)}, the people of "
            f"{town} {rng.choice(_VERBS)} {rng.randint(2, 900)} crates of "
            f"{rng.choice(_TRADES)} with {other}."
        )
    return " ".join(out)


def needle_prompt(num_sentences: int, seed: int) -> tuple[str, str]:
    """A haystack with one key fact in the middle and a question about it: (prompt, answer)."""
    context, question, code = needle_parts(num_sentences, seed)
    return context + question, code


def needle_parts(num_sentences: int, seed: int) -> tuple[str, str, str]:
    """:func:`needle_prompt` in parts: (context, question, answer); prompt = context + question."""
    rng = random.Random(seed + 1_000_003)
    code = str(rng.randint(10000, 99999))
    town = rng.choice(_NAMES)
    head = haystack(num_sentences // 2, seed)
    tail = haystack(num_sentences - num_sentences // 2, seed + 7)
    fact = f" The secret code of {town} is {code}. "
    question = (
        f"\nQuestion: What is the secret code of {town}? "
        f"Answer: The secret code of {town} is"
    )
    return head + fact + tail, question, code
