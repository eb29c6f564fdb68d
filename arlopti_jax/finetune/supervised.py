"""Supervised fine-tuning on (prompt, response) pairs: the library behind ``arlopti_jax.sft``
and the embedded default's warm start (``start_point``).

Rows hold ``prompt`` (a string or chat messages, rendered as the RL loader does) and
``response`` (the target text; the tokenizer's EOS is appended). The loss is the mean
negative log-likelihood of response tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from arlopti_jax import algos
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.models import ModelConfig, param_shardings, token_logprobs
from arlopti_jax.tasks.data import render_prompt


def tokenize_pairs(rows: list[dict], tokenizer, max_length: int) -> dict[str, np.ndarray]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask`` (response + EOS tokens)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token: SFT targets need one to end responses")
    seqs, masks = [], []
    for i, row in enumerate(rows):
        if "prompt" not in row or "response" not in row:
            raise ValueError(f"SFT row {i} needs 'prompt' and 'response' columns, has {sorted(row)}")
        prompt = tokenizer(render_prompt(row["prompt"], tokenizer), add_special_tokens=False)["input_ids"]
        response = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [eos]
        seq = (prompt + response)[:max_length]
        seqs.append(seq)
        masks.append(([0] * len(prompt) + [1] * len(response))[:max_length])
    length = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    out = {k: np.zeros((len(seqs), length), np.int32) for k in ("input_ids", "attention_mask", "loss_mask")}
    out["input_ids"][:] = pad
    for i, (s, m) in enumerate(zip(seqs, masks)):
        out["input_ids"][i, :len(s)] = s
        out["attention_mask"][i, :len(s)] = 1
        out["loss_mask"][i, :len(m)] = m
    return out


def read_pairs(paths) -> list[dict]:
    """Rows with ``prompt`` and ``response`` from parquet/jsonl files or folders."""
    import datasets

    from arlopti_jax.tasks.data import DATA_SUFFIXES, resolve_data_files

    rows = []
    for path in resolve_data_files(paths):
        ds = datasets.load_dataset(DATA_SUFFIXES[path.suffix], data_files=str(path), split="train")
        for i, row in enumerate(ds):
            for col in ("prompt", "response"):
                if row.get(col) is None:
                    raise ValueError(f"{path}: row {i}: missing column {col!r}")
            rows.append({"prompt": row["prompt"], "response": row["response"]})
    return rows


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float, grad_clip: float):
    """SFT's AdamW (beta2 0.95; linear warm-up over ``warmup`` steps, then cosine decay to lr / 10
    at ``steps``), built by the trainer's ``algos.make_optimizer``."""
    return algos.make_optimizer(algos.OptimConfig(
        lr=lr, b1=0.9, b2=0.95, weight_decay=weight_decay, eps=1e-8, grad_clip=grad_clip, schedule="warmup_cosine",
        warmup_steps=max(1, warmup), total_steps=max(steps, warmup + 1), min_lr_ratio=0.1))


def make_sft_step(model_cfg: ModelConfig, optimizer, mesh, rules=shd.DEFAULT_RULES):
    p_shard = param_shardings(model_cfg, mesh, rules)
    b_shard = shd.batch_sharding(mesh)

    def loss_fn(params, batch):
        lp, _ = token_logprobs(model_cfg, params, batch["input_ids"], batch["attention_mask"])
        mask = batch["loss_mask"].astype(jnp.float32)
        return -jnp.sum(lp * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    @functools.partial(jax.jit, donate_argnums=(0, 1), in_shardings=(p_shard, None, b_shard),
                       out_shardings=(p_shard, None, None))
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def batch_schedule(lengths: np.ndarray, batch: int, steps: int, seed: int = 0, pool: int = 8) -> list[np.ndarray]:
    """Row indices for each of ``steps`` batches, grouped by length: every epoch shuffles the
    rows, sorts each run of ``pool`` batches' worth of rows by length, cuts it into batches and
    shuffles the epoch's batches (an epoch's last rows short of a batch wait for the next
    epoch). A batch then holds rows of similar length, so trimming it to its longest row pays
    for little padding, while each row is still seen once per epoch in random company."""
    n = len(lengths)
    if n < batch:
        raise ValueError(f"SFT needs at least batch={batch} rows, got {n}")
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    while len(out) < steps:
        order = rng.permutation(n)[: n - n % batch]
        epoch = []
        for start in range(0, len(order), pool * batch):
            chunk = order[start:start + pool * batch]
            chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
            epoch += [np.sort(chunk[i:i + batch]) for i in range(0, len(chunk), batch)]
        out += [epoch[i] for i in rng.permutation(len(epoch))]
    return out[:steps]


def run_sft(model_cfg: ModelConfig, params, tokenizer, rows: list[dict], *, steps: int, batch: int,
            lr: float, warmup: int = 20, weight_decay: float = 0.0, grad_clip: float = 1.0,
            max_length: int = 1024, seed: int = 0, mesh=None, desc: str = "sft") -> tuple[dict, list[float]]:
    """Train ``params`` on ``rows`` in length-grouped batches (``batch_schedule``), each trimmed
    to its longest row rounded up to 16 tokens; returns the new params and the loss per step."""
    data = tokenize_pairs(rows, tokenizer, max_length)
    schedule = batch_schedule(data["attention_mask"].sum(1), batch, steps, seed)
    return train_sft(model_cfg, params, data, schedule, lr=lr, warmup=warmup, weight_decay=weight_decay,
                     grad_clip=grad_clip, mesh=mesh, desc=desc)


def train_sft(model_cfg: ModelConfig, params, data: dict[str, np.ndarray], schedule: list[np.ndarray], *,
              lr: float, warmup: int = 20, weight_decay: float = 0.0, grad_clip: float = 1.0, mesh=None,
              desc: str = "sft") -> tuple[dict, list[float]]:
    """``run_sft`` on rows already tokenized (``tokenize_pairs``) and scheduled (``batch_schedule``)."""
    mesh = mesh if mesh is not None else shd.make_mesh({"fsdp": -1})
    steps, lengths = len(schedule), data["attention_mask"].sum(1)
    optimizer = make_optimizer(lr, steps, warmup, weight_decay, grad_clip)
    with shd.activate(mesh):
        opt_state = jax.jit(optimizer.init)(params)
        step = make_sft_step(model_cfg, optimizer, mesh)
        losses = []
        bar = tqdm(schedule, desc=desc, disable=jax.process_index() != 0)
        for idx in bar:
            width = min(data["input_ids"].shape[1], -(-int(lengths[idx].max()) // 16) * 16)
            # placed explicitly: a multi-process run (process 0 building the start point on its own
            # devices) may not pass host arrays to a jit with shardings
            mb = jax.device_put({k: v[idx, :width] for k, v in data.items()}, shd.batch_sharding(mesh))
            params, opt_state, loss = step(params, opt_state, mb)
            losses.append(float(loss))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return params, losses
