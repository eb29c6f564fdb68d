"""K&K puzzles: solver and text forms against the public data, generator, CLI, reward table."""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from task_fixtures import SHARED_DATA, requires_shared_data, tiny_tokenizer

from arlopti_jax.tasks import kk, kk_puzzles
from arlopti_jax.tasks.data import PromptDataset
from arlopti_jax.tasks.kk_reward import compute_kk_score, kk_outcome

KK_FILES = [f"kk/{n}ppl/{split}.parquet" for n in range(3, 8) for split in ("train", "test")]


def _read(rel: str) -> dict:
    return pq.read_table(SHARED_DATA / rel).to_pydict()


# ---------------------------------------------------------------- against the public data
@requires_shared_data
@pytest.mark.parametrize("rel", KK_FILES)
def test_solver_and_text_reproduce_public_file(rel):
    d = _read(rel)
    for i, text in enumerate(d["statements"]):
        statements = kk_puzzles.parse_statements(text)
        names = d["names"][i]
        assert repr(statements) == text
        assert kk_puzzles.solve(statements) == [tuple(d["solution"][i])], (rel, i)
        assert kk_puzzles.cot_steps(statements, names) == d["cot_repeat_steps"][i], (rel, i)
        assert kk_puzzles.solution_text(names, d["solution"][i]) == d["solution_text"][i]
        answer = kk_puzzles.solution_text_format(names, d["solution"][i])
        assert answer == d["solution_text_format"][i]
        assert d["reward_model"][i]["ground_truth"] == {"solution_text_format": answer, "statements": text}
        templates = _match_templates(d["quiz"][i], statements, names)
        assert kk_puzzles.render_quiz(statements, names, templates) == d["quiz"][i]
        assert d["prompt"][i] == kk.prompt_messages(d["quiz"][i], "template")
        assert d["data_source"][i] == kk.DATA_SOURCE
        assert d["cot_head"][i] == kk_puzzles.COT_HEAD and d["cot_foot"][i] == kk_puzzles.COT_FOOT
        assert d["knight_knave"][i] == kk_puzzles.KNIGHT_KNAVE


def _match_templates(quiz, statements, names):
    """Which speech template each speaker's sentence uses (greedy, left to right)."""
    prefix = f"{kk_puzzles.QUIZ_INTRO}You meet {len(names)} inhabitants: {kk_puzzles.join_names(names)}."
    chosen = []
    for i, s in enumerate(statements):
        claim = kk_puzzles.render_claim(s, names)
        for t, template in enumerate(kk_puzzles.SPEECH_TEMPLATES):
            candidate = prefix + " " + template.format(n=names[i], c=claim)
            if quiz.startswith(candidate + " "):
                chosen.append(t)
                prefix = candidate
                break
        else:
            raise AssertionError(f"no template matches speaker {i} of {quiz!r}")
    return chosen


@requires_shared_data
def test_public_schema_equals_ours():
    for rel in KK_FILES:
        schema = pq.read_schema(SHARED_DATA / rel).remove_metadata()
        assert schema.equals(kk.KK_SCHEMA), rel


# ---------------------------------------------------------------- generator
def _brute_force(statements, n):
    """Consistent assignments by plain enumeration, with a separate evaluator."""

    def truth(s, a):
        op = s[0]
        if op == "telling-truth":
            return a[s[1]]
        if op == "lying":
            return not a[s[1]]
        if op == "not":
            return not truth(s[1], a)
        x, y = truth(s[1], a), truth(s[2], a)
        return {"and": x and y, "or": x or y, "->": (not x) or y, "<=>": x == y}[op]

    return [a for a in itertools.product([False, True], repeat=n)
            if all(truth(s, a) == a[i] for i, s in enumerate(statements))]  # fmt: skip


@pytest.mark.parametrize("n", range(2, 9))
def test_generated_puzzles_have_unique_solutions(n):
    puzzles = kk_puzzles.generate_puzzles(n, 25, seed=1)
    assert len({p.quiz for p in puzzles}) == 25
    for p in puzzles:
        parsed = kk_puzzles.parse_statements(repr(p.statements))  # grammar check
        assert len(parsed) == n == len(p.names) == len(set(p.names))
        assert _brute_force(p.statements, n) == [p.solution]
        assert p.cot()  # the worked solution reaches the answer


def test_generator_uses_every_operator():
    ops = set()
    for p in kk_puzzles.generate_puzzles(4, 60, seed=0):
        for s in p.statements:
            ops.add(s[0])
            ops.update(sub[0] for sub in s[1:] if isinstance(sub, tuple))
    assert ops == {"telling-truth", "lying", "not", "and", "or", "->", "<=>"}


def test_generation_is_deterministic():
    a = kk.generate_rows(5, 20, seed=3)
    assert a == kk.generate_rows(5, 20, seed=3)
    assert a != kk.generate_rows(5, 20, seed=4)


@pytest.mark.parametrize("n", [1, 9])
def test_people_out_of_range(n):
    with pytest.raises(ValueError, match="n_people"):
        kk_puzzles.generate_puzzles(n, 1, seed=0)


@pytest.mark.parametrize("style", ["template", "messages"])
def test_generated_file_loads_like_public_data(tmp_path, style):
    rows = kk.generate_rows(3, 12, seed=0, prompt_style=style)
    path = kk.write_parquet(rows, tmp_path / "kk3.parquet")
    assert pq.read_schema(path).remove_metadata().equals(kk.KK_SCHEMA)
    ds = PromptDataset(path, tiny_tokenizer(), max_prompt_length=100_000)
    assert len(ds) == 12
    for row, item in zip(rows, ds):
        assert item["data_source"] == "kk_logic"
        assert item["ground_truth"] == row["reward_model"]["ground_truth"]
        assert row["quiz"] in item["prompt_text"]
        if style == "template":
            assert item["prompt_text"] == row["prompt"][0]["content"]
            assert item["prompt_text"].endswith("<|im_start|>assistant\n<think>")
        else:
            assert item["prompt_text"].startswith("<|im_start|>user\n")
            assert item["prompt_text"].endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("style", ["template", "messages"])
def test_worked_solutions_score_full_marks(style):
    tok = tiny_tokenizer()
    for ex in kk.sft_examples(4, 10, seed=0, prompt_style=style):
        prompt = tok.apply_chat_template(ex["prompt"], tokenize=False, add_generation_prompt=True)
        if style == "template":
            prompt = ex["prompt"][0]["content"]
        assert ex["response"].endswith("</answer>")
        assert compute_kk_score(prompt + ex["response"], ex["reward_model"]["ground_truth"]) == 3.0


def test_cli_generate(tmp_path):
    out = tmp_path / "cli.parquet"
    subprocess.run(
        [sys.executable, "-m", "arlopti_jax.tasks.kk", "generate", "--people", "3", "--count", "5",
         "--seed", "0", "--out", str(out), "--prompt-style", "messages"],
        check=True, capture_output=True,
    )  # fmt: skip
    table = pq.read_table(out).to_pylist()
    assert [r["quiz"] for r in table] == [r["quiz"] for r in kk.generate_rows(3, 5, 0)]
    assert table[0]["prompt"][0]["role"] == "user"
    assert "<|im_start|>" not in table[0]["prompt"][0]["content"]
    assert kk.main(["sft", "--people", "2", "--count", "3", "--out", str(tmp_path / "s.jsonl")]) == 0
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 3


# ---------------------------------------------------------------- reward table
GT = {
    "solution_text_format": "(1) Michael is a knight\n(2) Zoey is a knave\n(3) Ethan is a knight",
    "statements": "(('telling-truth', 2), ('lying', 0), ('not', ('lying', 1)))",
}
PROMPT = kk.prompt_messages("You meet 3 inhabitants: Michael, Zoey, and Ethan. ...")[0]["content"]
RIGHT = "(1) Michael is a knight\n(2) Zoey is a knave\n(3) Ethan is a knight"
END = "<|im_end|>"

REWARD_TABLE = [
    # (case, solution_str, expected score)
    ("correct", f"{PROMPT} So.</think>\n<answer>{RIGHT}</answer>{END}", 3.0),
    ("correct, unnumbered, reordered, lower case",
     f"{PROMPT}x</think><answer>ethan is a knight, zoey is a knave, michael is a knight</answer>", 3.0),
    ("correct, response only (no assistant marker)", f"x</think>\n<answer>{RIGHT}</answer>", 3.0),
    ("correct, chat-template prompt, response opens <think>",
     f"<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>x</think><answer>{RIGHT}</answer>", 3.0),
    ("correct, last assistant turn counts",
     f"<|im_start|>assistant\n<answer>old</answer><|im_end|>\n{PROMPT}x</think><answer>{RIGHT}</answer>", 3.0),
    ("wrong: one role flipped",
     f"{PROMPT}x</think>\n<answer>(1) Michael is a knight\n(2) Zoey is a knight\n(3) Ethan is a knight</answer>", -0.5),
    ("wrong: all flipped",
     f"{PROMPT}x</think><answer>(1) Michael is a knave\n(2) Zoey is a knight\n(3) Ethan is a knave</answer>", -0.5),
    ("unparseable: a person missing",
     f"{PROMPT}x</think><answer>(1) Michael is a knight\n(2) Zoey is a knave</answer>", -1.0),
    ("unparseable: extra knight/knave mention",
     f"{PROMPT}x</think><answer>{RIGHT}\n(4) so Zoey is not a knight</answer>", -1.0),
    ("unparseable: empty answer", f"{PROMPT}x</think><answer>  </answer>", -1.0),
    ("unparseable: prose", f"{PROMPT}x</think><answer>Michael and Ethan are honest.</answer>", -1.0),
    ("format: missing </think>", f"{PROMPT}x\n<answer>{RIGHT}</answer>", -3.0),
    ("format: duplicate <think> (prompt already opened it)", f"{PROMPT}<think>x</think><answer>{RIGHT}</answer>", -3.0),
    ("format: response-only string opening <think> again", f"<think>x</think><answer>{RIGHT}</answer>", -3.0),
    ("format: chat-template prompt, response lacks <think>",
     f"<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nx</think><answer>{RIGHT}</answer>", -3.0),
    ("format: reordered, answer before </think>", f"{PROMPT}x<answer>{RIGHT}</answer></think>", -3.0),
    ("format: reordered, </answer> before <answer>", f"{PROMPT}x</think></answer>{RIGHT}<answer>", -3.0),
    ("format: extra </think>", f"{PROMPT}x</think>y</think><answer>{RIGHT}</answer>", -3.0),
    ("format: extra </answer>", f"{PROMPT}x</think><answer>{RIGHT}</answer></answer>", -3.0),
    ("format: two answer blocks", f"{PROMPT}x</think><answer>{RIGHT}</answer><answer>{RIGHT}</answer>", -3.0),
    ("format: missing <answer>", f"{PROMPT}x</think>\n{RIGHT}</answer>", -3.0),
    ("format: missing answer tags entirely", f"{PROMPT}x</think>\n{RIGHT}", -3.0),
    ("format: truncated, no </answer>", f"{PROMPT}x</think><answer>{RIGHT}", -3.0),
    ("format: empty response", PROMPT, -3.0),
]  # fmt: skip


@pytest.mark.parametrize("case,solution_str,expected", REWARD_TABLE, ids=[c[0] for c in REWARD_TABLE])
def test_kk_reward_table(case, solution_str, expected):
    assert compute_kk_score(solution_str, GT) == expected


def test_kk_reward_details():
    out = kk_outcome(f"{PROMPT}x</think><answer>{RIGHT}</answer>", GT)
    assert out.format_ok and out.correct and out.parsed == {"Michael": "knight", "Zoey": "knave", "Ethan": "knight"}
    # The ground truth may also be the answer text itself.
    assert compute_kk_score(f"x</think><answer>{RIGHT}</answer>", GT["solution_text_format"]) == 3.0
    with pytest.raises(ValueError, match="solution_text_format"):
        compute_kk_score("x", {"statements": "()"})
    assert ast.literal_eval(GT["statements"])  # the fixture is a valid literal
