"""The calc problems: large operands of the asked digits, held out by operand set, answers checked by
the calculator from the expression text, graded by the math reward under data source 'calc'."""

import random
import re
import subprocess
import sys
from fractions import Fraction

import pyarrow.parquet as pq
import pytest

from arlopti_jax.tasks import calc, compute_score
from arlopti_jax.tasks.tools.calculator import evaluate


def test_rows_hold_out_operand_sets_and_answer_right():
    train, test = calc.generate(600, 150, min_digits=4, max_digits=7, terms=4, seed=3)
    assert len(train) == 600 and len(test) == 150
    sets = {}
    kinds, digit_counts = set(), set()
    for split, rows in (("train", train), ("test", test)):
        sets[split] = set()
        for row in rows:
            info = row["extra_info"]
            operands = [int(n) for n in re.findall(r"\d+", info["expression"])]
            sets[split].add(tuple(sorted(operands)))
            digit_counts |= {len(str(n)) for n in operands}
            assert len(operands) == {"mul": 2, "sum": 4, "mixed": 3}[info["kind"]]
            # the answer, read independently of the generator: the calculator on the expression's text
            assert Fraction(row["reward_model"]["ground_truth"]) == evaluate(info["expression"])
            assert info["expression"] in info["question"] and row["prompt"][-1]["content"] == info["question"]
            assert row["data_source"] == "calc" and info["split"] == split
            kinds.add(info["kind"])
    assert not sets["train"] & sets["test"]  # no test operand multiset is trained on, in any order
    assert kinds == set(calc.KINDS) and digit_counts == {4, 5, 6, 7}
    assert len({r["extra_info"]["expression"] for r in train + test}) == 750
    assert calc.generate(20, 5, seed=1) == calc.generate(20, 5, seed=1)
    only_mul, _ = calc.generate(50, 5, kinds=("mul",), seed=2)
    assert {r["extra_info"]["kind"] for r in only_mul} == {"mul"}
    for bad, message in (({"kinds": ("div",)}, "kinds ['div']"), ({"min_digits": 0}, "digits 0..6"),
                         ({"terms": 1}, "terms 1")):
        with pytest.raises(ValueError, match=re.escape(message)):
            calc.generate(1, 1, **bad)


def test_the_registry_grades_calc_with_the_integer_reward():
    [row], _ = calc.generate(1, 1, seed=0)
    truth = row["reward_model"]["ground_truth"]
    prompt = "<|im_start|>user\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"
    assert compute_score("calc", prompt + f"It is \\boxed{{{truth}}}.", truth) == 1.0
    assert compute_score("calc", prompt + f"It is \\boxed{{{int(truth) + 1}}}.", truth) == 0.0
    assert row["prompt"][2]["content"].endswith("\\boxed{413}.")


@pytest.mark.parametrize("source", ["calc", "arith"])
def test_an_expression_equal_to_the_answer_is_no_answer(source):
    """The answers GRPO learned on calc (seed 1, 2026-12-07: the question restated in the box, which
    math-verify called equal) score 0; an integer written out scores 1 exactly when it is the value,
    checked against Python's integers on random problems, with signs, spaces and thousands commas."""
    rng = random.Random(0)
    for restated, value in (("79680 * 8001", 637519680), ("572755 + 2150 + 286981", 861886),
                            ("2273 * (35976 + 3570)", 89888058), ("7692 * 8643 - 598771", 65883185)):
        assert compute_score(source, f"\\boxed{{{restated}}}", str(value)) == 0.0
        assert compute_score(source, f"\\boxed{{{value}}}", str(value)) == 1.0
    for _ in range(300):
        value = rng.randint(-10**9, 10**9)
        guess = value + rng.choice([0, 0, 1, -1, 10, rng.randint(-10**6, 10**6)])
        written = rng.choice([str(guess), f"{guess:,}", f" {guess} ", f"{guess}.0", f"{guess}/1", f"+{guess}"])
        plain = re.fullmatch(r" ?-?\d+ ?|-?\d{1,3}(,\d{3})*", written) is not None
        want = 1.0 if plain and guess == value else 0.0
        assert compute_score(source, f"So \\boxed{{{written}}}.", str(value)) == want, (written, value)
    assert compute_score(source, "\\boxed{1,23}", "123") == 0.0  # a comma that groups no thousands
    assert compute_score(source, "\\boxed{}", "0") == 0.0


def test_command_writes_both_splits_and_rejects_bad_options(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "arlopti_jax.tasks.calc", "--out", str(tmp_path), "--train-count",
                           "40", "--test-count", "8", "--kinds", "mul,sum"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rows = pq.read_table(tmp_path / "test.parquet").to_pylist()
    assert len(rows) == 8 and len(pq.read_table(tmp_path / "train.parquet")) == 40
    assert {r["extra_info"]["kind"] for r in rows} <= {"mul", "sum"}
    proc = subprocess.run([sys.executable, "-m", "arlopti_jax.tasks.calc", "--out", str(tmp_path), "--kinds", "pow"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "kinds ['pow']: choose from ['mul', 'sum', 'mixed']" in proc.stderr
