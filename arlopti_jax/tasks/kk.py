"""Knights-and-Knaves data: rows in the public data's schema, parquet files, a CLI.

    python -m arlopti_jax.tasks.kk generate --people 3 --count 1000 --seed 0 \\
        --out kk3.parquet [--prompt-style template|messages] [--split train]
    python -m arlopti_jax.tasks.kk sft --people 3 --count 1000 --seed 0 \\
        --out kk3_sft.jsonl [--prompt-style template|messages]

Prompt styles:
  template  `prompt` is one message whose content already holds the Qwen chat
            template (system + user + '<|im_start|>assistant\\n<think>'), exactly as in
            the public data; it is tokenized as-is.
  messages  `prompt` is a plain user message [{'role': 'user', 'content': ...}]; the
            tokenizer's chat template is applied at load time.

Python API: `generate_puzzles` (kk_puzzles), `puzzle_row`, `generate_rows`,
`write_parquet`, `sft_examples`; the reward is in kk_reward.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa

from arlopti_jax.tasks import generated
from arlopti_jax.tasks.kk_puzzles import (
    COT_FOOT,
    COT_HEAD,
    KNIGHT_KNAVE,
    MAX_PEOPLE,
    MIN_PEOPLE,
    Puzzle,
    generate_puzzles,
    solution_text,
    worked_solution,
)

DATA_SOURCE = "kk_logic"  # the public data's value; the reward router matches kk_logic*
PROMPT_STYLES = ("template", "messages")

SYSTEM_PROMPT = (
    "You are a helpful assistant. The assistant first thinks about the reasoning process in "
    "the mind and then provides the user with the answer. The reasoning process and answer "
    "are enclosed within <think> </think> and<answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think><answer> answer here </answer>.  Now the user "
    "asks you to solve a logical reasoning problem. After thinking, when you finally reach a "
    "conclusion, clearly state the identity of each character within <answer> </answer> "
    "tags. i.e., <answer> (1) Zoey is a knight\n(2) ... </answer>.\n"
)

_STR = pa.string()
KK_SCHEMA = pa.schema([
    ("quiz", _STR),
    ("names", pa.list_(_STR)),
    ("knight_knave", pa.struct([(k, _STR) for k in sorted(KNIGHT_KNAVE)])),
    ("solution", pa.list_(pa.bool_())),
    ("solution_text", _STR),
    ("solution_text_format", _STR),
    ("cot_head", _STR),
    ("cot_repeat_steps", pa.list_(_STR)),
    ("cot_foot", _STR),
    ("statements", _STR),
    ("index", pa.int64()),
    ("data_source", _STR),
    ("prompt", pa.list_(pa.struct([("content", _STR), ("role", _STR)]))),
    ("ability", _STR),
    ("reward_model", pa.struct([
        ("ground_truth", pa.struct([("solution_text_format", _STR), ("statements", _STR)])),
        ("style", _STR),
    ])),
    ("extra_info", pa.struct([("index", pa.int64()), ("split", _STR)])),
])  # fmt: skip


def guess_accuracy(data_source: str) -> float | None:
    """Accuracy of a uniform random guess of every role for a ``kk_logic<n>`` row (2^-n: each
    of the n people is a knight or a knave), or None when the source does not name its n."""
    n = data_source[len(DATA_SOURCE):]
    return 2.0 ** -int(n) if data_source.startswith(DATA_SOURCE) and n.isdigit() and int(n) > 0 else None


def prompt_messages(quiz: str, prompt_style: str = "template") -> list[dict[str, str]]:
    """The `prompt` column value for one quiz."""
    if prompt_style == "template":
        content = (
            f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{quiz}\n"
            "<|im_end|>\n<|im_start|>assistant\n<think>"
        )
    elif prompt_style == "messages":
        content = f"{SYSTEM_PROMPT.strip()}\n\n{quiz}"
    else:
        raise ValueError(f"prompt_style must be one of {PROMPT_STYLES}, got {prompt_style!r}")
    return [{"content": content, "role": "user"}]


def puzzle_row(
    puzzle: Puzzle,
    index: int,
    *,
    prompt_style: str = "template",
    split: str = "train",
    data_source: str = DATA_SOURCE,
    index_offset: int = 0,
) -> dict:
    """One row with every column of the public K&K files (see KK_SCHEMA)."""
    quiz, answer = puzzle.quiz, puzzle.answer
    statements = repr(puzzle.statements)
    return {
        "quiz": quiz,
        "names": list(puzzle.names),
        "knight_knave": dict(KNIGHT_KNAVE),
        "solution": list(puzzle.solution),
        "solution_text": solution_text(puzzle.names, puzzle.solution),
        "solution_text_format": answer,
        "cot_head": COT_HEAD,
        "cot_repeat_steps": puzzle.cot(),
        "cot_foot": COT_FOOT,
        "statements": statements,
        "index": index_offset + index,
        "data_source": data_source,
        "prompt": prompt_messages(quiz, prompt_style),
        "ability": "logic",
        "reward_model": {
            "ground_truth": {"solution_text_format": answer, "statements": statements},
            "style": "rule",
        },
        "extra_info": {"index": index, "split": split},
    }


def generate_rows(
    n_people: int,
    count: int,
    seed: int,
    *,
    prompt_style: str = "template",
    split: str = "train",
    data_source: str = DATA_SOURCE,
    index_offset: int = 0,
) -> list[dict]:
    puzzles = generate_puzzles(n_people, count, seed)
    return [
        puzzle_row(p, i, prompt_style=prompt_style, split=split, data_source=data_source,
                   index_offset=index_offset)
        for i, p in enumerate(puzzles)
    ]  # fmt: skip


def write_parquet(rows: Sequence[dict], out: str | Path) -> Path:
    return generated.write_parquet(rows, out, KK_SCHEMA)


def sft_examples(
    n_people: int, count: int, seed: int, *, prompt_style: str = "template"
) -> list[dict]:
    """Supervised warm-start pairs: {'prompt': [message], 'response': worked solution, ...}.

    For the template style the response omits the opening '<think>', which the prompt
    already holds, so prompt + response scores 3 under the K&K reward either way.
    """
    out = []
    for i, p in enumerate(generate_puzzles(n_people, count, seed)):
        row = puzzle_row(p, i, prompt_style=prompt_style)
        out.append({
            "prompt": row["prompt"],
            "response": worked_solution(p, open_think=prompt_style != "template"),
            "data_source": row["data_source"],
            "reward_model": row["reward_model"],
            "extra_info": row["extra_info"],
        })  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m arlopti_jax.tasks.kk", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("generate", "write puzzles as parquet in the public schema"),
                            ("sft", "write prompt/worked-solution pairs as JSON lines")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--people", type=int, required=True, help="people per puzzle (2..8)")
        p.add_argument("--count", type=int, required=True)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--out", required=True)
        p.add_argument("--prompt-style", choices=PROMPT_STYLES, default="template")
    gen = sub.choices["generate"]
    gen.add_argument("--split", default="train", help="extra_info.split value")
    gen.add_argument("--data-source", default=DATA_SOURCE)
    gen.add_argument("--index-offset", type=int, default=0, help="added to the index column")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error("--count must be positive")
    if not MIN_PEOPLE <= args.people <= MAX_PEOPLE:
        parser.error(f"--people must be in [{MIN_PEOPLE}, {MAX_PEOPLE}]")

    if args.command == "generate":
        rows = generate_rows(args.people, args.count, args.seed, prompt_style=args.prompt_style,
                             split=args.split, data_source=args.data_source,
                             index_offset=args.index_offset)  # fmt: skip
        path = write_parquet(rows, args.out)
    else:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        examples = sft_examples(args.people, args.count, args.seed, prompt_style=args.prompt_style)
        with path.open("w") as f:
            for ex in examples:
                f.write(json.dumps(ex) + "\n")
    print(f"wrote {args.count} {args.people}-person puzzles to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
