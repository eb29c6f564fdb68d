"""Arithmetic word problems of one or two steps with boxed answers, graded by the math reward.

    python -m arlopti_jax.tasks.arith --out data/arith                 # train.parquet, test.parquet
    python -m arlopti_jax.tasks.arith --out data/arith --ops add,sub --max-operand 20
    python -m arlopti_jax.tasks.arith --out data/arith2 --steps 2 --ops add,sub   # a + b - c, ...

A task a small pretrained instruct model can start on (SmolLM2-135M-Instruct answers about
six in ten of the default problems greedily and fewer when sampling; docs/results/real_model.md), so
that RL has groups with both right and wrong answers. Each prompt is a chat: a one-line
system message, one worked example (user question, assistant answer ending in
``\\boxed{7}``), then the question. Rows use the public math files' schema (``prompt`` as
chat messages, ``reward_model.ground_truth`` the answer as a string) with data source
``arith``, which the built-in router grades with the math reward (1 for the right boxed
answer, else 0).

Held out by operands: the unordered operand pairs are split once (seeded), so no test
question's numbers, in either order, appear in any training question; the test set measures
whether what RL taught carries to sums it never rewarded.

Up to ``ENUMERATE_LIMIT`` possible questions (the default operands 2..9 have 10,240) every
question is built and a seeded shuffle picks them (the data of the documented runs). Above it
(``--max-operand 1000`` would be 160 million strings) questions are drawn at random, rejecting
repeats and the other split's pairs, with the same distribution: each possible question equally
likely; a pair's split is then a seeded hash of the pair, ``test_share`` of them on average.

``--steps 2``: each question chains two operations on three operands (``a + b - c``: "has a, gets
b more, then gives away c"), every count along the way positive, with a two-step worked example.
They are always drawn as above; the split holds out operand triples (as unordered multisets), so
no test question's three numbers, in any order, appear together in a training question.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa

from arlopti_jax.tasks import generated

DATA_SOURCE = "arith"
OPS = ("add", "sub")
SYSTEM = "You are a helpful assistant."
EXAMPLE = ("Sara has 3 pens and gets 4 more. How many pens does Sara have now?",
           "3 + 4 = 7. The answer is \\boxed{7}.")
NAMES = ("Tom", "Anna", "Ben", "Lily", "Sam", "Mia", "Max", "Emma", "Leo", "Zoe")
ITEMS = ("apples", "pens", "books", "cards", "coins", "stickers", "shells", "marbles")
QUESTIONS = {
    "add": ("{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
            "{name} had {a} {item}. A friend gave {name} {b} more {item}. How many {item} does {name} have?"),
    "sub": ("{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?",
            "{name} had {a} {item} and lost {b} of them. How many {item} does {name} have now?"),
}

# two steps: (first op, second op) -> templates with operands a, b, c
QUESTIONS_2 = {
    ("add", "add"): ("{name} has {a} {item}, gets {b} more and then {c} more. How many {item} does {name} have now?",
                     "{name} had {a} {item}. One friend gave {name} {b} more and another gave {c} more. How many "
                     "{item} does {name} have?"),
    ("add", "sub"): ("{name} has {a} {item}, gets {b} more and then gives away {c}. How many {item} does {name} have "
                     "now?",
                     "{name} had {a} {item}, found {b} more and then lost {c}. How many {item} does {name} have?"),
    ("sub", "add"): ("{name} has {a} {item}, gives away {b} and then gets {c} more. How many {item} does {name} have "
                     "now?",
                     "{name} had {a} {item}, lost {b} and then found {c} more. How many {item} does {name} have?"),
    ("sub", "sub"): ("{name} has {a} {item}, gives away {b} and then gives away {c} more. How many {item} does "
                     "{name} have left?",
                     "{name} had {a} {item}, lost {b} and then lost {c} more. How many {item} does {name} have now?"),
}
EXAMPLE_2 = ("Sara has 3 pens, gets 4 more and then gives away 2. How many pens does Sara have now?",
             "3 + 4 = 7. 7 - 2 = 5. The answer is \\boxed{5}.")

_STR = pa.string()
SCHEMA = pa.schema([
    ("data_source", _STR),
    ("prompt", pa.list_(pa.struct([("content", _STR), ("role", _STR)]))),
    ("ability", _STR),
    ("reward_model", pa.struct([("ground_truth", _STR), ("style", _STR)])),
    ("extra_info", pa.struct([("index", pa.int64()), ("split", _STR), ("question", _STR)])),
])  # fmt: skip


def messages(question: str, steps: int = 1) -> list[dict[str, str]]:
    """The ``prompt`` column of one question: system line, the worked example (of as many steps),
    the question."""
    example = EXAMPLE if steps == 1 else EXAMPLE_2
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": example[0]},
            {"role": "assistant", "content": example[1]}, {"role": "user", "content": question}]


def split_pairs(min_operand: int, max_operand: int, test_share: float, seed: int):
    """(train, test) unordered operand pairs {a <= b}, the test share held out."""
    pairs = list(itertools.combinations_with_replacement(range(min_operand, max_operand + 1), 2))
    random.Random(seed).shuffle(pairs)
    cut = max(1, round(test_share * len(pairs)))
    return pairs[cut:], pairs[:cut]


ENUMERATE_LIMIT = 1_000_000


def _question(template: str, name: str, item: str, x: int, y: int, op: str) -> tuple[str, int]:
    return template.format(name=name, item=item, a=x, b=y), x + y if op == "add" else x - y


def _held_out(a: int, b: int, seed: int, test_share: float) -> bool:
    """Whether the unordered pair {a, b} is a test pair (the sampled path's split: no pair list)."""
    return random.Random(f"{seed}:{min(a, b)}:{max(a, b)}").random() < test_share


def _sample(min_operand: int, max_operand: int, ops: Sequence[str], test: bool, seed: int, test_share: float,
            rng: random.Random, count: int):
    """``count`` distinct (question, answer) pairs of one split, drawn uniformly from every
    possible question without building them: an operation, an ordered operand pair (a sum takes
    either order, a difference the larger first), a template, a name and an item, repeats and the
    other split's pairs rejected. Stops short of ``count`` only if 50 draws in a row are rejected."""
    seen, out, misses = set(), [], 0
    while len(out) < count and misses < 50 + 20 * count:
        op = rng.choice(list(ops))
        x, y = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
        template, name, item = rng.choice(QUESTIONS[op]), rng.choice(NAMES), rng.choice(ITEMS)
        problem = _question(template, name, item, x, y, op)
        if (op == "sub" and x <= y) or _held_out(x, y, seed, test_share) != test or problem[0] in seen:
            misses += 1
            continue
        seen.add(problem[0])
        out.append(problem)
    return out


def _sample_two_step(min_operand: int, max_operand: int, ops: Sequence[str], test: bool, seed: int,
                     test_share: float, rng: random.Random, count: int):
    """``count`` distinct two-step (question, answer) pairs of one split, as ``_sample`` draws one-step
    ones: two operations, three operands, every count along the way positive, the split by the
    operands' multiset."""
    seen, out, misses = set(), [], 0
    while len(out) < count and misses < 50 + 20 * count:
        first, second = rng.choice(list(ops)), rng.choice(list(ops))
        a, b, c = (rng.randint(min_operand, max_operand) for _ in range(3))
        template, name, item = rng.choice(QUESTIONS_2[first, second]), rng.choice(NAMES), rng.choice(ITEMS)
        middle = a + b if first == "add" else a - b
        answer = middle + c if second == "add" else middle - c
        held_out = random.Random(f"{seed}:{sorted((a, b, c))}").random() < test_share
        question = template.format(name=name, item=item, a=a, b=b, c=c)
        if middle <= 0 or answer <= 0 or held_out != test or question in seen:
            misses += 1
            continue
        seen.add(question)
        out.append((question, answer))
    return out


def _problems(pairs, ops: Sequence[str], rng: random.Random, count: int):
    """``count`` distinct (question, answer) pairs drawn from the operand pairs (either order for
    a sum; larger first for a difference), or every one there is when fewer exist."""
    space = []
    for (a, b), op in itertools.product(pairs, ops):
        orders = {(a, b), (b, a)} if op == "add" else {(b, a)}
        for x, y in sorted(orders):
            if op == "sub" and x == y:
                continue
            for template, name, item in itertools.product(QUESTIONS[op], NAMES, ITEMS):
                space.append(_question(template, name, item, x, y, op))
    rng.shuffle(space)
    return space[:count]


def generate(train_count: int, test_count: int, *, ops: Sequence[str] = ("add",), min_operand: int = 2,
             max_operand: int = 9, test_share: float = 0.25, seed: int = 0,
             steps: int = 1) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows); test questions share no operand pair (two steps: triple) with
    training ones."""
    bad = [op for op in ops if op not in OPS]
    if bad or not ops:
        raise ValueError(f"ops {list(ops)}: choose from {list(OPS)}")
    if not 0 <= min_operand < max_operand:
        raise ValueError(f"operands {min_operand}..{max_operand}: need 0 <= min < max")
    if steps not in (1, 2):
        raise ValueError(f"steps {steps}: choose 1 or 2")
    values = max_operand - min_operand + 1
    per_pair = len(ops) * max(map(len, QUESTIONS.values())) * len(NAMES) * len(ITEMS)  # per ordered pair, at most
    enumerate_all = steps == 1 and values * values * per_pair <= ENUMERATE_LIMIT
    if enumerate_all:
        train_pairs, test_pairs = split_pairs(min_operand, max_operand, test_share, seed)
    rng = random.Random(seed + 1)
    out = []
    for split, count in (("train", train_count), ("test", test_count)):
        if enumerate_all:
            problems = _problems(train_pairs if split == "train" else test_pairs, ops, rng, count)
        elif steps == 2:
            problems = _sample_two_step(min_operand, max_operand, ops, split == "test", seed, test_share, rng, count)
        else:
            problems = _sample(min_operand, max_operand, ops, split == "test", seed, test_share, rng, count)
        out.append([{"data_source": DATA_SOURCE, "prompt": messages(q, steps), "ability": "math",
                     "reward_model": {"ground_truth": str(answer), "style": "rule"},
                     "extra_info": {"index": i, "split": split, "question": q}}
                    for i, (q, answer) in enumerate(problems)])
    return out[0], out[1]


def write_parquet(rows: Sequence[dict], out: str | Path) -> Path:
    return generated.write_parquet(rows, out, SCHEMA)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m arlopti_jax.tasks.arith", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    generated.add_split_arguments(parser, "operand pairs")
    parser.add_argument("--ops", default="add", help="comma-separated: add, sub")
    parser.add_argument("--min-operand", type=int, default=2)
    parser.add_argument("--max-operand", type=int, default=9)
    parser.add_argument("--steps", type=int, default=1, help="operations per question: 1 (a + b) or 2 (a + b - c)")
    args = parser.parse_args(argv)
    generated.check_split_arguments(parser, args)
    try:
        train, test = generate(args.train_count, args.test_count, ops=args.ops.split(","),
                               min_operand=args.min_operand, max_operand=args.max_operand,
                               test_share=args.test_share, seed=args.seed, steps=args.steps)
    except ValueError as err:
        parser.error(str(err))
    generated.write_splits(train, test, args.out, SCHEMA)
    return 0


if __name__ == "__main__":
    sys.exit(main())
