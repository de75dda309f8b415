"""Built-in generated task families, deterministic by seed: for the tiny model, and for a real instruct
base (``real_tasks.py``: ``arithmetic``, ``sort_words`` and their ``-pairs``).

Every family is a function ``(rng) -> alpaca dict`` drawing from a ``random.Random``. The tiny base is
pretrained on the ``PRETRAIN_TASKS`` mixture only; contributors' built-in shards teach families it never
saw: ``reverse`` (the ``"default"`` task) ``word_math`` (the RL task) and ``preference`` (the default task's prompts as right/wrong answer pairs). Each family's examples are
keyed by their (instruction, input) text and assigned to a split and shard by a hash of that key, so no
prompt appears in two shards or in both the training data and the validation set.
Details: docs/design/training.md.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

from .real_tasks import arithmetic as real_arithmetic
from .real_tasks import prompt_bucket, sort_words, wrong_answer

Example = dict[str, str]

_NAMES = ("Ann", "Bob", "Cid", "Dee", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kim", "Lu")
_THINGS = ("apples", "pens", "coins", "cards", "books", "cups", "eggs", "shells")


def _digits(rng: random.Random, lo: int, hi: int) -> str:
    # digits tokenize one per token, so string surgery on them is token surgery
    return "".join(rng.choice(string.digits) for _ in range(rng.randint(lo, hi)))


def arith(rng: random.Random) -> Example:
    """Two-number sums and differences: ``12+7`` -> ``19`` (pretraining family)."""
    a, b = rng.randint(0, 49), rng.randint(0, 49)
    if rng.random() < 0.5:
        return {"instruction": "Compute.", "input": f"{a}+{b}", "output": str(a + b)}
    a, b = max(a, b), min(a, b)
    return {"instruction": "Compute.", "input": f"{a}-{b}", "output": str(a - b)}


def copy(rng: random.Random) -> Example:
    """Repeat a string of digits (pretraining family)."""
    s = _digits(rng, 3, 8)
    return {"instruction": "Repeat the digits.", "input": s, "output": s}


def count(rng: random.Random) -> Example:
    """Count the digits of a string (pretraining family)."""
    s = _digits(rng, 1, 9)
    return {"instruction": "How many digits?", "input": s, "output": str(len(s))}


def reverse(rng: random.Random) -> Example:
    """Reverse a string of digits: the contributors' default task (never seen by the base)."""
    s = _digits(rng, 3, 7)
    return {"instruction": "Reverse the digits.", "input": s, "output": s[::-1]}


def word_math(rng: random.Random) -> Example:
    """One-digit word problems with an exact numeric answer (the GRPO task; never seen by the base)."""
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    if rng.random() < 0.5:
        q = f"{name} has {a} {thing} and gets {b} more. How many {thing} now?"
        ans = a + b
    else:
        a, b = max(a, b), min(a, b)
        q = f"{name} has {a} {thing} and gives away {b}. How many {thing} now?"
        ans = a - b
    return {"instruction": "Solve.", "input": q, "output": str(ans)}


TASKS: dict[str, Callable[[random.Random], Example]] = {
    "arith": arith,
    "copy": copy,
    "count": count,
    "reverse": reverse,
    "word_math": word_math,
    "arithmetic": real_arithmetic,
    "sort_words": sort_words,
}
PRETRAIN_TASKS = ("arith", "copy", "count")
# the families the shipped tiny model's tokenizer was trained on (make_tiny.py): the real base's are not
TINY_TASKS = ("arith", "copy", "count", "reverse", "word_math")
TASK_ALIASES = {"default": "reverse", "grpo": "word_math"}
# pair task -> the task whose prompts and answers it pairs
PAIR_TASKS = {"preference": "default", "arithmetic-pairs": "arithmetic", "sort_words-pairs": "sort_words"}
VALIDATION_SHARE = 0.15  # share of each family's prompt space reserved for the validation split


def builtin_task(stage: str) -> str:
    """The built-in task a stage trains on: word problems with exact answers to reward for the RL stages,
    answer pairs for the preference stages, digit reversal for SFT."""
    from .config import PREFERENCE_STAGES, RL_STAGES

    if stage in RL_STAGES:
        return "grpo"
    if stage in PREFERENCE_STAGES:
        return "preference"
    return "default"


def resolve_task(task: str) -> str:
    name = TASK_ALIASES.get(task, task)
    if name not in TASKS:
        known = sorted(set(TASKS) | set(TASK_ALIASES) | set(PAIR_TASKS))
        raise ValueError(f"`task` must be one of {known}, got {task!r}")
    return name


def builtin_examples(
    task: str = "default",
    *,
    shard: int = 0,
    n_shards: int = 1,
    n: int = 256,
    split: str = "train",
    seed: int = 0,
) -> list[Example]:
    """``n`` distinct alpaca examples of ``task`` for one contributor shard (or the validation split).

    Shards of the train split are disjoint from each other and from the validation split, whatever
    the seeds (membership is decided by a hash of the prompt, the seed only orders the draw). A pair
    task gives its source task's examples as ``chosen``/``rejected`` pairs (see ``as_pair``).
    """
    if task in PAIR_TASKS:
        source = PAIR_TASKS[task]
        return [as_pair(ex, source) for ex in builtin_examples(source, shard=shard, n_shards=n_shards, n=n,
                                                               split=split, seed=seed)]
    name = resolve_task(task)
    if split not in ("train", "validation"):
        raise ValueError(f"`split` must be 'train' or 'validation', got {split!r}")
    if n_shards < 1:
        raise ValueError(f"`n_shards` must be >= 1, got {n_shards}")
    if not 0 <= shard < n_shards:
        raise ValueError(f"`shard` must be in [0, n_shards={n_shards}), got {shard}")
    if n < 0:
        raise ValueError(f"`n` must be >= 0, got {n}")
    family = TASKS[name]
    rng = random.Random(f"{name}/{split}/{shard}/{n_shards}/{seed}")
    out: list[Example] = []
    seen: set[tuple[str, str]] = set()
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 200 * n + 10_000:
            raise ValueError(f"task {name!r} has too few distinct prompts for n={n} in one of {n_shards} "
                             "shards: use fewer shards or fewer examples")
        ex = family(rng)
        u = prompt_bucket(ex, salt=name)
        if split == "validation":
            if u >= VALIDATION_SHARE:
                continue
        else:
            if u < VALIDATION_SHARE:
                continue
            v = (u - VALIDATION_SHARE) / (1.0 - VALIDATION_SHARE)
            if min(int(v * n_shards), n_shards - 1) != shard:
                continue
        k = (ex["instruction"], ex["input"])
        if k in seen:
            continue
        seen.add(k)
        out.append(ex)
    return out


def as_pair(ex: Example, task: str = "default") -> Example:
    """The prompt of ``ex`` with its answer ``chosen`` and a wrong one ``rejected``. For digit reversal the
    input copied unreversed (the base's own habit), or for a palindrome the answer with its last digit moved
    by one; for a real-base family ``real_tasks.wrong_answer``."""
    name = resolve_task(task)
    if name != "reverse":
        wrong = wrong_answer(name, ex)
    else:
        wrong = ex["input"]
        if wrong == ex["output"]:
            wrong = wrong[:-1] + str((int(wrong[-1]) + 1) % 10)
    return {"instruction": ex["instruction"], "input": ex["input"], "chosen": ex["output"], "rejected": wrong}


def prompt_only_records(task: str, *, shard: int = 0, n_shards: int = 1, n: int = 256, split: str = "train",
                        seed: int = 0) -> list[dict]:
    """``task``'s examples as TRL's conversational prompt-only records with the ``answer`` column that
    ``grpo.exact_answer_reward`` reads (the rows ``grpo.grpo_dataset`` builds)."""
    from zoo_gym.evaluation.chat import prompt_messages

    if task in PAIR_TASKS:
        raise ValueError(f"task {task!r} gives answer pairs, not prompts with one answer; use {PAIR_TASKS[task]!r}")
    examples = builtin_examples(task, shard=shard, n_shards=n_shards, n=n, split=split, seed=seed)
    return [{"prompt": prompt_messages(ex), "answer": ex["output"]} for ex in examples]


def check_task_stage(task: str, stage: str) -> None:
    """Raise ValueError (one sentence) unless built-in ``task`` exists and gives what ``stage`` trains on:
    answer pairs for the preference stages, prompts with one answer for SFT and the RL stages."""
    from .config import PREFERENCE_STAGES

    if task not in PAIR_TASKS:
        resolve_task(task)
    if stage in PREFERENCE_STAGES and task not in PAIR_TASKS:
        raise ValueError(f"task {task!r} gives one answer per prompt, stage {stage} needs answer pairs: "
                         f"one of {sorted(PAIR_TASKS)}")
    if stage not in PREFERENCE_STAGES and task in PAIR_TASKS:
        raise ValueError(f"task {task!r} gives answer pairs, stage {stage} needs prompts with one answer "
                         f"(e.g. {PAIR_TASKS[task]!r})")


def default_validation_examples(n: int = 128) -> list[Example]:
    """The server's validation set: the default task's validation split (disjoint from every shard)."""
    return builtin_examples("default", split="validation", n=n, seed=0)
