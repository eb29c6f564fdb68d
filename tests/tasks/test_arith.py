"""The arithmetic word problems: held out by operand pair, right answers, graded by the math
reward, and the pretrained sweep scale's start point."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from arlopti_jax.tasks import arith, compute_score


def operands(question: str) -> tuple[int, int, str]:
    a, b = map(int, re.findall(r"\d+", question))
    return a, b, "sub" if ("gives away" in question or "lost" in question) else "add"


@pytest.mark.parametrize("ops", [("add",), ("add", "sub")])
def test_rows_hold_out_operand_pairs_and_answer_right(ops):
    train, test = arith.generate(500, 100, ops=ops, min_operand=2, max_operand=12, seed=3)
    assert len(train) == 500 and len(test) == 100
    pairs = {split: {frozenset(operands(r["extra_info"]["question"])[:2]) for r in rows}
             for split, rows in (("train", train), ("test", test))}
    assert not pairs["train"] & pairs["test"]  # no test operand pair, in either order, is trained on
    kinds = set()
    for row in train + test:
        a, b, op = operands(row["extra_info"]["question"])
        kinds.add(op)
        assert row["reward_model"]["ground_truth"] == str(a + b if op == "add" else a - b)
        assert a - b > 0 or op == "add"
        assert row["prompt"][-1] == {"role": "user", "content": row["extra_info"]["question"]}
        assert row["prompt"][2]["content"].endswith("\\boxed{7}.")  # the worked example shows the format
    assert kinds == set(ops)
    assert len({r["extra_info"]["question"] for r in train}) == 500  # distinct questions


def test_the_math_reward_grades_the_boxed_answer():
    [row], _ = arith.generate(1, 1, seed=0)
    truth = row["reward_model"]["ground_truth"]
    assert row["data_source"] == "arith"
    prompt = "<|im_start|>user\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"
    assert compute_score("arith", prompt + f"It is \\boxed{{{truth}}}.", truth) == 1.0
    assert compute_score("arith", prompt + f"It is \\boxed{{{int(truth) + 1}}}.", truth) == 0.0
    assert compute_score("arith", prompt + f"It is {truth}.", truth) == 0.0  # no boxed answer


def test_command_writes_both_splits_and_rejects_bad_options(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "arlopti_jax.tasks.arith", "--out", str(tmp_path), "--train-count",
                           "50", "--test-count", "10", "--ops", "add,sub"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rows = pq.read_table(tmp_path / "test.parquet").to_pylist()
    assert len(rows) == 10 and len(pq.read_table(tmp_path / "train.parquet")) == 50
    assert json.loads(json.dumps(rows[0]["prompt"]))[0]["role"] == "system"
    proc = subprocess.run([sys.executable, "-m", "arlopti_jax.tasks.arith", "--out", str(tmp_path), "--ops", "mul"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "ops ['mul']: choose from ['add', 'sub']" in proc.stderr


def test_pretrained_sweep_scale_reads_its_config_and_refuses_another_start_point(tmp_path):
    from arlopti_jax.embedded.start_point import SCALE_FILE, StartPointMismatch
    from arlopti_jax.experiments.sweep import base_config, pretrained_start_point

    c = base_config("smollm2")
    assert c.model.path == "models/smollm2-135m" and c.data.train_files == "data/arith/train.parquet"
    folder = tmp_path / "start_point"
    (folder / "model").mkdir(parents=True)
    (folder / SCALE_FILE).write_text(json.dumps({"scale": "cpu"}))
    with pytest.raises(StartPointMismatch, match="scale 'cpu', not 'smollm2'"):
        pretrained_start_point(folder, "smollm2")


def test_large_operand_ranges_are_sampled_without_building_every_question(monkeypatch):
    """--max-operand 1000 with both operations has 240 million possible questions: rows are drawn,
    never enumerated, with the same guarantees (held-out pairs, distinct questions, right answers,
    both operations, a sum in either order, a difference larger first)."""
    def enumerate_everything(*args, **kwargs):
        raise AssertionError("the sampled path built the question space")

    monkeypatch.setattr(arith, "split_pairs", enumerate_everything)
    monkeypatch.setattr(arith, "_problems", enumerate_everything)
    train, test = arith.generate(3000, 300, ops=("add", "sub"), max_operand=1000, seed=4)
    assert len(train) == 3000 and len(test) == 300
    pairs = {split: {frozenset(operands(r["extra_info"]["question"])[:2]) for r in rows}
             for split, rows in (("train", train), ("test", test))}
    assert not pairs["train"] & pairs["test"]
    assert len({r["extra_info"]["question"] for r in train + test}) == 3300
    seen = {op: [] for op in ("add", "sub")}
    for row in train + test:
        a, b, op = operands(row["extra_info"]["question"])
        seen[op].append((a, b))
        assert row["reward_model"]["ground_truth"] == str(a + b if op == "add" else a - b) and 2 <= min(a, b)
    # every question equally likely: a sum has twice the orderings a difference has
    assert all(a > b for a, b in seen["sub"]) and 0.6 < len(seen["add"]) / 3300 < 0.73
    assert 0.4 < sum(a < b for a, b in seen["add"]) / len(seen["add"]) < 0.6  # either order
    assert max(max(p) for p in seen["add"]) > 900  # the whole range, not its start
    assert arith.generate(50, 5, max_operand=1000, seed=4) == arith.generate(50, 5, max_operand=1000, seed=4)


def two_step(question: str) -> tuple[list[int], tuple[bool, ...], int]:
    """(operands, whether each later one is taken away, answer) read from the question's words: a
    number right after "away" or "lost" is taken away, any other is added."""
    tokens = question.replace(",", "").replace(".", "").split()
    numbers = [(int(t), tokens[i - 1]) for i, t in enumerate(tokens) if t.isdigit()]
    taken = tuple(before in ("away", "lost") for _, before in numbers[1:])
    total = numbers[0][0] + sum(-v if away else v for (v, _), away in zip(numbers[1:], taken))
    return [n for n, _ in numbers], taken, total


def test_two_step_problems_chain_both_operations_hold_out_operand_triples_and_answer_right():
    train, test = arith.generate(1500, 200, ops=("add", "sub"), min_operand=2, max_operand=12, seed=7, steps=2)
    assert len(train) == 1500 and len(test) == 200
    triples = {split: {tuple(sorted(two_step(r["extra_info"]["question"])[0])) for r in rows}
               for split, rows in (("train", train), ("test", test))}
    assert not triples["train"] & triples["test"]  # no test triple of numbers, in any order, is trained on
    signs = set()
    for row in train + test:
        question = row["extra_info"]["question"]
        numbers, taken, answer = two_step(question)
        assert len(numbers) == 3 and all(2 <= n <= 12 for n in numbers)
        assert row["reward_model"]["ground_truth"] == str(answer) and answer > 0
        assert not taken[0] or numbers[0] > numbers[1]  # every count along the way positive
        signs.add(taken)
        assert row["prompt"][2]["content"] == "3 + 4 = 7. 7 - 2 = 5. The answer is \\boxed{5}."
    assert signs == {(False, False), (False, True), (True, False), (True, True)}  # all four chains
    assert len({r["extra_info"]["question"] for r in train + test}) == 1700
    only_add, _ = arith.generate(200, 10, ops=("add",), steps=2, seed=7)
    assert all(two_step(r["extra_info"]["question"])[1] == (False, False) for r in only_add)
    with pytest.raises(ValueError, match="steps 3: choose 1 or 2"):
        arith.generate(1, 1, steps=3)


def test_the_harder_sweep_scale_writes_its_own_task(tmp_path, monkeypatch):
    """--scale smollm2-addsub20: its config reads the harder task's files, and its start point holds
    that task's problems (addition and subtraction, operands 2-20), not the one-step default's."""
    from arlopti_jax.experiments import sweep
    from arlopti_jax.models import gguf

    assert sweep.base_config("smollm2-addsub20").data.train_files == "data/arith_addsub20/train.parquet"
    monkeypatch.setattr(gguf, "package_gguf", lambda package: tmp_path / "unused.gguf")
    monkeypatch.setattr(gguf, "convert", lambda gguf_path, out: Path(out).mkdir(parents=True))  # the data alone
    folder = sweep.pretrained_start_point(tmp_path / "start_point", "smollm2-addsub20")
    rows = pq.read_table(folder / "data" / "train.parquet").to_pylist()
    found = [operands(r["extra_info"]["question"]) for r in rows]
    assert {op for *_, op in found} == {"add", "sub"} and max(max(a, b) for a, b, _ in found) == 20
    assert all(r["reward_model"]["ground_truth"] == str(a + b if op == "add" else a - b)
               for r, (a, b, op) in zip(rows, found))
    assert len(rows) == 2000 and len(pq.read_table(folder / "data" / "test_arith.parquet")) == 128
