"""The SFT warm start's batching: length-grouped batches that still see every row once per epoch,
and trimming a right-padded batch to its longest row, which must not change the loss."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlopti_jax.config.cli import STARTUP_CHECK_ENV
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.models import ModelConfig, init_params
from arlopti_jax.finetune.supervised import batch_schedule, make_optimizer, make_sft_step


def test_batches_cover_each_row_once_per_epoch_and_group_lengths():
    rng = np.random.default_rng(3)
    lengths = rng.integers(20, 200, 1000)
    batch, pool = 16, 8
    per_epoch = 1000 // batch  # 62 batches; 8 rows wait for the next epoch
    schedule = batch_schedule(lengths, batch, 2 * per_epoch, seed=5, pool=pool)
    assert len(schedule) == 2 * per_epoch and all(len(b) == batch for b in schedule)
    for epoch in (schedule[:per_epoch], schedule[per_epoch:]):
        rows = np.concatenate(epoch)
        assert len(set(rows.tolist())) == len(rows) == per_epoch * batch  # no row twice in an epoch
    # a batch is a slice of a length-sorted pool: its spread of lengths is far below a random batch's
    spread = np.mean([np.ptp(lengths[b]) for b in schedule])
    random_spread = np.mean([np.ptp(lengths[rng.permutation(1000)[:batch]]) for _ in range(200)])
    assert spread < 0.35 * random_spread, (spread, random_spread)
    # the padding a batch trimmed to its longest row pays, against random batches
    pad = lambda bs: 1 - sum(lengths[b].sum() for b in bs) / sum(len(b) * lengths[b].max() for b in bs)
    assert pad(schedule) < 0.5 * pad([rng.permutation(1000)[:batch] for _ in range(200)])
    # deterministic in its seed, and the order differs between seeds
    again = batch_schedule(lengths, batch, 2 * per_epoch, seed=5, pool=pool)
    assert all(np.array_equal(a, b) for a, b in zip(schedule, again))
    other = batch_schedule(lengths, batch, per_epoch, seed=6, pool=pool)
    assert not all(np.array_equal(a, b) for a, b in zip(schedule, other))


def test_trimmed_batch_has_the_loss_of_the_full_padded_batch():
    cfg = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, tie_word_embeddings=True, qkv_bias=True)
    mesh = shd.make_mesh({"fsdp": -1})
    rng = np.random.default_rng(0)
    lengths, prompt, width = np.array([9, 14, 11, 16, 7, 13, 10, 12]), 5, 48
    ids = np.full((8, width), 1, np.int32)
    attn, loss_mask = np.zeros((8, width), np.int32), np.zeros((8, width), np.int32)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(2, 128, n)
        attn[i, :n] = 1
        loss_mask[i, prompt:n] = 1
    full = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask}
    trimmed = {k: v[:, :16] for k, v in full.items()}
    opt = make_optimizer(1e-3, 10, 1, 0.0, 1.0)
    losses = []
    with shd.activate(mesh):
        step = make_sft_step(cfg, opt, mesh)
        for batch in (full, trimmed):
            params = init_params(cfg, jax.random.key(1), mesh)
            _, _, loss = step(params, jax.jit(opt.init)(params), jax.device_put(batch, shd.batch_sharding(mesh)))
            losses.append(float(loss))
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    assert 3.0 < losses[0] < 6.0  # about log(128) = 4.85 for a random model: the loss is the masked mean


@pytest.mark.parametrize("check", [False, True], ids=["run", "startup_check"])
def test_sft_data_errors_stop_at_start_up_in_one_line(start_point, tmp_path, check):
    """A data file without a ``response`` column, and fewer rows than one batch, stop
    ``python -m arlopti_jax.sft`` with one ``error:`` line naming the field (exit 2, no traceback),
    under ARLOPTI_STARTUP_CHECK=1 too, before the model is loaded."""
    def error_line(files: Path, *extra: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "arlopti_jax.sft", f"--config.model.path={start_point / 'model'}",
                               f"--config.data.files={files}", f"--config.out_dir={tmp_path / 'out'}", *extra],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, STARTUP_CHECK_ENV: "1" if check else "0"})
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert "start-up check passed" not in proc.stdout and not (tmp_path / "out").exists()
        return errors[0]

    no_response = tmp_path / "no_response.jsonl"
    no_response.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "a"}) + "\n" for i in range(20)))
    line = error_line(no_response)
    assert line.startswith("error: config.data.files:") and str(no_response) in line and "'response'" in line

    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"prompt": f"q{i}", "response": "a"}) + "\n" for i in range(3)))
    line = error_line(few, "--config.train.batch=16")
    assert line.startswith("error: config.train.batch=16:") and str(few) in line and "got 3" in line


def test_sft_optimizer_is_the_trainers_with_sfts_schedule():
    """``make_optimizer`` is ``algos.make_optimizer`` with SFT's settings: the updates of AdamW
    (beta2 0.95) after a global-norm clip, at a linear warm-up then a cosine decay to lr / 10,
    written here with optax directly."""
    import optax

    from arlopti_jax.algos import current_lr

    lr, steps, warmup, wd, clip = 3e-3, 12, 3, 0.01, 0.5
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, lr * 0.1)
    want_opt = optax.chain(optax.clip_by_global_norm(clip), optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=wd))
    got_opt = make_optimizer(lr, steps, warmup, wd, clip)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((4, 5)), jnp.float32)}
    want, got = params, params
    want_state, got_state = want_opt.init(want), got_opt.init(got)
    for step in range(steps + 2):
        grads = {"w": jnp.asarray(rng.standard_normal((4, 5)), jnp.float32)}
        updates, want_state = want_opt.update(grads, want_state, want)
        want = optax.apply_updates(want, updates)
        updates, got_state = got_opt.update(grads, got_state, got)
        got = optax.apply_updates(got, updates)
        np.testing.assert_allclose(float(current_lr(got_state)), float(schedule(step)), rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(want["w"]), rtol=1e-6, atol=1e-8)


def test_width_buckets_pay_the_least_padding_of_any_choice():
    """``width_buckets`` against brute force over every set of at most ``count`` widths drawn from the
    needs (the largest always among them): the same padded tokens, and never more buckets than asked."""
    import itertools

    from arlopti_jax.finetune.supervised import width_buckets

    rng = np.random.default_rng(7)
    for trial in range(30):
        needs = 16 * rng.integers(1, 12, rng.integers(1, 40))
        rows, count = int(rng.integers(1, 9)), int(rng.integers(1, 4))
        tokens = lambda b: rows * sum(min(w for w in b if w >= n) for n in needs)
        top, others = int(needs.max()), sorted(set(needs.tolist()) - {int(needs.max())})
        best = min(tokens((top,) + c) for k in range(count) for c in itertools.combinations(others, k))
        got = width_buckets(needs, rows, count)
        assert max(got) == top and len(got) <= count and tokens(got) == best, (needs, rows, count, got)
    assert width_buckets(np.array([32, 32, 64]), 4, 2) == (32, 64)
    assert width_buckets(np.array([48, 48, 48]), 4, 2) == (48,)  # one width met: one program


def test_sft_run_compiles_two_step_programs_and_keeps_each_batchs_loss():
    """``train_sft`` over rows of varied lengths (batches needing 6 widths when trimmed to their longest
    row) compiles at most 2 step programs (counted from JAX's compile events), and every step's loss
    and the final weights equal those of the same batches trimmed each to its own width (the
    previous behaviour, 6 programs): padding is masked out of the loss."""
    from arlopti_jax.finetune.supervised import batch_widths, train_sft

    cfg = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, tie_word_embeddings=True, qkv_bias=True)
    mesh = shd.make_mesh({"fsdp": -1})
    rng = np.random.default_rng(11)
    count, width, batch = 96, 96, 8
    lengths = rng.integers(12, width + 1, count)
    data = {k: np.zeros((count, width), np.int32) for k in ("input_ids", "attention_mask", "loss_mask")}
    data["input_ids"][:] = 1
    for i, n in enumerate(lengths):
        data["input_ids"][i, :n] = rng.integers(2, 128, n)
        data["attention_mask"][i, :n] = 1
        data["loss_mask"][i, n // 3:n] = 1
    schedule = batch_schedule(lengths, batch, 14, seed=2, pool=12)  # an epoch sorted by length: 12 batches
    own = [-(-int(lengths[idx].max()) // 16) * 16 for idx in schedule]
    assert len(set(own)) >= 5  # the batches' own widths vary
    assert len(set(batch_widths(data, schedule))) == 2

    compiles = []

    def listen(event, duration, **meta):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(meta.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        params, losses = train_sft(cfg, init_params(cfg, jax.random.key(4), mesh), data, schedule, lr=3e-3, warmup=2,
                                   mesh=mesh, desc="bucketed")
        bucketed_steps = compiles.count("jit(step)")
        # the reference: each batch trimmed to its own width, with SFT's optimizer and step
        opt = make_optimizer(3e-3, len(schedule), 2, 0.0, 1.0)
        with shd.activate(mesh):
            ref = init_params(cfg, jax.random.key(4), mesh)
            state, step = jax.jit(opt.init)(ref), make_sft_step(cfg, opt, mesh)
            ref_losses = []
            for idx, w in zip(schedule, own):
                mb = jax.device_put({k: v[idx, :w] for k, v in data.items()}, shd.batch_sharding(mesh))
                ref, state, loss = step(ref, state, mb)
                ref_losses.append(float(loss))
        own_steps = compiles.count("jit(step)") - bucketed_steps
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert bucketed_steps <= 2 and own_steps >= len(set(own))
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    # Adam scales a near-zero gradient's float32 rounding up to a step of about lr: atol 1% of lr
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=3e-5),
                 params, ref)
    assert losses[-1] < losses[0]  # it trains
