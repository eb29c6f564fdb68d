"""Arithmetic on large operands, for the ``calc`` tool environment (and its no-tool baseline).

    python -m arlopti_jax.tasks.calc --out data/calc                    # train.parquet, test.parquet
    python -m arlopti_jax.tasks.calc --out data/calc --kinds mul --min-digits 5 --max-digits 7

Questions a small model cannot do in its head but can with a calculator, of three kinds:

    mul    a * b                           two operands
    sum    a + b + c (+ ...)               ``--terms`` operands
    mixed  a * b + c, a * b - c, (a + b) * c, a * (b + c), (a - b) * c     three operands

every operand with ``--min-digits`` to ``--max-digits`` digits (default 4 to 6), each digit count
equally likely. The rows mirror `tasks.arith`'s: ``prompt`` the chat (a one-line system message,
one worked example ending in ``\\boxed{413}``, the question), ``reward_model.ground_truth`` the
exact integer, data source ``calc``, which the reward registry grades with the math reward, so the
environment and a single-turn run without the tool score answers alike. ``extra_info`` keeps the
question, the expression (as the calculator reads it) and the kind.

Held out by operands, like arith's sampled path: a question's operands, as an unordered multiset,
are a test set's with probability ``--test-share`` by a seeded hash, so no test question's numbers,
in any order, appear together in a training question.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa

from arlopti_jax.tasks import generated

DATA_SOURCE = "calc"
KINDS = ("mul", "sum", "mixed")
SYSTEM = "You are a helpful assistant."
EXAMPLE = ("What is 12 * 34 + 5?", "12 * 34 + 5 = 408 + 5 = 413. The answer is \\boxed{413}.")
PHRASES = ("What is {e}?", "Compute {e}.", "Calculate {e}.", "Work out {e}.")
MIXED = ("{0} * {1} + {2}", "{0} * {1} - {2}", "({0} + {1}) * {2}", "{0} * ({1} + {2})", "({0} - {1}) * {2}")

_STR = pa.string()
SCHEMA = pa.schema([
    ("data_source", _STR),
    ("prompt", pa.list_(pa.struct([("content", _STR), ("role", _STR)]))),
    ("ability", _STR),
    ("reward_model", pa.struct([("ground_truth", _STR), ("style", _STR)])),
    ("extra_info", pa.struct([("index", pa.int64()), ("split", _STR), ("question", _STR), ("expression", _STR),
                              ("kind", _STR)])),
])  # fmt: skip


def messages(question: str) -> list[dict[str, str]]:
    """The ``prompt`` column of one question: system line, the worked example, the question."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": EXAMPLE[0]},
            {"role": "assistant", "content": EXAMPLE[1]}, {"role": "user", "content": question}]


def _value(kind: str, template: str, operands: Sequence[int]) -> int:
    """The expression's value, computed from the operands (not by reading the expression)."""
    if kind == "mul":
        return operands[0] * operands[1]
    if kind == "sum":
        return sum(operands)
    a, b, c = operands
    return {MIXED[0]: a * b + c, MIXED[1]: a * b - c, MIXED[2]: (a + b) * c, MIXED[3]: a * (b + c),
            MIXED[4]: (a - b) * c}[template]


def held_out(operands: Sequence[int], seed: int, test_share: float) -> bool:
    """Whether the operands' unordered multiset is a test one."""
    return random.Random(f"{seed}:{sorted(operands)}").random() < test_share


def _operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


def _sample(kinds: Sequence[str], test: bool, *, min_digits: int, max_digits: int, terms: int, seed: int,
            test_share: float, rng: random.Random, count: int) -> list[tuple[str, str, str, int]]:
    """``count`` distinct (question, expression, kind, answer) of one split; repeats and the other
    split's operand sets are drawn again (stops short only after many rejections in a row)."""
    seen, out, misses = set(), [], 0
    while len(out) < count and misses < 50 + 20 * count:
        kind = rng.choice(list(kinds))
        n = 2 if kind == "mul" else terms if kind == "sum" else 3
        operands = [_operand(rng, min_digits, max_digits) for _ in range(n)]
        template = {"mul": "{0} * {1}", "sum": " + ".join(f"{{{i}}}" for i in range(n))}.get(kind) or rng.choice(MIXED)
        expression = template.format(*operands)
        question = rng.choice(PHRASES).format(e=expression)
        if held_out(operands, seed, test_share) != test or expression in seen:
            misses += 1
            continue
        seen.add(expression)
        out.append((question, expression, kind, _value(kind, template, operands)))
    return out


def generate(train_count: int, test_count: int, *, kinds: Sequence[str] = KINDS, min_digits: int = 4,
             max_digits: int = 6, terms: int = 3, test_share: float = 0.25, seed: int = 0) -> tuple[list, list]:
    """(train rows, test rows); no test question's operands, as a multiset, are a training question's."""
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"kinds {list(kinds)}: choose from {list(KINDS)}")
    if not 1 <= min_digits <= max_digits <= 30:
        raise ValueError(f"digits {min_digits}..{max_digits}: need 1 <= min <= max <= 30")
    if not 2 <= terms <= 10:
        raise ValueError(f"terms {terms}: need 2 to 10")
    rng = random.Random(seed + 1)
    out = []
    for split, count in (("train", train_count), ("test", test_count)):
        problems = _sample(kinds, split == "test", min_digits=min_digits, max_digits=max_digits, terms=terms,
                           seed=seed, test_share=test_share, rng=rng, count=count)
        out.append([{"data_source": DATA_SOURCE, "prompt": messages(q), "ability": "math",
                     "reward_model": {"ground_truth": str(answer), "style": "rule"},
                     "extra_info": {"index": i, "split": split, "question": q, "expression": e, "kind": k}}
                    for i, (q, e, k, answer) in enumerate(problems)])
    return out[0], out[1]


def write_parquet(rows: Sequence[dict], out: str | Path) -> Path:
    return generated.write_parquet(rows, out, SCHEMA)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m arlopti_jax.tasks.calc", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    generated.add_split_arguments(parser, "operand sets")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: mul, sum, mixed")
    parser.add_argument("--min-digits", type=int, default=4)
    parser.add_argument("--max-digits", type=int, default=6)
    parser.add_argument("--terms", type=int, default=3, help="operands of a sum")
    args = parser.parse_args(argv)
    generated.check_split_arguments(parser, args)
    try:
        train, test = generate(args.train_count, args.test_count, kinds=args.kinds.split(","),
                               min_digits=args.min_digits, max_digits=args.max_digits, terms=args.terms,
                               test_share=args.test_share, seed=args.seed)
    except ValueError as err:
        parser.error(str(err))
    if len(train) < args.train_count or len(test) < args.test_count:
        parser.error(f"only {len(train)} training and {len(test)} test problems exist with these settings")
    generated.write_splits(train, test, args.out, SCHEMA)
    return 0


if __name__ == "__main__":
    sys.exit(main())
