"""The embedded default's start point, built locally since nothing can be downloaded.

``ensure_start_point(folder, scale=...)`` makes, once (later calls reuse it):
  folder/data/train.parquet, test_{n}ppl.parquet for each of the scale's people counts n
      generated K&K puzzles (data_source kk_logic{n}) in the public data's schema, with the chat
      template embedded in the prompt like the public files, but a one-line system prompt
      instead of the public data's paragraph, no quiz intro (``QUIZ_INTRO``: the same two
      sentences in every puzzle, a fifth of its tokens), people named by position (Alice, Bob,
      Carol, Dave, Eve) and every claim reported with the same phrase: a model this small does
      not learn to copy arbitrary names or read 18 ways of quoting a claim in a CPU budget, so
      the task left to learn is the knights-and-knaves logic itself;
  folder/model/  a Hugging Face folder: a byte-level BPE tokenizer trained with
      ``tokenizers`` on generated K&K text, and a small Qwen2-architecture model trained
      from random initialisation (``arlopti_jax.sft``) on right answers;
  folder/scale.json  the scale, build number, seed and sizes it was built with: a folder built
      with other settings or by an earlier build is never reused silently (``StartPointMismatch``).
Two scales (``SCALES``): ``cpu``, the default (2 and 3 people; a 0.85M-parameter model, hidden
128, 4 layers; 600 SFT steps in length-grouped batches; after them its answers, forced into the
answer block, are right for about 0.53 / 0.29 of 2 / 3-person puzzles, against 0.25 / 0.125 by
guessing), and ``gpu``,
for one accelerator (3, 4 and 5 people; a 24.4M-parameter model, hidden 512, 8 layers of 8
heads / 2 KV heads, computing in bfloat16 with float32 weights; 2000 SFT steps of 64 rows drawn
from 16000 puzzles per people count). Both tokenizers stop short of ``vocab_size``: the text has
few distinct words, so BPE runs out of merges at about 420 tokens (448 rows, padded). A folder
without scale.json was built before scales existed, at the cpu scale (build 1).
To fit the budget, responses are short: the prompt opens ``<think>``, and
the SFT target closes it at once and gives the answer. Every SFT answer is right, but only
``sft_tagged_share`` (30%) of them are written in the ``<answer>`` block the reward reads;
the rest state the same assignment as a sentence (the public rows' ``solution_text``), as an
instruction-tuned model that knows some of the logic but not the required format would.
The start point's greedy answers are therefore all sentences (score -3, never correct),
while about 30% of its samples use the block: RL has a strong signal to learn the format
(the Logic-RL reward's first lesson), and the greedy accuracy it then reaches is what the
warm start learnt of the logic. The folder is built under a temporary name and renamed when
complete, so an interrupted build is never reused.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import jax
import numpy as np

from arlopti_jax.runtime import faults
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.models import ModelConfig, init_params, save_pretrained
from arlopti_jax.tasks.kk import puzzle_row, write_parquet
from arlopti_jax.tasks.kk_puzzles import QUIZ_INTRO, generate_puzzles

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
SYSTEM_LINE = "Decide who is a knight and who is a knave. Answer in <answer> </answer> tags."
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Per scale: the people counts, the tokenizer's vocabulary, the model's shape and compute dtype,
# and the SFT and data sizes. cpu: the whole default (build + RL + evaluation) runs in minutes on
# 2 CPU cores. gpu: the build takes a few minutes on one H100, SFT about one of them.
SCALES = {
    "cpu": dict(people=(2, 3), vocab_size=1024, hidden_size=128, intermediate_size=384, num_layers=4,
                num_heads=4, num_kv_heads=2, head_dim=32, dtype="float32", sft_rows_per_size=2000,
                sft_steps=600, sft_batch=32, sft_lr=2e-3, sft_warmup=20, sft_tagged_share=0.3,
                train_rows_per_size=1000, test_rows_per_size=100),
    "gpu": dict(people=(3, 4, 5), vocab_size=1024, hidden_size=512, intermediate_size=1536, num_layers=8,
                num_heads=8, num_kv_heads=2, head_dim=64, dtype="bfloat16", sft_rows_per_size=16000,
                sft_steps=2000, sft_batch=64, sft_lr=1e-3, sft_warmup=100, sft_tagged_share=0.3,
                train_rows_per_size=2000, test_rows_per_size=100),
}
TINY = SCALES["cpu"]
SCALE_FILE = "scale.json"
# What this module builds, numbered: 1 (no number recorded) kept the quiz intro in the prompts and
# drew random SFT batches; 2 drops the intro and groups SFT batches by length.
BUILD = 2


class StartPointMismatch(ValueError):
    """A start point folder built with another scale, seed or sizes than asked for."""


POSITION_NAMES = ("Alice", "Bob", "Carol", "Dave", "Eve")
SPEECH_TEMPLATE = 0  # every claim reported the same way ('NAME was heard saying, "..."')


def compact_rows(n_people: int, count: int, seed: int) -> list[dict]:
    """Generated K&K rows (people named by position, one speech phrase) whose prompt embeds
    the chat template with a one-line system prompt."""
    if not 1 <= n_people <= len(POSITION_NAMES):
        raise ValueError(f"compact rows name people by position: {n_people} people, but only "
                         f"{len(POSITION_NAMES)} names {POSITION_NAMES}")
    puzzles = [dataclasses.replace(p, names=POSITION_NAMES[:n_people], templates=(SPEECH_TEMPLATE,) * n_people)
               for p in generate_puzzles(n_people, count, seed)]
    rows = [puzzle_row(p, i, data_source=f"kk_logic{n_people}") for i, p in enumerate(puzzles)]
    for row in rows:
        row["quiz"] = row["quiz"].removeprefix(QUIZ_INTRO)  # the same two sentences in every puzzle
        row["prompt"] = [{"role": "user", "content": (
            f"<|im_start|>system\n{SYSTEM_LINE}<|im_end|>\n<|im_start|>user\n{row['quiz']}<|im_end|>\n"
            "<|im_start|>assistant\n<think>")}]
    return rows


ANSWER_OPENING = "</think>\n<answer>"  # how a block answer opens (the prompt ends with <think>)


def sft_target(row: dict, tagged: bool = True) -> str:
    """The warm start's target: the right answer in the ``<answer>`` block the reward reads
    (tagged), or the same assignment as a sentence, which the reward scores as a format failure."""
    if tagged:
        return f"{ANSWER_OPENING}{row['solution_text_format']}</answer>"
    return f"</think>\n{row['solution_text']}"


def model_config(sizes: dict, vocab_size: int) -> ModelConfig:
    """The start point's model: a Qwen2-architecture decoder of ``sizes``' shape and compute dtype
    (float32 weights)."""
    return ModelConfig(vocab_size=vocab_size, hidden_size=sizes["hidden_size"],
                       intermediate_size=sizes["intermediate_size"], num_layers=sizes["num_layers"],
                       num_heads=sizes["num_heads"], num_kv_heads=sizes["num_kv_heads"], head_dim=sizes["head_dim"],
                       rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True,
                       max_position_embeddings=2048, architecture="Qwen2ForCausalLM", dtype=sizes["dtype"],
                       param_dtype="float32")


def tiny_model_config(vocab_size: int) -> ModelConfig:
    """The cpu scale's model."""
    return model_config(SCALES["cpu"], vocab_size)


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer with Qwen's chat special tokens, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=["<|im_start|>"])
    hf.add_tokens(TAG_TOKENS)  # whole-tag tokens (not special: decoding keeps them)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def scale_sizes(scale: str, sizes: dict | None = None) -> dict:
    """The settings of ``scale`` with ``sizes`` replacing some of them (tests and --quick use tiny
    sizes; a model-shape key replaces the model's)."""
    if scale not in SCALES:
        raise ValueError(f"unknown start point scale {scale!r}: choose from {list(SCALES)}")
    unknown = sorted(set(sizes or {}) - set(SCALES[scale]))
    if unknown:
        raise ValueError(f"unknown start point sizes {unknown}: the settings are {sorted(SCALES[scale])}")
    s = {**SCALES[scale], **(sizes or {})}
    s["people"] = tuple(s["people"])
    return s


def check_start_point(folder: str | Path, scale: str = "cpu", seed: int = 0, sizes: dict | None = None) -> bool:
    """Whether ``folder`` holds a complete start point built with these settings (False: none is
    there yet). Raises ``StartPointMismatch`` if the one there was built with others."""
    folder = Path(folder)
    if not ((folder / "model" / "config.json").is_file() and (folder / "data" / "train.parquet").is_file()):
        return False
    path = folder / SCALE_FILE
    built = json.loads(path.read_text()) if path.is_file() else {"scale": "cpu"}  # built before scales existed
    if built["scale"] != scale:
        raise StartPointMismatch(
            f"{folder} holds a start point of scale {built['scale']!r}, not {scale!r}: use another output "
            f"folder, or remove {folder} to build the {scale!r} one")
    build = built.get("build", 1)  # none recorded: build 1
    if build != BUILD:
        raise StartPointMismatch(
            f"{folder} holds a start point built by an earlier version of this project (build {build}; "
            f"this one builds {BUILD}, with shorter prompts): remove {folder} to rebuild it")
    wanted = {"scale": scale, "seed": seed, "sizes": scale_sizes(scale, sizes)}
    wanted = json.loads(json.dumps(wanted))  # as stored (tuples as lists)
    differ = sorted(k for k in wanted["sizes"] if "sizes" in built and built["sizes"].get(k) != wanted["sizes"][k])
    if differ or built.get("seed", seed) != seed:
        raise StartPointMismatch(
            f"{folder} holds a {scale!r} start point built with other settings (seed {built.get('seed')} "
            f"vs {seed}; differing: {differ}): use another output folder, or remove {folder} to rebuild it")
    return True


def ensure_start_point(folder: str | Path, seed: int = 0, sizes: dict | None = None, scale: str = "cpu") -> Path:
    """Build (or reuse) the start point of ``scale`` in ``folder``; returns ``folder``."""
    from arlopti_jax.finetune.supervised import run_sft

    folder = Path(folder)
    if check_start_point(folder, scale, seed, sizes):
        return folder
    s = scale_sizes(scale, sizes)
    people = s["people"]
    tmp = folder.with_name(folder.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "data").mkdir(parents=True)
    log.info("building the embedded start point (scale %s) in %s", scale, folder)

    # RL data: separate seeds for test, train and SFT puzzles; test puzzles removed from the others
    test = {n: compact_rows(n, s["test_rows_per_size"], seed + 10 + n) for n in people}
    held_out = {r["quiz"] for rows in test.values() for r in rows}
    for n, rows in test.items():
        write_parquet(rows, tmp / "data" / f"test_{n}ppl.parquet")
    fresh = lambda rows: [r for r in rows if r["quiz"] not in held_out]
    train = fresh([r for n in people for r in compact_rows(n, s["train_rows_per_size"], seed + n - 1)])
    write_parquet(train, tmp / "data" / "train.parquet")
    coin = np.random.default_rng(seed + 30)  # which SFT answers go in the block
    sft_rows = [{"prompt": r["prompt"], "response": sft_target(r, coin.random() < s["sft_tagged_share"])}
                for n in people for r in fresh(compact_rows(n, s["sft_rows_per_size"], seed + 20 + n))]
    texts = [r["prompt"][0]["content"] + r["response"] for r in sft_rows]
    tokenizer = train_tokenizer(texts, s["vocab_size"])
    vocab = -(-len(tokenizer) // 64) * 64  # padded: whole rows for sharding
    model_cfg = model_config(s, vocab).replace(bos_token_id=None, eos_token_id=tokenizer.eos_token_id)
    mesh = shd.make_mesh({"fsdp": -1}, devices=jax.local_devices())  # multi-process: process 0 alone builds it
    params = init_params(model_cfg, jax.random.key(seed), mesh)
    params, losses = run_sft(model_cfg, params, tokenizer, sft_rows, steps=s["sft_steps"], batch=s["sft_batch"],
                             lr=s["sft_lr"], warmup=s["sft_warmup"], max_length=1024, seed=seed, mesh=mesh,
                             desc="warm start (sft)")
    save_pretrained(model_cfg, params, tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    (tmp / "model" / "sft_losses.json").write_text(json.dumps(losses))
    (tmp / SCALE_FILE).write_text(json.dumps({"scale": scale, "build": BUILD, "seed": seed, "sizes": s}, indent=1))
    if jax.process_index() == 0:
        faults.point("start_point")
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    log.info("start point ready: SFT loss %.3f -> %.3f", losses[0], losses[-1])
    return folder
