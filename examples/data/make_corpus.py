"""Write fables.txt: a small English corpus for examples/train.py, composed here, not downloaded.

The fables come from a fixed seed and a small grammar, so the file is the same on every machine
and anyone can regenerate it:

    python examples/data/make_corpus.py            # rewrites examples/data/fables.txt
    python examples/data/make_corpus.py --check    # exits 1 if the shipped file is stale

The grammar is deliberately repetitive: a character-level model learns its spelling, spacing and
sentence shapes within a few hundred steps, so the loss visibly falls in a one-minute CPU run.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

SEED = 1337
NUM_FABLES = 600
OUT = Path(__file__).with_name("fables.txt")

ANIMALS = [
    "fox", "heron", "badger", "crow", "tortoise", "hare", "wolf", "lamb", "owl", "mouse",
    "lion", "goat", "ant", "grasshopper", "stag", "frog", "ox", "sparrow", "bear", "weasel",
]  # fmt: skip
PEOPLE = ["miller", "shepherd", "weaver", "fisherman", "potter", "old woman", "boy", "farmer"]
PLACES = [
    "by the river", "in the dark wood", "at the edge of the field", "under the old oak",
    "near the mill", "on the hill", "beside the well", "in the reeds", "at the crossroads",
]  # fmt: skip
TIMES = [
    "One morning", "Late one autumn", "In the heat of summer", "When the snow lay deep",
    "At dusk", "Long ago", "On a windy day", "Before the harvest",
]  # fmt: skip
WANTS = [
    "a piece of cheese", "a drink of water", "a warm place to sleep", "the ripest grapes",
    "a safe road home", "the farmer's corn", "a friend to talk to", "a golden feather",
]  # fmt: skip
TRAITS = ["proud", "clever", "lazy", "greedy", "patient", "foolish", "kind", "boastful", "timid"]
DEEDS = [
    "tried to trick", "laughed at", "asked for help from", "made a bargain with",
    "raced against", "shared a meal with", "hid from", "boasted to",
]  # fmt: skip
REASONS = ["I am hungry", "the night is cold", "I am tired", "I am lost"]
PRAISE = ["you are wise", "you are strong", "you know the way", "you have enough"]
ENDINGS = [
    "went away with nothing at all",
    "learned that pride goes before a fall",
    "was glad of a friend in need",
    "ran home faster than the wind",
    "never told that story again",
    "slept soundly until the spring",
]  # fmt: skip
MORALS = [
    "Slow and steady wins the race.",
    "A friend in need is a friend indeed.",
    "Do not count your chickens before they hatch.",
    "Look before you leap.",
    "Little by little does the trick.",
    "Pride goes before a fall.",
    "Those who boast the loudest do the least.",
    "It is easy to despise what you cannot get.",
    "Kindness is never wasted.",
    "Work today, and eat tomorrow.",
]  # fmt: skip


def article(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def fable(rng: random.Random, number: int) -> str:
    hero, rival = rng.sample(ANIMALS, 2)
    person = rng.choice(PEOPLE)
    trait, want = rng.choice(TRAITS), rng.choice(WANTS)
    lines = [
        f"{number}. THE {hero.upper()} AND THE {rival.upper()}",
        "",
        f"{rng.choice(TIMES)}, {article(trait)} {hero} lived {rng.choice(PLACES)}. "
        f"More than anything, the {hero} wanted {want}.",
        f"The {hero} {rng.choice(DEEDS)} the {rival}, who said, "
        f'"Why should I help you, {hero}? You never helped me."',
        f'"Because," said the {hero}, "{rng.choice(REASONS)}, and {rng.choice(PRAISE)}."',
    ]
    if rng.random() < 0.5:
        lines.append(
            f"Just then the {person} came along the path, and the two of them "
            f"{rng.choice(['hid in the grass', 'stood very still', 'ran in different directions'])}."
        )
    hero_end, rival_end = rng.sample(ENDINGS, 2)
    lines += [
        f"In the end the {hero} {hero_end}, and the {rival} {rival_end}.",
        "",
        f"Moral: {rng.choice(MORALS)}",
        "",
        "",
    ]
    return "\n".join(lines)


def corpus() -> str:
    rng = random.Random(SEED)
    header = "FABLES FOR SMALL MACHINES\n\nComposed for the fsdp2 examples. Free to use.\n\n\n"
    return header + "".join(fable(rng, i) for i in range(1, NUM_FABLES + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if fables.txt is stale")
    args = parser.parse_args()
    text = corpus()
    if args.check:
        if OUT.read_text() != text:
            sys.exit(f"{OUT} is stale: run python {__file__}")
        return
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(text):,} characters, {len(set(text))} distinct)")


if __name__ == "__main__":
    main()
