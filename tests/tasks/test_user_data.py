"""A user's own rows: TRL's layouts (question/answer columns, chat `messages`), the column fields, a
default data source, and Hugging Face Hub datasets read offline from caches laid out on disk (the
`datasets` cache an online load leaves, and a Hub-cache snapshot as `hf download` leaves it)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from task_fixtures import tiny_tokenizer

from arlopti_jax.tasks.data import PromptDataset, load_rows, resolve_data_files
from arlopti_jax.tasks.hub_data import HubSplit, parse_hub_split

QUESTIONS = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in ((1, 2), (7, 5), (10, 33))]
CHATS = [
    {"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Capital of France?"},
                  {"role": "assistant", "content": "Paris"}], "solution": "paris"},
    {"messages": [{"role": "user", "content": "2 * 21?"}, {"role": "assistant", "content": "42"}], "solution": "42"},
]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _chat(tok, messages) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_question_answer_columns_with_a_default_data_source(tmp_path, suffix):
    tok = tiny_tokenizer()
    rows = [{**QUESTIONS[2], "data_source": "math_dsr"}, *QUESTIONS[:2]]  # the first row names its own source
    path = tmp_path / f"qa{suffix}"
    _jsonl(path, rows) if suffix == ".jsonl" else pq.write_table(pa.Table.from_pylist(rows), path)
    ds = PromptDataset(path, tok, prompt_key="question", answer_key="answer", data_source="arith",
                       prompt_style="messages")
    assert [r["ground_truth"] for r in ds] == ["43", "3", "12"]
    assert [r["data_source"] for r in ds] == ["math_dsr", "arith", "arith"]  # parquet: null in the others
    for r, raw in zip(ds, rows):
        assert r["prompt_text"] == _chat(tok, [{"role": "user", "content": raw["question"]}])
        assert r["prompt_ids"] == tok(r["prompt_text"], add_special_tokens=False)["input_ids"]
    # under prompt_style auto a string is tokenized as it is
    assert [r["prompt_text"] for r in PromptDataset(path, tok, prompt_key="question", answer_key="answer",
                                                     data_source="arith")] == [q["question"] for q in rows]


def test_chat_messages_are_the_conversation_before_the_assistant_answer(tmp_path):
    tok = tiny_tokenizer()
    path = _jsonl(tmp_path / "chat.jsonl", CHATS)
    ds = PromptDataset(path, tok, prompt_key="messages", answer_key="messages", data_source="arith")
    assert [r["ground_truth"] for r in ds] == ["Paris", "42"]  # the assistant's message is the answer
    for r, raw in zip(ds, CHATS):
        assert r["prompt_text"] == _chat(tok, raw["messages"][:-1])
        assert "Paris" not in r["prompt_text"] and r["prompt_text"].endswith("<|im_start|>assistant\n")
    # the answer from another column: the assistant's message is still cut from the prompt
    other = PromptDataset(path, tok, prompt_key="messages", answer_key="solution", data_source="arith")
    assert [r["ground_truth"] for r in other] == ["paris", "42"]
    assert [r["prompt_text"] for r in other] == [r["prompt_text"] for r in ds]


@pytest.mark.parametrize("rows, kwargs, row, message", [
    ([*QUESTIONS[:2], {"answer": "1"}], dict(prompt_key="question", answer_key="answer", data_source="arith"), 2,
     "missing column 'question'"),
    ([QUESTIONS[0], {"question": "q"}], dict(prompt_key="question", answer_key="answer", data_source="arith"), 1,
     "missing column 'answer'"),
    (QUESTIONS, dict(prompt_key="question", answer_key="answer"), 0,
     "missing column 'data_source' (or set data.data_source for rows without one)"),
    ([CHATS[0], {"messages": [{"role": "user", "content": "no answer"}]}],
     dict(prompt_key="messages", answer_key="messages", data_source="arith"), 1,
     "missing column 'messages''s answer (its last message is not the assistant's)"),
])  # fmt: skip
def test_a_missing_column_names_the_file_the_row_and_the_column(tmp_path, rows, kwargs, row, message):
    path = _jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ValueError) as err:
        load_rows(path, **kwargs)
    assert str(err.value) == f"{path}: row {row}: {message}"


def test_hub_dataset_names_and_paths(tmp_path, monkeypatch):
    assert parse_hub_split("acme/tiny-qa", "test") == HubSplit("acme/tiny-qa", "test")
    assert parse_hub_split("openai/gsm8k:main:train") == HubSplit("openai/gsm8k", "train", "main")
    assert parse_hub_split("acme/x@v1.0:validation") == HubSplit("acme/x", "validation", None, "v1.0")
    assert str(HubSplit("acme/x", "test", "main", "v1")) == "acme/x@v1:main:test"
    assert HubSplit("openai/gsm8k", "test", "main").set_name == "gsm8k_main_test"
    assert parse_hub_split("/abs/folder") is None and parse_hub_split("a/b/c") is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "tiny-qa").mkdir(parents=True)  # a folder here with a Hub id's form is a folder
    _jsonl(tmp_path / "acme" / "tiny-qa" / "rows.jsonl", QUESTIONS)
    assert resolve_data_files(["acme/tiny-qa", "acme/other:test"], "train") == [
        Path("acme/tiny-qa/rows.jsonl"), HubSplit("acme/other", "test")]
    with pytest.raises(FileNotFoundError, match="data path does not exist: acme/x.parquet"):
        resolve_data_files("acme/x.parquet")  # a data file's name is never a Hub id


# ---------------------------------------------------------------- Hub datasets, offline
def prepared_cache(cache: Path, repo: str, splits: dict[str, list[dict]], work: Path) -> None:
    """``splits`` prepared into the datasets cache ``cache`` as an online ``load_dataset(repo)`` of a
    parquet repository leaves them: ``ORG___NAME/default/0.0.0/<hash>/`` with NAME-<split>.arrow and
    dataset_info.json (prepared by datasets' own parquet builder from local files, then placed
    under the names the Hub load gives them)."""
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    org, name = repo.split("/")
    for split, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), work / f"{split}.parquet")
    files = DataFilesDict.from_patterns({s: [str(work / f"{s}.parquet")] for s in splits})
    builder = Parquet(cache_dir=str(work / "prepared"), dataset_name=name, data_files=files, hash="0" * 16)
    builder.download_and_prepare()
    target = cache / f"{org}___{name}" / "default" / "0.0.0"
    target.mkdir(parents=True)
    shutil.copytree(builder.cache_dir, target / ("0" * 16))


def hub_snapshot(hub_cache: Path, repo: str, files: dict[str, bytes], commit: str = "1" * 40) -> None:
    """``files`` as huggingface_hub's cache keeps a downloaded dataset repository: blobs named by
    their hash, the snapshot's files linking to them, refs/main the commit."""
    root = hub_cache / ("datasets--" + repo.replace("/", "--"))
    for rel, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = root / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)


def _parquet_bytes(rows: list[dict], path: Path) -> bytes:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path.read_bytes()


READ = """
import json, sys
from arlopti_jax.tasks.data import PromptDataset, load_rows
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
out = {}
for spec, keys in [("acme/tiny-qa:test", ("question", "answer")), ("acme/tiny-qa", ("question", "answer")),
                   ("acme/chat-qa", ("messages", "messages")), ("acme/absent", ("question", "answer")),
                   ("acme/tables", ("question", "answer")), ("acme/tiny-qa:validation", ("question", "answer"))]:
    try:
        ds = PromptDataset(spec, tok, prompt_key=keys[0], answer_key=keys[1], data_source="arith",
                           prompt_style="messages")
        out[spec] = [{k: r[k] for k in ("prompt_text", "ground_truth", "source", "row")} for r in ds]
    except (FileNotFoundError, ValueError) as err:
        out[spec] = f"{type(err).__name__}: {err}"
print("RESULT " + json.dumps(out))
"""


def test_hub_datasets_are_read_offline_from_the_caches(tmp_path):
    """HF_DATASETS_OFFLINE=1 alone (HF_HUB_OFFLINE unset): acme/tiny-qa only in the datasets cache,
    acme/chat-qa only as a Hub-cache snapshot, acme/tables a csv repository (refused: not data read
    here), acme/absent nowhere."""
    home, datasets_cache, work = tmp_path / "hf", tmp_path / "datasets", tmp_path / "work"
    work.mkdir()
    test_rows = [{"question": "What is 4 + 4?", "answer": "8"}, *QUESTIONS[1:]]
    prepared_cache(datasets_cache, "acme/tiny-qa", {"train": QUESTIONS, "test": test_rows}, work)
    hub_snapshot(home / "hub", "acme/chat-qa", {
        "README.md": b"---\nlicense: mit\n---\n# chat-qa\n",
        "data/train-00000-of-00001.parquet": _parquet_bytes(CHATS, work / "chat.parquet")})
    hub_snapshot(home / "hub", "acme/tables", {"data/train.csv": b"question,answer\nq,1\n"})
    tok = tiny_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    env = {**os.environ, "HF_HOME": str(home), "HF_DATASETS_CACHE": str(datasets_cache), "HF_DATASETS_OFFLINE": "1"}
    for var in ("HF_HUB_OFFLINE", "HF_HUB_CACHE"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", READ, str(tmp_path / "tok")], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.split("RESULT ", 1)[1])
    user = lambda text: _chat(tok, [{"role": "user", "content": text}])
    assert got["acme/tiny-qa:test"] == [{"prompt_text": user(r["question"]), "ground_truth": r["answer"],
                                         "source": "acme/tiny-qa:test", "row": i} for i, r in enumerate(test_rows)]
    assert [r["ground_truth"] for r in got["acme/tiny-qa"]] == [q["answer"] for q in QUESTIONS]  # train by default
    assert got["acme/chat-qa"] == [{"prompt_text": _chat(tok, c["messages"][:-1]), "ground_truth":
                                    c["messages"][-1]["content"], "source": "acme/chat-qa:train", "row": i}
                                   for i, c in enumerate(CHATS)]
    assert got["acme/absent"].startswith("FileNotFoundError: acme/absent:train: no such file or folder here, and "
                                         "no Hugging Face Hub dataset acme/absent in reach or in the caches")
    assert got["acme/tables"] == ("ValueError: acme/tables:train: a csv dataset; only parquet, json, arrow data "
                                  "are read here")
    assert got["acme/tiny-qa:validation"] == ("ValueError: acme/tiny-qa:validation: the dataset has no split "
                                              "'validation' (it has train, test)")
