"""Prompt datasets: parquet/jsonl files or Hub datasets -> tokenized prompts -> shuffled batches.

    rows = load_rows(paths)                      # list of dicts, one per row
    ds = PromptDataset(paths, tokenizer, max_prompt_length=400)
    ds[i] -> {'prompt_ids': list[int], 'prompt_text': str, 'data_source': str,
              'ground_truth': Any, 'extra_info': dict, 'source': str, 'row': int}
    it = BatchIterator(ds, batch_size=64, seed=42)   # drop_last=True
    batch = next(it)                             # list of ds rows
    state = it.state_dict(); it2.load_state_dict(state)  # resumes exactly

Paths: a file (*.parquet, *.jsonl), a folder (its *.parquet and *.jsonl files, not
recursive, sorted by name), a Hugging Face Hub dataset ``ORG/NAME[@REVISION][[:CONFIG]:SPLIT]``
(``tasks.hub_data``: read through the ``datasets`` cache; a path that exists here is a path)
or a list of these. Files are read with Hugging Face `datasets`
(`load_dataset('parquet'|'json', data_files=...)`), each on its own, so files of different
schemas (K&K and math) mix freely.

Columns (verl's layout by default; a TRL-style dataset names its own):
  prompt_key    the prompt: a string, or a list of {'role', 'content'} chat messages. A list
                that ends with the assistant's message (TRL's `messages`) is the conversation
                before it: that answer is cut from the prompt.
  answer_key    the ground truth the reward compares with (default `reward_model.ground_truth`);
                the same column as prompt_key: the content of the assistant's message it cut.
  data_source   the column `data_source`; rows without one take the `data_source` argument.
Dotted names (`reward_model.ground_truth`) reach into nested columns. A missing or null value
raises ValueError naming the file, the row index and the column. Ground truths keep their Python
type (string, float such as amc's 142.0, dict for K&K, ...).

Prompt styles (per row with prompt_style='auto'):
  template  the prompt is a string, or one message whose content already holds the
            chat template (it contains '<|im_start|>assistant'), as in the public K&K
            files: that text is tokenized as-is.
  messages  a list of chat messages (a string: the user's one message): the tokenizer's
            chat template is applied with add_generation_prompt=True.
With ``tools`` (JSON schemas, a tool episode's: ``rl/episode_host.prompt_tools``) the template is
applied with ``tools=`` as well, so it writes its own tools section (Qwen2.5's and Qwen3's system
message); a prompt that is text already (template style) cannot get one, which is a ValueError.
Token ids come from `tokenizer(text, add_special_tokens=False)`: the text already
holds every special token it needs.

Prompts longer than `max_prompt_length` tokens are dropped and reported (a log line
with the total and one per file; `PromptDataset.dropped` maps file -> count).

BatchIterator shuffles each epoch with numpy's default_rng(seed + epoch), yields
lists of rows and moves on to the next epoch by itself; its position is the dict
{'epoch', 'index'} (plus the settings it must be restored with).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from arlopti_jax.tasks.hub_data import HubSplit, load_hub_rows, parse_hub_split

log = logging.getLogger(__name__)

DATA_SUFFIXES = {".parquet": "parquet", ".jsonl": "json"}
EMBEDDED_TEMPLATE_MARKER = "<|im_start|>assistant"
PROMPT_STYLES = ("auto", "template", "messages")
PathLike = str | Path
DataFile = Path | HubSplit  # a local file, or a split of a Hub dataset
DEFAULT_ANSWER_KEY = "reward_model.ground_truth"


def resolve_data_files(paths: PathLike | HubSplit | Sequence[PathLike | HubSplit],
                       default_split: str = "train") -> list[DataFile]:
    """Files named by `paths` (files, folders, Hub datasets, or a list of them), in order. A folder
    gives its own data files, not its sub-folders': the public K&K layout keeps train and test files
    in sub-folders of one folder, so a recursive search would train on test puzzles. A name that is
    no path here but has a Hub dataset's form is a Hub dataset (``default_split`` without a split);
    whether the Hub or a cache has it is found when its rows are read."""
    if isinstance(paths, (str, Path, HubSplit)):
        paths = [paths]
    files: list[DataFile] = []
    for spec in paths:
        if isinstance(spec, HubSplit):
            files.append(spec)
            continue
        p = Path(spec)
        hub = None if p.exists() or p.suffix in DATA_SUFFIXES else parse_hub_split(str(spec), default_split)
        if hub is not None:
            files.append(hub)
        elif p.is_dir():
            found = sorted(f for f in p.iterdir() if f.suffix in DATA_SUFFIXES and f.is_file())
            if not found:
                below = ("; sub-folders are not searched: name their files"
                         if any(f.is_dir() for f in p.iterdir()) else "")
                raise FileNotFoundError(f"no *.parquet or *.jsonl files in folder {p}{below}")
            files += found
        elif p.is_file():
            if p.suffix not in DATA_SUFFIXES:
                raise ValueError(f"{p}: unsupported data file type (expected .parquet or .jsonl)")
            files.append(p)
        else:
            raise FileNotFoundError(f"data path does not exist: {p}")
    if not files:
        raise ValueError("no data paths given")
    return files


def _read_file(path: DataFile, cache_dir: str | None) -> list[dict]:
    if isinstance(path, HubSplit):
        return load_hub_rows(path, cache_dir)
    import datasets

    ds = datasets.load_dataset(
        DATA_SUFFIXES[path.suffix], data_files=str(path), split="train", cache_dir=cache_dir
    )
    return ds.to_list()


def _value(row: dict, column: str) -> Any:
    """The row's value at a dotted column name (None when absent or null)."""
    value: Any = row
    for part in column.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _required(row: dict, column: str, path: DataFile, index: int, hint: str = "") -> Any:
    value = _value(row, column)
    if value is None:
        raise ValueError(f"{path}: row {index}: missing column {column!r}{hint}")
    return value


def split_answer(prompt: Any) -> tuple[Any, Any]:
    """(the prompt, the assistant's answer or None): a message list ending with the assistant's
    message is the conversation before it, and that message's content its answer."""
    if (isinstance(prompt, (list, tuple)) and len(prompt) > 1 and isinstance(prompt[-1], dict)
            and prompt[-1].get("role") == "assistant"):
        return list(prompt[:-1]), prompt[-1].get("content")
    return prompt, None


def load_rows(
    paths: PathLike | HubSplit | Sequence[PathLike | HubSplit], *, prompt_key: str = "prompt",
    answer_key: str = DEFAULT_ANSWER_KEY, data_source: str = "", cache_dir: str | None = None,
    default_split: str = "train",
) -> list[dict]:
    """Rows as {'prompt', 'data_source', 'ground_truth', 'extra_info', 'source', 'row'} (the
    columns: module docstring)."""
    rows = []
    for path in resolve_data_files(paths, default_split):
        raw = _read_file(path, cache_dir)
        if not raw:
            log.warning("%s: no rows", path)
        for i, r in enumerate(raw):
            prompt, answer = split_answer(_required(r, prompt_key, path, i))
            if answer_key != prompt_key:
                answer = _required(r, answer_key, path, i)
            elif answer is None:
                raise ValueError(f"{path}: row {i}: missing column {prompt_key!r}'s answer (its last message is not "
                                 "the assistant's)")
            source = _value(r, "data_source")
            if source is None and not data_source:
                _required(r, "data_source", path, i, " (or set data.data_source for rows without one)")
            extra = r.get("extra_info")
            rows.append({
                "prompt": prompt,
                "data_source": str(data_source if source is None else source),
                "ground_truth": answer,
                "extra_info": extra if isinstance(extra, dict) else {},
                "source": str(path),
                "row": i,
            })  # fmt: skip
    return rows


def render_prompt(prompt: Any, tokenizer: Any, prompt_style: str = "auto", tools: list[dict] | None = None) -> str:
    """The prompt text to tokenize (see 'Prompt styles' in the module docstring)."""
    if prompt_style not in PROMPT_STYLES:
        raise ValueError(f"prompt_style must be one of {PROMPT_STYLES}, got {prompt_style!r}")
    text_already = ("the prompt is text with the chat template already applied, so the template's tools section "
                    "cannot be added: give it as chat messages (data.prompt_style=messages), or set "
                    "env.template_tools=False")
    if isinstance(prompt, str):
        if prompt_style == "messages":
            return render_prompt([{"role": "user", "content": prompt}], tokenizer, "messages", tools)
        if tools:
            raise ValueError(text_already)
        return prompt
    messages = [dict(m) for m in prompt]
    if not messages or any("content" not in m or "role" not in m for m in messages):
        raise ValueError(f"prompt must be a string or a list of {{'role', 'content'}} messages, got {prompt!r:.200}")
    embedded = len(messages) == 1 and EMBEDDED_TEMPLATE_MARKER in messages[0]["content"]
    if prompt_style == "template" or (prompt_style == "auto" and embedded):
        if len(messages) != 1:
            raise ValueError(f"a template-style prompt is one message, got {len(messages)}")
        if tools:
            raise ValueError(text_already)
        return messages[0]["content"]
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)


class PromptDataset:
    """Tokenized prompts with their reward inputs; over-long prompts dropped and reported."""

    def __init__(
        self,
        paths: PathLike | HubSplit | Sequence[PathLike | HubSplit],
        tokenizer: Any,
        max_prompt_length: int | None = None,
        prompt_key: str = "prompt",
        prompt_style: str = "auto",
        cache_dir: str | None = None,
        answer_key: str = DEFAULT_ANSWER_KEY,
        data_source: str = "",
        default_split: str = "train",
        tools: list[dict] | None = None,
    ):
        rows = load_rows(paths, prompt_key=prompt_key, answer_key=answer_key, data_source=data_source,
                         cache_dir=cache_dir, default_split=default_split)
        texts = []
        for r in rows:
            try:
                texts.append(render_prompt(r["prompt"], tokenizer, prompt_style, tools))
            except Exception as e:
                raise ValueError(f"{r['source']}: row {r['row']}: cannot render prompt: {e}") from e
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        self.rows: list[dict] = []
        self.dropped: dict[str, int] = {}
        for r, text, tokens in zip(rows, texts, ids):
            if max_prompt_length is not None and len(tokens) > max_prompt_length:
                self.dropped[r["source"]] = self.dropped.get(r["source"], 0) + 1
                continue
            self.rows.append({
                "prompt_ids": list(tokens),
                "prompt_text": text,
                "data_source": r["data_source"],
                "ground_truth": r["ground_truth"],
                "extra_info": r["extra_info"],
                "source": r["source"],
                "row": r["row"],
            })  # fmt: skip
        if self.dropped:
            log.warning(
                "dropped %d of %d prompts longer than %d tokens",
                self.num_dropped, len(rows), max_prompt_length,
            )  # fmt: skip
            for source, count in self.dropped.items():
                log.warning("  %s: dropped %d", source, count)
        if not self.rows:
            raise ValueError(f"no prompts left after filtering to {max_prompt_length} tokens")

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


class BatchIterator:
    """Endless (or `num_epochs`-long) shuffled batches of dataset rows, resumable exactly."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        seed: int,
        drop_last: bool = True,
        num_epochs: int | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(dataset) == 0 or (drop_last and len(dataset) < batch_size):
            raise ValueError(f"dataset of {len(dataset)} rows cannot fill a batch of {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.drop_last = drop_last
        self.num_epochs = num_epochs
        self.epoch = 0
        self.index = 0  # position in this epoch's order of the next row to yield
        self._order: tuple[int, np.ndarray] | None = None

    @property
    def steps_per_epoch(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng(self.seed + epoch).permutation(len(self.dataset)))
        return self._order[1]

    def __iter__(self) -> Iterator[list[dict]]:
        return self

    def __next__(self) -> list[dict]:
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        n = len(self.dataset)
        remaining = n - self.index
        if remaining <= 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch, self.index = self.epoch + 1, 0
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        picked = self.epoch_order(self.epoch)[self.index : self.index + self.batch_size]
        self.index += len(picked)
        return [self.dataset[int(i)] for i in picked]

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "dataset_size": len(self.dataset),
            "drop_last": self.drop_last,
        }

    def check_state(self, state: dict) -> None:
        """ValueError where ``state`` (another iterator's ``state_dict``) is not a position in this
        iterator's order: another seed, batch size, dataset size or ``drop_last``."""
        for key in ("seed", "batch_size", "dataset_size", "drop_last"):
            mine = self.state_dict()[key]
            if key in state and state[key] != mine:
                raise ValueError(f"cannot resume: saved {key}={state[key]!r}, this iterator has {mine!r}")

    def load_state_dict(self, state: dict) -> None:
        self.check_state(state)
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
