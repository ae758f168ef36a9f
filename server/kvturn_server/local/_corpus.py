"""Deterministic training text for the local tokenizer.

The tokenizer must come out byte-identical on every machine, so its training text cannot depend
on what happens to be installed (the standard library's sources differ between patch releases).
The text is generated here from fixed word lists and a seeded ``random.Random``, whose integer
and choice methods have produced the same sequences since Python 3.2.
"""

from __future__ import annotations

import json
import random

WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not which "
    "but all they were one can there their has been if more when will would who so no out up into "
    "than them only other new some could time these two may then first any like now over such our "
    "man me even most made after also did many before must through back years where much your way "
    "well down should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same another "
    "know while last might us great old year off come since against go came right used take three "
    "agent tool call result turn prompt token cache block decode prefill router model request "
    "response stream server client message assistant user system function arguments search file "
    "weather city temperature read write list open close query answer think plan step value error"
).split()

_CODE = (
    "def class return import from if else elif for while try except finally with as lambda yield "
    "None True False self cls async await raise pass break continue global nonlocal assert del "
    "print len range dict list set tuple str int float bool open sorted enumerate zip map filter"
).split()

_CITIES = ("Paris", "Lima", "Oslo", "Tokyo", "Cairo", "Quito", "Perth", "Seoul", "Dakar", "Bern")


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "?", "!", ","])


def _code_line(rng: random.Random) -> str:
    indent = "    " * rng.randint(0, 3)
    words = [rng.choice(_CODE + WORDS) for _ in range(rng.randint(2, 8))]
    punct = rng.choice(["(", ")", ":", " = ", ", ", "[", "]", ".", " + ", " == "])
    return indent + punct.join(words)


def _tool_json(rng: random.Random) -> str:
    call = {
        "name": rng.choice(["get_weather", "search", "read_file", "lookup", "add"]),
        "arguments": {
            "city": rng.choice(_CITIES),
            "n": rng.randint(0, 999),
            "query": " ".join(rng.choice(WORDS) for _ in range(3)),
        },
    }
    return json.dumps(call)


def training_text(seed: int = 0, paragraphs: int = 1500) -> list[str]:
    """Return the tokenizer's training text as a list of paragraphs (prose, code, JSON)."""
    rng = random.Random(seed)
    out: list[str] = []
    for _ in range(paragraphs):
        kind = rng.random()
        if kind < 0.55:
            out.append(" ".join(_sentence(rng) for _ in range(rng.randint(2, 6))))
        elif kind < 0.85:
            out.append("\n".join(_code_line(rng) for _ in range(rng.randint(3, 10))))
        else:
            out.append(_tool_json(rng))
    return out
