"""Packed rows: the plan covers every token once, and the packed update and log-prob passes
equal the dense, unpacked computation (loss, gradients, metrics) for every aggregation mode,
with Lopti's masks, the KL term and the entropy bonus."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from arlopti_jax.runtime import sharding as shd
from arlopti_jax.algos import (AGG_MODES, LossConfig, aggregation_weights, init_opt_state, make_compute_logprobs,
                               make_train_step, policy_loss)
from arlopti_jax.algos import packing
from arlopti_jax.models import (ModelConfig, init_params, packed_hidden_states, target_logprobs, token_logprobs,
                                unembed_matrix)

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
MESH = shd.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
TEMP = 0.8


def dense_batch(rows=12, width=40, seed=0):
    """Left-padded prompts (2-9 tokens) and right-padded responses (1-24 tokens), as the sampler's."""
    rng = np.random.default_rng(seed)
    prompt_w = 10
    ids = rng.integers(3, CFG.vocab_size, (rows, width)).astype(np.int32)
    attn = np.zeros((rows, width), np.int32)
    resp = np.zeros((rows, width), np.float32)
    for r in range(rows):
        p, n = int(rng.integers(2, prompt_w)), int(rng.integers(1, width - prompt_w + 1))
        attn[r, prompt_w - p:prompt_w + n] = 1
        resp[r, prompt_w:prompt_w + n] = 1
    ids = np.where(attn > 0, ids, 0).astype(np.int32)
    old = np.where(resp > 0, np.log(rng.uniform(0.05, 1.0, resp.shape)), 0).astype(np.float32)
    ref = np.where(resp > 0, old + rng.normal(0, 0.3, resp.shape), 0).astype(np.float32)
    adv = np.where(resp > 0, rng.normal(0, 1, (rows, 1)), 0).astype(np.float32)
    lopti_low = (resp * (np.exp(old) < 0.5)).astype(np.float32)
    return dict(input_ids=ids, attention_mask=attn, response_mask=resp, old_logprobs=old, ref_logprobs=ref,
                advantages=adv * lopti_low, loss_mask=lopti_low)


@functools.cache
def params():
    return jax.device_get(init_params(CFG, jax.random.key(3), MESH))


def test_plan_covers_every_token_and_target_once():
    batch = dense_batch(rows=30, width=120, seed=1)
    rows = np.arange(30)
    shapes = packing.shapes_for(256, 120, row_lengths=3, fills=3)
    assert shapes.row_lengths == (64, 128, 256)
    plan = packing.plan_micro_batches(batch["attention_mask"], batch["response_mask"], rows,
                                      tokens_per_device=256, num_devices=2, shapes=shapes)
    spans = packing.sequence_spans(batch["attention_mask"])
    lengths = spans[:, 1] - spans[:, 0]
    src = np.concatenate([mb.token_src[mb.token_src >= 0] for mb in plan])
    tgt = np.concatenate([mb.target_src[mb.target_src >= 0] for mb in plan])
    assert sorted(src) == sorted(np.flatnonzero(batch["attention_mask"].reshape(-1)))
    assert sorted(tgt) == sorted(np.flatnonzero(batch["response_mask"].reshape(-1)))
    assert len({mb.row_length for mb in plan}) > 1  # long rows first, then shorter ones
    for j, mb in enumerate(plan):
        assert (mb.row_length, mb.token_src.shape[0] // 2) in shapes.all() and mb.token_src.shape[0] % 2 == 0
        longest = max(lengths[np.unique(mb.token_src[mb.token_src >= 0] // 120)])
        assert longest <= mb.row_length
        if j < len(plan) - 1:  # full micro-batches: 256 // S rows per device; the last one smaller
            assert mb.token_src.shape[0] == 2 * (256 // mb.row_length)
        else:
            assert mb.token_src.size <= 2 * 256
        arrays = packing.gather(mb, {"input_ids": batch["input_ids"]}, {"target_ids": batch["input_ids"]})
        for r in range(mb.token_src.shape[0]):  # positions restart per segment
            for seg in range(1, mb.segment_ids[r].max() + 1):
                slots = np.flatnonzero(mb.segment_ids[r] == seg)
                assert np.array_equal(mb.positions[r, slots], np.arange(len(slots)))
                assert np.all(np.diff(slots) == 1)
        per_device = mb.token_src.shape[0] // 2
        assert mb.target_pos.shape == (2, per_device * mb.row_length)  # a target slot per token slot
        for d in range(2):  # each device's list: the slot before each target (in its own rows) predicts it
            used = arrays["target_mask"][d] > 0
            own_ids = arrays["input_ids"][d * per_device:(d + 1) * per_device].reshape(-1)
            assert np.array_equal(own_ids[mb.target_pos[d, used] + 1], arrays["target_ids"][d, used])
            assert used[:used.sum()].all()  # active targets first
    assert packing.summary(plan).padding < 0.25


def test_row_length_weighs_padding_against_attention():
    # 40 sequences of 150-170 tokens, a budget of 1024 per device: rows of 192 (the shortest that
    # holds one) hold one sequence each (about 17% padding), rows of 320 two, of 512 three
    rng = np.random.default_rng(0)
    lengths = rng.integers(150, 171, 40)
    attn = np.zeros((40, 200), np.int32)
    for i, n in enumerate(lengths):
        attn[i, 200 - n:] = 1
    resp = attn.copy()
    resp[:, :180] = 0
    shapes = packing.Shapes(1024, (192, 320, 512, 1024), fills=3)
    plan = lambda cost: packing.plan_micro_batches(attn, resp, np.arange(40), tokens_per_device=1024,
                                                   num_devices=1, attention_cost=cost, shapes=shapes)
    free = plan(0.0)  # attention free: the row length that wastes least
    assert free[0].row_length >= 320 and packing.summary(free).padding < 0.05
    dear = plan(1.0)  # attention dearer than everything else: one sequence per shortest row
    assert {mb.row_length for mb in dear} == {192} and packing.summary(dear).padding > 0.15
    for p in (free, dear):
        assert sorted(np.concatenate([mb.token_src[mb.token_src >= 0] for mb in p])) == \
            sorted(np.flatnonzero(attn.reshape(-1)))


def test_shape_set():
    shapes = packing.shapes_for(9728, 304)  # the embedded default: 32 rows of 256 + 48 tokens
    assert shapes.row_lengths == (320, 640)  # twice 304, rounded up to 64; then half of it
    assert shapes.rows_per_device(640) == (2, 4, 8, 15) and shapes.rows_per_device(320) == (4, 8, 15, 30)
    assert len(shapes.all()) == 8
    assert packing.shapes_for(4608).row_lengths == (2304, 4608)  # at most the budget
    assert packing.shapes_for(100, 40, row_lengths=3).row_lengths == (64, 100)  # down to 64, no repeats
    assert packing.shapes_for(4608, 600, row_lengths=1, fills=1).all() == [(1216, 3)]  # 1,200 rounded up
    with pytest.raises(ValueError, match="do not fit"):
        packing.shapes_for(256, 300)


@pytest.mark.parametrize("shared", [False, True])
def test_every_plan_takes_its_shape_from_the_set(shared):
    """Over mini-batches of very different lengths (short and long responses, short and long
    prompts, groups of 8 sharing a prompt), every micro-batch has a shape of ``Shapes.all()``
    with a target slot per token slot: the programs are known before the first batch."""
    rng = np.random.default_rng(7)
    shapes = packing.shapes_for(2048, 256, row_lengths=2, fills=3)
    seen = set()
    for trial in range(40):
        prompt = int(rng.integers(8, 128))
        scale = rng.choice([4, 32, 128])
        responses = np.minimum(rng.geometric(1 / scale, 32), 128)
        attn = np.zeros((32, 256), np.int32)
        attn[:, 128 - prompt:128] = 1
        for i, r in enumerate(responses):
            attn[i, 128:128 + r] = 1
        resp = attn.copy()
        resp[:, :128] = 0
        ids = np.repeat(rng.integers(1, 90, (4, 256)), 8, axis=0) * attn
        plan = packing.plan_micro_batches(attn, resp, rng.permutation(32)[:16], tokens_per_device=2048,
                                          num_devices=2, attention_cost=0.002, input_ids=ids if shared else None,
                                          shapes=shapes)
        for mb in plan:
            rows = mb.token_src.shape[0] // 2
            assert (mb.row_length, rows) in shapes.all()
            assert mb.target_pos.shape == (2, rows * mb.row_length)
            seen.add((mb.row_length, rows))
    assert len(seen) > 2  # the lengths did reach several shapes of the set


def test_plan_errors_name_the_row():
    batch = dense_batch(rows=4)
    with pytest.raises(ValueError, match="batch row 0 holds .*max_tokens_per_micro_batch=8"):
        packing.plan_micro_batches(batch["attention_mask"], batch["response_mask"], np.arange(4),
                                   tokens_per_device=8, num_devices=1)
    holes = batch["attention_mask"].copy()
    holes[2, np.flatnonzero(holes[2])[3]] = 0
    with pytest.raises(ValueError, match="batch row 2: attention_mask has holes"):
        packing.plan_micro_batches(holes, batch["response_mask"], np.arange(4), tokens_per_device=64, num_devices=1)


@pytest.mark.parametrize("tokens", [512, 48], ids=["one-micro-batch", "many"])
def test_packed_logprobs_equal_dense(tokens):
    batch = dense_batch()
    plan = packing.plan_micro_batches(batch["attention_mask"], batch["response_mask"], np.arange(12),
                                      tokens_per_device=tokens, num_devices=1)
    assert (len(plan) == 1) == (tokens == 512)
    want, _ = token_logprobs(CFG, params(), batch["input_ids"], batch["attention_mask"], temperature=TEMP)
    want = np.asarray(want) * batch["response_mask"]
    got = make_compute_logprobs(CFG, MESH, temperature=TEMP, tokens_per_device=tokens)(params(), batch)
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_entropy_without_coefficient_has_no_gradient_path():
    batch = dense_batch()
    mb = packing.plan_micro_batches(batch["attention_mask"], batch["response_mask"], np.arange(12),
                                    tokens_per_device=512, num_devices=1)[0]
    a = {k: jnp.asarray(v) for k, v in packing.gather(mb, {"input_ids": batch["input_ids"]},
                                                       {"target_ids": batch["input_ids"]}).items()}

    def entropy_sum(prm, entropy_grad):
        h = packed_hidden_states(CFG, prm, a["input_ids"], a["positions"], a["segment_ids"])
        return target_logprobs(unembed_matrix(CFG, prm), h, a["target_pos"], a["target_ids"], a["target_mask"],
                               TEMP, 16, entropy_grad=entropy_grad)[1].sum()

    grad = jax.jit(jax.grad(entropy_sum), static_argnums=1)  # compiled: op-by-op it took a minute
    with_grad, without = grad(params(), True), grad(params(), False)
    assert optax.tree.norm(with_grad) > 1e-3
    assert optax.tree.norm(without) == 0.0
    value = jax.jit(entropy_sum, static_argnums=1)
    assert float(value(params(), False)) == pytest.approx(float(value(params(), True)))


def dense_loss_and_grad(cfg: LossConfig, batch):
    """The unpacked reference: dense forward over [B, T], the same per-token loss formula."""
    def loss(prm):
        logp, ent = token_logprobs(CFG, prm, batch["input_ids"], batch["attention_mask"], temperature=cfg.temperature)
        tokens = {k: batch[k] for k in ("advantages", "old_logprobs", "response_mask", "loss_mask", "ref_logprobs")}
        tokens["agg_weight"] = aggregation_weights(batch["response_mask"], cfg.agg)
        return policy_loss(cfg, logp, ent, tokens)

    (value, stats), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params())
    return float(value), jax.device_get(stats), jax.device_get(grads)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("tokens", [512, 48], ids=["one-row", "many-rows"])
def test_packed_step_equals_dense_unpacked_computation(agg, tokens):
    cfg = LossConfig(kl_coef=0.3, kl_type="low_var_kl", entropy_coef=0.05, agg=agg, temperature=TEMP)
    batch = dense_batch()
    want_loss, want_stats, want_grads = dense_loss_and_grad(cfg, batch)
    sgd = optax.sgd(1.0)
    step = make_train_step(CFG, cfg, sgd, MESH, tokens_per_device=tokens)
    p0 = jax.device_put(params())
    new, _, metrics = step(p0, init_opt_state(sgd, CFG, p0, MESH), batch)
    got_grads = jax.tree.map(lambda a, b: np.asarray(b) - np.asarray(a), jax.device_get(new), params())
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, atol=1e-5 * scale)  # SGD(1): old - new = gradient
    np.testing.assert_allclose(float(metrics["loss"]), want_loss, rtol=1e-5)
    n_tok = batch["response_mask"].sum()
    for name in ("pg_loss", "kl_loss", "entropy_loss"):
        np.testing.assert_allclose(float(metrics[name]), float(want_stats[name]), rtol=1e-5)
    for name in ("entropy", "kl", "ratio_mean"):
        np.testing.assert_allclose(float(metrics[name]), float(want_stats[f"{name}_sum" if name != "ratio_mean"
                                                                           else "ratio_sum"]) / n_tok, rtol=1e-5)


@pytest.mark.parametrize("entropy_grad, softcap", [(True, None), (False, None), (True, 2.0)],
                         ids=["entropy_grad", "no_entropy_grad", "softcap"])
def test_chunked_vocabulary_projection_equals_direct(entropy_grad, softcap, monkeypatch):
    """Large vocabularies project the targets a chunk at a time with a hand-written backward pass
    (one [D, V] gradient buffer, not one per chunk): values and gradients equal the direct
    projection's autodiff, with inactive targets and a chunk without any active target, and with
    the logits soft-capped (Gemma's final_logit_softcapping) before the temperature."""
    from arlopti_jax.models import policy

    rng = np.random.default_rng(0)
    devices, rows, slots, dm, vocab, k = 2, 4, 24, 16, 50, 40  # 2 rows per device, chunks of 2 x 4 targets
    w = jnp.asarray(rng.normal(size=(dm, vocab)), jnp.float32)
    hidden = jnp.asarray(rng.normal(size=(rows, slots, dm)), jnp.float32)
    pos = jnp.asarray(rng.integers(0, rows // devices * slots, size=(devices, k)), jnp.int32)
    ids = jnp.asarray(rng.integers(0, vocab, size=(devices, k)), jnp.int32)
    active = np.ones((devices, k), np.int32)
    active[:, 30:] = 0  # the last targets: one chunk entirely inactive, one partly
    active = jnp.asarray(active)
    a, b = (jnp.asarray(rng.normal(size=(devices, k)), jnp.float32) for _ in range(2))

    def objective(w, hidden):
        lp, ent = policy.target_logprobs(w, hidden, pos, ids, active, 0.7, 4, entropy_grad=entropy_grad,
                                         softcap=softcap)
        return jnp.sum(lp * a + ent * b)

    def run(direct_bytes):
        monkeypatch.setattr(policy, "DIRECT_LOGITS_BYTES", direct_bytes)
        return jax.jit(jax.value_and_grad(objective, argnums=(0, 1)))(w, hidden)

    (want, want_grads), (got, got_grads) = run(1 << 40), run(0)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for g, ref in zip(got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), atol=1e-5 * float(np.abs(ref).max()))
