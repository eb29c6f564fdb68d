"""Dataset loading: public files of both schemas, prompt styles, filtering, errors, resumable batches."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from task_fixtures import SHARED_DATA, requires_shared_data, tiny_tokenizer

from arlopti_jax.tasks import kk
from arlopti_jax.tasks.data import BatchIterator, PromptDataset, load_rows, render_prompt, resolve_data_files

KK_FILES = [f"kk/{n}ppl/{split}.parquet" for n in range(3, 8) for split in ("train", "test")]
MATH_FILES = ["math/aime.parquet", "math/amc.parquet", "math/deepscaler_uniform_train.parquet",
              "math/math500.parquet"]  # fmt: skip


# ---------------------------------------------------------------- the public files
@requires_shared_data
def test_known_file_list_is_complete():
    found = sorted(str(p.relative_to(SHARED_DATA)) for p in SHARED_DATA.rglob("*.parquet"))
    assert found == sorted(KK_FILES + MATH_FILES)


@requires_shared_data
@pytest.mark.parametrize("rel", KK_FILES + MATH_FILES)
def test_every_public_file_loads(rel):
    path = SHARED_DATA / rel
    table = pq.read_table(path).to_pylist()
    ds = PromptDataset(path, tiny_tokenizer())
    assert len(ds) == len(table) and ds.num_dropped == 0
    tok = tiny_tokenizer()
    for i in (0, len(ds) - 1):
        item, raw = ds[i], table[i]
        assert item["data_source"] == raw["data_source"]
        assert item["ground_truth"] == raw["reward_model"]["ground_truth"]
        assert type(item["ground_truth"]) is type(raw["reward_model"]["ground_truth"])
        assert item["extra_info"] == raw["extra_info"]
        assert (item["source"], item["row"]) == (str(path), i)
        assert tok.decode(item["prompt_ids"]) == item["prompt_text"]
        content = raw["prompt"][0]["content"]
        if rel.startswith("kk/"):  # chat template already embedded: tokenized as-is
            assert item["prompt_text"] == content
            assert isinstance(item["ground_truth"], dict)
        else:  # plain user message: the tokenizer's chat template is applied
            assert item["prompt_text"] == f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    if rel == "math/amc.parquet":
        assert all(isinstance(r["ground_truth"], float) for r in ds)


@requires_shared_data
def test_folders_and_lists_of_paths():
    kk3 = SHARED_DATA / "kk" / "3ppl"
    assert resolve_data_files(kk3) == [kk3 / "test.parquet", kk3 / "train.parquet"]
    rows = load_rows([kk3 / "train.parquet", SHARED_DATA / "math"])
    assert len(rows) == 900 + 30 + 83 + 10_000 + 500
    assert [r["source"] for r in rows[899:901]] == [str(kk3 / "train.parquet"), str(SHARED_DATA / "math/aime.parquet")]
    with pytest.raises(FileNotFoundError, match="no \\*.parquet or \\*.jsonl"):
        resolve_data_files(SHARED_DATA / "kk")  # files only in sub-folders: not recursive


# ---------------------------------------------------------------- local files
def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _math_row(i, gt, **over):
    row = {"data_source": "math_dsr", "prompt": [{"role": "user", "content": f"question {i}"}],
           "reward_model": {"ground_truth": gt, "style": "rule"}, "extra_info": {"index": i}}  # fmt: skip
    row.update(over)
    return row


def test_jsonl_keeps_ground_truth_types(tmp_path):
    gts = ["1/2", 3, 142.0, {"a": [1, 2]}, ["x", "y"], "\\frac{1}{2}"]
    path = _jsonl(tmp_path / "mixed.jsonl", [_math_row(i, g) for i, g in enumerate(gts)])
    assert [r["ground_truth"] for r in load_rows(path)] == gts
    assert [type(r["ground_truth"]) for r in load_rows(path)] == [type(g) for g in gts]


def test_folder_mixes_parquet_and_jsonl_sorted(tmp_path):
    kk.write_parquet(kk.generate_rows(3, 4, seed=0), tmp_path / "b.parquet")
    _jsonl(tmp_path / "a.jsonl", [_math_row(0, "1")])
    (tmp_path / "notes.txt").write_text("ignored")
    files = resolve_data_files(tmp_path)
    assert [f.name for f in files] == ["a.jsonl", "b.parquet"]
    ds = PromptDataset(tmp_path, tiny_tokenizer())
    assert [r["data_source"] for r in ds] == ["math_dsr"] + ["kk_logic"] * 4


def test_prompt_styles():
    tok = tiny_tokenizer()
    embedded = kk.prompt_messages("Q?", "template")
    assert render_prompt(embedded, tok) == embedded[0]["content"]
    plain = [{"role": "user", "content": "Q?"}]
    assert render_prompt(plain, tok) == "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt("raw text", tok) == "raw text"
    assert render_prompt("raw text", tok, "messages").startswith("<|im_start|>user\nraw text")
    assert render_prompt(embedded, tok, "messages").count("<|im_start|>assistant") == 2
    with pytest.raises(ValueError, match="prompt_style"):
        render_prompt(plain, tok, "chat")


@pytest.mark.parametrize(
    "rows,bad_row,column",
    [
        ([_math_row(0, "1"), _math_row(1, "2"), {"prompt": "p", "data_source": "x", "reward_model": {"style": "rule"}}],
         2, "reward_model.ground_truth"),
        ([_math_row(0, "1"), {"prompt": "p", "reward_model": {"ground_truth": "1"}}], 1, "data_source"),
        ([_math_row(0, "1"), _math_row(1, "2", prompt=None)], 1, "prompt"),
    ],
)  # fmt: skip
def test_missing_column_names_file_row_and_column(tmp_path, rows, bad_row, column):
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError) as err:
        load_rows(path)
    assert str(path) in str(err.value) and f"row {bad_row}" in str(err.value) and repr(column) in str(err.value)


def test_missing_column_in_parquet(tmp_path):
    path = tmp_path / "nosource.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "p", "reward_model": {"ground_truth": "1"}}]), path)
    with pytest.raises(ValueError, match=rf"{path}: row 0: missing column 'data_source'"):
        load_rows(path)
    with pytest.raises(ValueError, match="missing column 'question'"):
        load_rows(path, prompt_key="question")


def test_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_data_files(tmp_path / "nope.parquet")
    with pytest.raises(FileNotFoundError, match="no \\*.parquet.*in folder [^;]*$"):
        resolve_data_files(tmp_path)
    # the public K&K layout, data/kk/3ppl/{train,test}.parquet: a folder is not searched below
    (tmp_path / "kk" / "3ppl").mkdir(parents=True)
    (tmp_path / "kk" / "3ppl" / "train.jsonl").write_text("{}\n")
    with pytest.raises(FileNotFoundError, match="in folder .*kk; sub-folders are not searched"):
        resolve_data_files(tmp_path / "kk")
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(ValueError, match="unsupported"):
        resolve_data_files(tmp_path / "x.csv")


def test_length_filter_reports_drops(tmp_path, caplog):
    tok = tiny_tokenizer()
    short = _jsonl(tmp_path / "short.jsonl", [_math_row(i, "1") for i in range(3)])
    long_rows = [_math_row(i, "1", prompt=[{"role": "user", "content": "word " * (50 if i % 2 else 1)}])
                 for i in range(4)]  # fmt: skip
    mixed = _jsonl(tmp_path / "mixed.jsonl", long_rows)
    limit = max(len(PromptDataset(short, tok)[i]["prompt_ids"]) for i in range(3)) + 5
    with caplog.at_level(logging.WARNING, logger="arlopti_jax.tasks.data"):
        ds = PromptDataset([short, mixed], tok, max_prompt_length=limit)
    assert len(ds) == 5 and ds.num_dropped == 2
    assert ds.dropped == {str(mixed): 2}
    assert all(len(r["prompt_ids"]) <= limit for r in ds)
    assert f"dropped 2 of 7 prompts longer than {limit} tokens" in caplog.text
    assert f"{mixed}: dropped 2" in caplog.text
    with pytest.raises(ValueError, match="no prompts left"):
        PromptDataset(mixed, tok, max_prompt_length=1)


# ---------------------------------------------------------------- batches
class Rows:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"id": i}


def _ids(batch):
    return [r["id"] for r in batch]


def test_batches_shuffle_per_epoch_and_drop_last():
    it = BatchIterator(Rows(10), batch_size=3, seed=7)
    assert it.steps_per_epoch == 3
    epochs = []
    for _ in range(3):
        batches = [_ids(next(it)) for _ in range(3)]
        assert all(len(b) == 3 for b in batches)
        seen = sum(batches, [])
        assert len(set(seen)) == 9  # one row dropped per epoch, none repeated
        epochs.append(seen)
    assert it.epoch == 2
    assert epochs[0] != epochs[1] != epochs[2]
    again = BatchIterator(Rows(10), batch_size=3, seed=7)
    assert [_ids(next(again)) for _ in range(3)] == [epochs[0][:3], epochs[0][3:6], epochs[0][6:]]
    other = BatchIterator(Rows(10), batch_size=3, seed=8)
    assert [_ids(next(other)) for _ in range(3)] != [epochs[0][:3], epochs[0][3:6], epochs[0][6:]]


def test_keep_last_and_num_epochs():
    it = BatchIterator(Rows(5), batch_size=2, seed=0, drop_last=False, num_epochs=2)
    sizes = [len(b) for b in it]
    assert sizes == [2, 2, 1, 2, 2, 1] and it.steps_per_epoch == 3
    with pytest.raises(StopIteration):
        next(it)
    with pytest.raises(ValueError, match="cannot fill a batch"):
        BatchIterator(Rows(2), batch_size=3, seed=0)


@pytest.mark.parametrize("steps_before", [0, 1, 3, 4, 7])
def test_state_round_trip_resumes_exactly(steps_before):
    it = BatchIterator(Rows(11), batch_size=3, seed=42)
    for _ in range(steps_before):
        next(it)
    state = json.loads(json.dumps(it.state_dict()))  # survives a checkpoint as plain data
    expected = [_ids(next(it)) for _ in range(8)]  # crosses epoch boundaries
    resumed = BatchIterator(Rows(11), batch_size=3, seed=42)
    resumed.load_state_dict(state)
    assert [_ids(next(resumed)) for _ in range(8)] == expected
    assert resumed.state_dict() == it.state_dict()


def test_state_from_other_settings_is_refused():
    state = BatchIterator(Rows(11), batch_size=3, seed=42).state_dict()
    with pytest.raises(ValueError, match="dataset_size"):
        BatchIterator(Rows(12), batch_size=3, seed=42).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        BatchIterator(Rows(11), batch_size=3, seed=1).load_state_dict(state)


def test_iterator_over_prompt_dataset(tmp_path):
    path = kk.write_parquet(kk.generate_rows(3, 10, seed=0), tmp_path / "kk.parquet")
    ds = PromptDataset(path, tiny_tokenizer())
    batch = next(BatchIterator(ds, batch_size=4, seed=42))
    assert len(batch) == 4 and all(set(r) >= {"prompt_ids", "prompt_text", "data_source", "ground_truth",
                                              "extra_info"} for r in batch)  # fmt: skip
