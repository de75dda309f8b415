"""Built-in task families for a real pretrained instruct base (SmolLM2-135M-Instruct), deterministic by seed.

Each asks a question in plain English with a short exact answer, so a greedy completion can be scored
by exact match and the GRPO stage can reward it (``grpo.exact_answer_reward``): ``arithmetic``
(two-digit sums and differences) and ``sort_words`` (three words in alphabetical order, which the base
gets wrong mostly by its answer's form: ``Daisy, needle, tunnel.``). Their wrong answers (``wrong_answer``)
make the preference pairs: a number off by a little, the words in their given order. Registered in
``tasks.TASKS``, so they share its hash-keyed shards and validation split.
"""

from __future__ import annotations

import hashlib
import random

Example = dict[str, str]

# Common lowercase nouns of one or two syllables, distinct first letters within a prompt (see sort_words).
WORDS = (
    "apple", "arrow", "badge", "basket", "bread", "cabin", "candle", "cloud", "daisy", "desk", "dragon",
    "eagle", "engine", "fabric", "feather", "forest", "garden", "ginger", "grape", "hammer", "harbor", "honey",
    "island", "ivory", "jacket", "jelly", "jungle", "kettle", "kitten", "lemon", "ladder", "lantern", "mango",
    "marble", "meadow", "napkin", "needle", "nickel", "ocean", "olive", "orange", "paper", "pencil", "pepper",
    "quilt", "rabbit", "ribbon", "river", "saddle", "salmon", "silver", "table", "tiger", "tomato", "tunnel",
    "violin", "velvet", "wagon", "walnut", "window", "yogurt", "zebra",
)


def arithmetic(rng: random.Random) -> Example:
    """``What is 30 + 86? Answer with only the number.`` -> ``116``; a difference is never negative."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if rng.random() < 0.5:
        op, ans = "+", a + b
    else:
        a, b = max(a, b), min(a, b)
        op, ans = "-", a - b
    return {"instruction": f"What is {a} {op} {b}? Answer with only the number.", "input": "", "output": str(ans)}


def sort_words(rng: random.Random) -> Example:
    """Three words with distinct first letters -> the same words in alphabetical order, comma-separated."""
    words: list[str] = []
    while len(words) < 3:
        w = rng.choice(WORDS)
        if all(w[0] != v[0] for v in words):
            words.append(w)
    return {"instruction": f"Sort these words alphabetically: {', '.join(words)}. Answer with only the words, "
                           "separated by commas.", "input": "", "output": ", ".join(sorted(words))}


def _given_words(ex: Example) -> str:
    return ex["instruction"].split(": ", 1)[1].split(". ", 1)[0]


def prompt_bucket(ex: Example, *, salt: str) -> float:
    """A uniform number in [0, 1) fixed by the example's prompt text (stable across runs/platforms); tasks.py
    splits every family into shards and validation by it (here, at the leaf, so the two modules form no cycle)."""
    key = f"{salt}\x00{ex['instruction']}\x00{ex['input']}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2.0**64


def wrong_answer(task: str, ex: Example) -> str:
    """A plausible wrong answer to ``ex``, fixed by its prompt: a number off by 1 to 3 (never negative),
    or the words as given (reversed when they were given sorted)."""
    if task == "arithmetic":
        ans = int(ex["output"])
        step = 1 + int(prompt_bucket(ex, salt="wrong") * 3)
        return str(ans + step if ans < step or prompt_bucket(ex, salt="sign") < 0.5 else ans - step)
    if task == "sort_words":
        given = _given_words(ex)
        return given if given != ex["output"] else ", ".join(reversed(given.split(", ")))
    raise ValueError(f"no wrong answers are defined for task {task!r}")
