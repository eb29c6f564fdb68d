"""The calc problems: large operands of the asked digits, held out by operand set, answers checked by
the calculator from the expression text, graded by the math reward under data source 'calc'."""

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


def test_the_registry_grades_calc_with_the_math_reward():
    [row], _ = calc.generate(1, 1, seed=0)
    truth = row["reward_model"]["ground_truth"]
    prompt = "<|im_start|>user\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"
    assert compute_score("calc", prompt + f"It is \\boxed{{{truth}}}.", truth) == 1.0
    assert compute_score("calc", prompt + f"It is \\boxed{{{int(truth) + 1}}}.", truth) == 0.0
    assert row["prompt"][2]["content"].endswith("\\boxed{413}.")


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
