"""Supervised fine-tuning on (prompt, response) pairs: the library behind ``arlopti_jax.sft``
and the embedded default's warm start (``start_point``).

Rows hold ``prompt`` (a string or chat messages, rendered as the RL loader does; with a ``tools``
column, TRL's, the JSON schemas its chat template writes a tools section from, as a tool episode's
prompts get theirs) and
``response``: the target text, or a list of segments ``{"text": ..., "train": bool}`` laid out
in order, each tokenized on its own, of which the loss reads the ``train`` ones (a tool trace: the
assistant's turns trained, the tool's observations between them not; ``tool_traces.py``); the
tokenizer's EOS is appended, and trained. The loss is the mean negative log-likelihood of the
trained tokens.
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


def response_segments(response, row: int) -> list[tuple[str, bool]]:
    """A row's ``response`` as (text, trained) segments: a string is one trained segment."""
    if isinstance(response, str):
        return [(response, True)]
    if isinstance(response, (list, tuple)) and all(
            isinstance(s, dict) and isinstance(s.get("text"), str) and isinstance(s.get("train"), bool)
            for s in response):
        return [(s["text"], s["train"]) for s in response]
    raise ValueError(f"SFT row {row}: 'response' must be a string or a list of {{'text': str, 'train': bool}} "
                     f"segments, got {response!r:.200}")


def tokenize_pairs(rows: list[dict], tokenizer, max_length: int) -> dict[str, np.ndarray]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask`` (the trained segments' tokens
    and the EOS)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token: SFT targets need one to end responses")
    seqs, masks = [], []
    for i, row in enumerate(rows):
        if "prompt" not in row or "response" not in row:
            raise ValueError(f"SFT row {i} needs 'prompt' and 'response' columns, has {sorted(row)}")
        text = render_prompt(row["prompt"], tokenizer, tools=row.get("tools") or None)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        seq, mask = list(prompt), [0] * len(prompt)
        for text, trained in response_segments(row["response"], i):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            seq += ids
            mask += [int(trained)] * len(ids)
        seqs.append((seq + [eos])[:max_length])
        masks.append((mask + [1])[:max_length])
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
    """Rows with ``prompt`` and ``response`` (and ``tools`` where a row has them) from parquet/jsonl
    files or folders."""
    import datasets

    from arlopti_jax.tasks.data import DATA_SUFFIXES, resolve_data_files

    rows = []
    for path in resolve_data_files(paths):
        ds = datasets.load_dataset(DATA_SUFFIXES[path.suffix], data_files=str(path), split="train")
        for i, row in enumerate(ds):
            for col in ("prompt", "response"):
                if row.get(col) is None:
                    raise ValueError(f"{path}: row {i}: missing column {col!r}")
            rows.append({"prompt": row["prompt"], "response": row["response"],
                         **({"tools": row["tools"]} if row.get("tools") else {})})
    return rows


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float, grad_clip: float):
    """SFT's AdamW (beta2 0.95; linear warm-up over ``warmup`` steps, then cosine decay to lr / 10
    at ``steps``), built by the trainer's ``algos.make_optimizer``."""
    return algos.make_optimizer(algos.OptimConfig(
        lr=lr, b1=0.9, b2=0.95, weight_decay=weight_decay, eps=1e-8, grad_clip=grad_clip, schedule="warmup_cosine",
        warmup_steps=max(1, warmup), total_steps=max(steps, warmup + 1), min_lr_ratio=0.1))


def make_sft_step(model_cfg: ModelConfig, optimizer, mesh, rules=shd.DEFAULT_RULES, state_shardings=None):
    """The jitted SFT step (params and optimizer state donated). ``state_shardings``: the optimizer
    state's, in and out (default: as XLA lays the output out, which on several devices may differ
    from ``optimizer.init``'s and compile the step once more for its second call)."""
    p_shard = param_shardings(model_cfg, mesh, rules)
    b_shard = shd.batch_sharding(mesh)

    def loss_fn(params, batch):
        lp, _ = token_logprobs(model_cfg, params, batch["input_ids"], batch["attention_mask"])
        mask = batch["loss_mask"].astype(jnp.float32)
        return -jnp.sum(lp * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    @functools.partial(jax.jit, donate_argnums=(0, 1), in_shardings=(p_shard, state_shardings, b_shard),
                       out_shardings=(p_shard, state_shardings, None))
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


def width_buckets(needs: np.ndarray, rows: int, count: int = 2) -> tuple[int, ...]:
    """At most ``count`` batch widths, the largest ``needs.max()``, chosen so a batch trimmed to the
    smallest of them holding its longest row (``needs``: per batch, that row's length rounded up to
    16 tokens) pays the least padding over the schedule (``rows`` rows per batch): every width is
    one compiled step program, so a run compiles at most ``count`` of them. Exact, by dynamic
    programming over the distinct needs (each bucket is one of them)."""
    widths, counts = np.unique(np.asarray(needs, np.int64), return_counts=True)
    m = len(widths)
    count = max(1, min(count, m))
    # cost[i][j]: tokens of the batches needing widths[i..j], all trimmed to widths[j]
    totals = np.concatenate([[0], np.cumsum(counts)])
    cost = lambda i, j: int(totals[j + 1] - totals[i]) * int(widths[j]) * rows
    inf = float("inf")
    best = [[inf] * m for _ in range(count + 1)]  # best[k][j]: needs 0..j served by k buckets, the top widths[j]
    back = [[-1] * m for _ in range(count + 1)]
    for j in range(m):
        best[1][j] = cost(0, j)
    for k in range(2, count + 1):
        for j in range(m):
            for i in range(j):  # the bucket below widths[j] is widths[i]
                c = best[k - 1][i] + cost(i + 1, j)
                if c < best[k][j]:
                    best[k][j], back[k][j] = c, i
    k = min(range(1, count + 1), key=lambda k: best[k][m - 1])  # fewer buckets where they do as well
    out, j = [], m - 1
    while j >= 0 and k >= 1:
        out.append(int(widths[j]))
        j, k = back[k][j], k - 1
    return tuple(sorted(out))


def batch_widths(data: dict[str, np.ndarray], schedule: list[np.ndarray], programs: int = 2) -> list[int]:
    """Each scheduled batch's width: its longest row rounded up to 16 tokens (at most the data's
    width), raised to the smallest of ``width_buckets`` holding it (at most ``programs`` widths)."""
    lengths, limit = data["attention_mask"].sum(1), data["input_ids"].shape[1]
    needs = np.array([min(limit, -(-int(lengths[idx].max()) // 16) * 16) for idx in schedule], np.int64)
    if not len(needs):
        return []
    buckets = np.array(width_buckets(needs, max(len(idx) for idx in schedule), programs))
    return [int(buckets[np.searchsorted(buckets, need)]) for need in needs]


def run_sft(model_cfg: ModelConfig, params, tokenizer, rows: list[dict], *, steps: int, batch: int,
            lr: float, warmup: int = 20, weight_decay: float = 0.0, grad_clip: float = 1.0,
            max_length: int = 1024, seed: int = 0, mesh=None, desc: str = "sft") -> tuple[dict, list[float]]:
    """Train ``params`` on ``rows`` in length-grouped batches (``batch_schedule``), each trimmed
    to one of at most two widths (``batch_widths``: two compiled step programs); returns the new
    params and the loss per step."""
    data = tokenize_pairs(rows, tokenizer, max_length)
    schedule = batch_schedule(data["attention_mask"].sum(1), batch, steps, seed)
    return train_sft(model_cfg, params, data, schedule, lr=lr, warmup=warmup, weight_decay=weight_decay,
                     grad_clip=grad_clip, mesh=mesh, desc=desc)


def train_sft(model_cfg: ModelConfig, params, data: dict[str, np.ndarray], schedule: list[np.ndarray], *,
              lr: float, warmup: int = 20, weight_decay: float = 0.0, grad_clip: float = 1.0, mesh=None,
              desc: str = "sft") -> tuple[dict, list[float]]:
    """``run_sft`` on rows already tokenized (``tokenize_pairs``) and scheduled (``batch_schedule``),
    each batch trimmed to its ``batch_widths`` width (padding never changes the loss: the masks)."""
    mesh = mesh if mesh is not None else shd.make_mesh({"fsdp": -1})
    steps, widths = len(schedule), batch_widths(data, schedule)
    optimizer = make_optimizer(lr, steps, warmup, weight_decay, grad_clip)
    with shd.activate(mesh):
        opt_state = jax.jit(optimizer.init)(params)
        # the state keeps its layout from step to step: one program per batch width
        step = make_sft_step(model_cfg, optimizer, mesh, state_shardings=jax.tree.map(lambda x: x.sharding, opt_state))
        losses = []
        bar = tqdm(schedule, desc=desc, disable=jax.process_index() != 0)
        for idx, width in zip(bar, widths):
            # placed explicitly: a multi-process run (process 0 building the start point on its own
            # devices) may not pass host arrays to a jit with shardings
            mb = jax.device_put({k: v[idx, :width] for k, v in data.items()}, shd.batch_sharding(mesh))
            params, opt_state, loss = step(params, opt_state, mb)
            losses.append(float(loss))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return params, losses
