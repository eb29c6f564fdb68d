"""The jitted train step on a tiny random policy: gradient accumulation, sharding, Lopti's
two passes, the sign of the update, the KL path, compile-once and the quartile gradients.

Equivalence tests use plain SGD (lr 1) through the same step so that the parameter change
IS the gradient: AdamW's first update is ~lr * sign(g), which turns float noise in
gradients that are mathematically zero (e.g. the key bias: softmax is shift-invariant) into
lr-sized differences and hides real gradient differences behind the normalisation.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from arlopti_jax.runtime import sharding as shd
from arlopti_jax.algos import (AdvantageConfig, LoptiConfig, LossConfig, OptimConfig, TokenWeightConfig, current_lr,
                               init_opt_state, make_compute_logprobs, make_optimizer, make_quartile_grad_norms,
                               make_schedule, make_train_step, prepare_updates, update_on_batch)
from arlopti_jax.algos import packing
from arlopti_jax.models import ModelConfig, abstract_params, logits, param_shardings
from test_advantages import np_grpo

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
ROWS, T = 16, 14
NO_KL = LossConfig(kl_coef=0.0)
ADAM = OptimConfig(lr=1e-3, weight_decay=0.0)
SGD = optax.sgd(1.0)


@functools.cache
def mesh_of(shape: tuple):
    shape = dict(shape)
    return shd.make_mesh(shape, devices=jax.devices()[:1] if shape == {"fsdp": 1} else None)


SINGLE = (("fsdp", 1),)


@functools.cache
def step_for(mesh_shape=SINGLE, tokens=256, optim="sgd", loss=NO_KL):
    """A train step packing ``tokens`` per device and micro-batch: 256 holds a whole 16-row
    batch in one micro-batch; 16 splits it into many."""
    opt = SGD if optim == "sgd" else make_optimizer(ADAM)
    return make_train_step(CFG, loss, opt, mesh_of(mesh_shape), tokens_per_device=tokens), opt


@functools.cache
def logprobs_fn(mesh_shape=SINGLE):
    return make_compute_logprobs(CFG, mesh_of(mesh_shape), tokens_per_device=64)


@functools.cache
def _host_params(seed):
    """Random params drawn in numpy (no init compile): N(0, 0.02) weights, norm scales ~ 1."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        noise = rng.normal(0.0, 0.02, leaf.shape).astype(np.float32)
        return noise * 5 + 1.0 if "scale" in jax.tree_util.keystr(path) else noise

    return jax.tree_util.tree_map_with_path(draw, abstract_params(CFG))


def params_on(mesh_shape=SINGLE, seed=0):
    """Fresh device buffers (the step donates them) of the seed's random params."""
    return jax.device_put(_host_params(seed), param_shardings(CFG, mesh_of(mesh_shape)))


def host(tree):
    return jax.tree.map(lambda x: np.array(x, np.float64), jax.device_get(tree))


@functools.cache
def rollout(rows=ROWS, seed=0):
    """Left-padded prompts and right-padded responses of very different lengths: rows
    0, 4, 8, 12 (micro-batch 0 of 4) have long responses, the others 1-3 tokens."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, CFG.vocab_size, (rows, T)).astype(np.int32)
    attn = np.zeros((rows, T), np.int32)
    resp = np.zeros((rows, T), np.float32)
    for r in range(rows):
        pad, prompt = r % 3, 3 + r % 2
        n = 8 if r % 4 == 0 else 1 + r % 3
        attn[r, pad:pad + prompt + n] = 1
        resp[r, pad + prompt:pad + prompt + n] = 1
        ids[r, :pad] = 0
    rewards = rng.choice([-1.0, 0.5, 3.0], rows).astype(np.float32)
    group_ids = np.repeat(np.arange(rows // 4), 4).astype(np.int32)
    old = logprobs_fn()(params_on(), {"input_ids": ids, "attention_mask": attn, "response_mask": resp})
    return dict(input_ids=ids, attention_mask=attn, response_mask=resp, old_logprobs=old), rewards, group_ids


def train_batch(rows=ROWS):
    batch, rewards, gids = rollout(rows)
    adv = np_grpo(rewards, gids, batch["response_mask"]).astype(np.float32)
    return {**batch, "advantages": adv, "loss_mask": batch["response_mask"]}


def sgd_delta(mesh_shape, tokens):
    """Parameter change of one SGD(lr=1) step = minus the mini-batch gradient."""
    step, opt = step_for(mesh_shape, tokens, "sgd")
    mesh = mesh_of(mesh_shape)
    p0 = params_on(mesh_shape)
    before = host(p0)
    p1, _, metrics = step(p0, init_opt_state(opt, CFG, p0, mesh), train_batch())
    return jax.tree.map(lambda a, b: a - b, host(p1), before), jax.device_get(metrics)


def max_diff(a, b):
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(x - y).max()), a, b)))


def naive_pg_grad(params, batch):
    """The token-mean PPO gradient at pi = pi_old from dense logits of the unpacked batch
    (ratio = 1, so d(-A ratio) = -A dlogp), independent of packing and micro-batching."""
    resp, adv = batch["response_mask"], batch["advantages"]

    def loss(prm):
        lg = jax.nn.log_softmax(logits(CFG, prm, batch["input_ids"], batch["attention_mask"]), -1)
        lp = jnp.take_along_axis(lg[:, :-1], batch["input_ids"][:, 1:, None], -1)[..., 0]
        return jnp.sum(-adv[:, 1:] * jnp.exp(lp - jax.lax.stop_gradient(lp)) * resp[:, 1:]) / resp.sum()

    return host(jax.tree.map(lambda g: -g, jax.jit(jax.grad(loss))(params)))


def test_accumulation_over_packed_micro_batches_equals_one_batch():
    step, _ = step_for(SINGLE, 16)
    batch = train_batch()
    plan = step.plan(batch, np.arange(ROWS))
    assert len(plan) >= 6 and len({mb.target_count for mb in plan}) > 2  # many, uneven micro-batches
    one, m1 = sgd_delta(SINGLE, 256)
    acc, m_many = sgd_delta(SINGLE, 16)
    # what the step reports it packed: the batch's real tokens, in the plan's slots and target lists
    stepped = step_for(SINGLE, 16, "sgd")[0]  # sgd_delta's step (the cache keys on the arguments as given)
    done = stepped.processed_since(len(stepped.processed) - 1)
    assert done.real_tokens == int(batch["attention_mask"].sum())
    assert done.slots == sum(r * s for r, s in (mb.token_src.shape for mb in plan))
    assert int(batch["response_mask"].sum()) <= done.target_slots == sum(mb.target_src.size for mb in plan)
    assert len(step_for(SINGLE, 256)[0].plan(batch, np.arange(ROWS))) == 1
    assert max_diff(one, acc) < 1e-6
    assert max_diff(one, naive_pg_grad(params_on(), batch)) < 1e-6
    for name in ("loss", "pg_loss", "entropy", "grad_norm", "n_tokens"):
        np.testing.assert_allclose(m_many[name], m1[name], rtol=1e-5)
    # the reported gradient norm is the norm of the update SGD applied
    norm = np.sqrt(sum(float((x ** 2).sum()) for x in jax.tree.leaves(one)))
    np.testing.assert_allclose(m1["grad_norm"], norm, rtol=1e-5)


@pytest.mark.parametrize("mesh_shape", [(("fsdp", 4), ("tensor", 2)), (("data", 2), ("fsdp", 4))],
                         ids=["fsdp4xtensor2", "data2xfsdp4"])
def test_sharded_step_equals_single_device(mesh_shape):
    single, m_single = sgd_delta(SINGLE, 256)
    sharded, m_sharded = sgd_delta(mesh_shape, 16)
    assert max_diff(single, sharded) < 1e-5
    np.testing.assert_allclose(m_sharded["loss"], m_single["loss"], rtol=1e-5)


def _adam_state(params):
    return init_opt_state(make_optimizer(ADAM), CFG, params, mesh_of(SINGLE))


def test_lopti_with_eta_above_every_prob_is_grpo_then_a_zero_gradient_pass():
    """eta = 1 > every pi_old: the low pass holds every token and is exactly the plain GRPO
    update; the high pass has no tokens, so its gradient is exactly zero. It does NOT leave
    the params unchanged in general: AdamW still moves them by the first moment carried from
    pass 1 (m / (sqrt(v) + eps) with zero new gradient), exactly as torch's AdamW in the
    reference. From a fresh optimizer state (m = v = 0, weight_decay = 0) it is a no-op."""
    step, opt = step_for(optim="adam")
    batch, rewards, gids = rollout()
    grpo = AdvantageConfig("grpo")
    plain = prepare_updates(grpo, TokenWeightConfig(), LoptiConfig(), rewards, gids, batch["response_mask"],
                            batch["old_logprobs"])
    lopti = prepare_updates(grpo, TokenWeightConfig(), LoptiConfig(True, 1.0), rewards, gids,
                            batch["response_mask"], batch["old_logprobs"])
    p_plain, _, _ = update_on_batch(step, params_on(), _adam_state(params_on()), batch, plain, 8)
    p1, s1, m1 = update_on_batch(step, params_on(), _adam_state(params_on()), batch, lopti[:1], 8)
    assert max_diff(host(p_plain), host(p1)) == 0.0

    p1_host, s1_host = jax.device_get(p1), jax.device_get(s1)
    p2, _, (m2,) = update_on_batch(step, p1, s1, batch, lopti[1:], 8)
    assert m2["grad_norm"] == 0.0 and m2["loss"] == 0.0 and m2["optimizer_steps"] == 2
    # what AdamW does with two zero-gradient steps from the pass-1 state
    @jax.jit
    def zero_grad_step(prm, state):
        updates, state = opt.update(jax.tree.map(jnp.zeros_like, prm), state, prm)
        return optax.apply_updates(prm, updates), state

    expect, state = p1_host, s1_host
    for _ in range(2):
        expect, state = zero_grad_step(expect, state)
    assert max_diff(host(p2), host(expect)) < 1e-7
    assert max_diff(host(p2), host(p1_host)) > 1e-4  # momentum really moves them
    # from a fresh optimizer state the empty pass is an exact no-op
    fresh = params_on()
    before = host(fresh)
    p3, _, _ = update_on_batch(step, fresh, _adam_state(params_on()), batch, lopti[1:], 8)
    assert max_diff(host(p3), before) == 0.0


def test_lopti_two_passes_equal_two_manual_sequential_updates():
    """Both passes over both mini-batches, low pass first, pi_old never recomputed: the same
    as four manual steps with numpy-built masks (the masks and weighted advantages are
    checked against numpy in test_token_weights; here the same float32 advantages are used
    on both sides, so the results must be bit-identical)."""
    step, _ = step_for(optim="adam")
    batch, rewards, gids = rollout()
    resp, old = batch["response_mask"], batch["old_logprobs"]
    p = np.exp(old.astype(np.float64))
    eta = float(np.median(p[resp > 0]))
    grpo, weights = AdvantageConfig("grpo"), TokenWeightConfig("ar", alpha=0.3)
    passes = prepare_updates(grpo, weights, LoptiConfig(True, eta), rewards, gids, resp, old)
    got, _, metrics = update_on_batch(step, params_on(), _adam_state(params_on()), batch, passes, 8)
    assert len(metrics) == 2 and all(m["optimizer_steps"] == 2 for m in metrics)

    (adv, _), = prepare_updates(grpo, weights, LoptiConfig(), rewards, gids, resp, old)
    low = ((p < eta) & (resp > 0)).astype(np.float32)
    assert 0 < low.sum() < resp.sum()
    params, state = params_on(), _adam_state(params_on())
    for mask in (low, resp - low):
        full = {**batch, "advantages": np.asarray(adv) * mask, "loss_mask": mask}
        for rows in (slice(0, 8), slice(8, 16)):
            params, state, _ = step(params, state, {k: v[rows] for k, v in full.items()})
    assert max_diff(host(got), host(params)) == 0.0


def logprobs_of(params, batch):
    """Log-probs of the batch's response tokens (0 elsewhere)."""
    return logprobs_fn()(params, batch)


def _response_logprob(params, batch, row):
    return float((logprobs_of(params, batch)[row] * batch["response_mask"][row]).sum())


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_update_moves_likelihood_in_the_sign_of_the_advantage(sign):
    step, _ = step_for(optim="adam")
    batch = train_batch()
    batch = {k: v[:8] for k, v in batch.items()}
    adv = np.zeros_like(batch["advantages"])
    adv[0] = sign * batch["response_mask"][0]
    batch["advantages"] = adv
    params = params_on()
    state = _adam_state(params)
    trace = [_response_logprob(params, batch, 0)]
    for _ in range(4):
        params, state, metrics = step(params, state, batch)
        trace.append(_response_logprob(params, batch, 0))
    assert sign * (trace[-1] - trace[0]) > 0.5, trace
    assert all(sign * (b - a) > 0 for a, b in zip(trace, trace[1:])), trace


def _random_batch(rng, rows=ROWS):
    """Prompts of 2-5 tokens and responses of 1-9, drawn afresh: each batch packs differently."""
    ids = rng.integers(3, CFG.vocab_size, (rows, T)).astype(np.int32)
    attn, resp = np.zeros((rows, T), np.int32), np.zeros((rows, T), np.float32)
    for r in range(rows):
        prompt, n = int(rng.integers(2, 6)), int(rng.integers(1, 10))
        attn[r, 5 - prompt:5 + n] = 1
        resp[r, 5:5 + n] = 1
    adv = (rng.normal(size=(rows, 1)) * resp).astype(np.float32)
    return dict(input_ids=ids * attn, attention_mask=attn, response_mask=resp, old_logprobs=-resp, advantages=adv,
                loss_mask=resp)


def test_every_program_compiles_with_the_first_batch():
    """The first batch compiles the update's programs for every shape of the step's set; batches of
    other lengths then compile nothing (counted from JAX's compile events), and each shape they
    use is one of the set."""
    from arlopti_jax.runtime import compiles

    log = compiles.watch()
    step = make_train_step(CFG, NO_KL, SGD, mesh_of(SINGLE), tokens_per_device=64,
                           shapes=packing.Shapes(64, (32, 64), fills=3))
    assert step.shapes.all() == [(32, 1), (32, 2), (64, 1)]
    rng = np.random.default_rng(5)
    params = params_on()
    state = SGD.init(params)
    params, state, _ = step(params, state, _random_batch(rng))
    mark = log.programs
    assert set(step.accumulate_programs.compiled) == {(1, 32), (2, 32), (1, 64)}
    used = set()
    for _ in range(6):
        batch = _random_batch(rng)
        used |= {mb.token_src.shape for mb in step.plan(batch, np.arange(ROWS))}
        params, state, _ = step(params, state, batch)
    assert log.programs == mark, [r.name for r in log.since(mark)]
    assert len(used) >= 2 and used <= set(step.accumulate_programs.compiled)


def test_kl_term_uses_ref_logprobs_and_pulls_towards_the_reference():
    loss = LossConfig(kl_coef=1.0, kl_type="low_var_kl")
    step, _ = step_for(optim="adam", loss=loss)
    batch = {k: v[:8] for k, v in train_batch().items()}
    batch["advantages"] = np.zeros_like(batch["advantages"])
    with pytest.raises(KeyError, match="ref_logprobs"):
        step(params_on(), _adam_state(params_on()), batch)
    ref = logprobs_of(params_on(seed=1), batch)
    batch["ref_logprobs"] = ref
    params = params_on()
    state = _adam_state(params)
    kls = []
    for _ in range(3):
        params, state, metrics = step(params, state, batch)
        kls.append(float(metrics["kl"]))
    d = np.clip(ref - batch["old_logprobs"].astype(np.float64), -5, 5)
    k3 = np.clip(np.exp(d) - d - 1, -10, 10)
    resp = batch["response_mask"]
    np.testing.assert_allclose(kls[0], (k3 * resp).sum() / resp.sum(), rtol=1e-4)  # first step: at old params
    assert kls[2] < kls[0]


def test_quartile_grad_norms_match_a_naive_per_quartile_loss():
    batch = {k: v[:8] for k, v in train_batch().items()}
    params = params_on()
    got = np.asarray(make_quartile_grad_norms(step_for(optim="adam")[0])(params, batch))

    resp, adv, old = batch["response_mask"], batch["advantages"], batch["old_logprobs"]
    p = np.exp(old.astype(np.float64))
    edges = np.quantile(p[resp > 0], [0.25, 0.5, 0.75])
    quart = np.digitize(p, edges)

    @jax.jit
    def naive_norm(params, mask):
        # ratio = exp(logp - old) with old = logp at these params: d(-A ratio) = -A dlogp
        def loss(prm):
            lg = jax.nn.log_softmax(logits(CFG, prm, batch["input_ids"], batch["attention_mask"]), -1)
            lp = jnp.take_along_axis(lg[:, :-1], batch["input_ids"][:, 1:, None], -1)[..., 0]
            ratio = jnp.exp(lp - old[:, 1:])
            return jnp.sum(-adv[:, 1:] * ratio * mask[:, 1:]) / resp.sum()
        return optax.tree.norm(jax.grad(loss)(params))

    want = [float(naive_norm(params, ((quart == q) & (resp > 0)).astype(np.float32))) for q in range(4)]
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert np.all(got > 0)


def test_shuffled_mini_batches_follow_the_keyed_permutation():
    step, _ = step_for(optim="adam")
    batch, rewards, gids = rollout()
    passes = prepare_updates(AdvantageConfig("grpo"), TokenWeightConfig(), LoptiConfig(), rewards, gids,
                             batch["response_mask"], batch["old_logprobs"])
    key = jax.random.key(7)
    got, _, _ = update_on_batch(step, params_on(), _adam_state(params_on()), batch, passes, 8, shuffle_key=key)
    order = np.asarray(jax.random.permutation(jax.random.fold_in(key, 0), ROWS))
    full = {**batch, "advantages": np.asarray(passes[0][0]), "loss_mask": np.asarray(passes[0][1])}
    params, state = params_on(), _adam_state(params_on())
    for rows in (order[:8], order[8:]):
        params, state, _ = step(params, state, {k: v[rows] for k, v in full.items()})
    assert max_diff(host(got), host(params)) == 0.0


def test_optimizer_state_is_sharded_like_the_params():
    mesh_shape = (("fsdp", 4), ("tensor", 2))
    mesh = mesh_of(mesh_shape)
    opt = make_optimizer(ADAM)
    state = init_opt_state(opt, CFG, params_on(mesh_shape), mesh)
    p_sh = param_shardings(CFG, mesh)
    adam = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)][0]
    for moments in (adam.mu, adam.nu):
        specs = jax.tree.map(lambda x, sh: (x.sharding.spec, sh.spec), moments, p_sh)
        assert all(a == b for a, b in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, tuple)))
    assert adam.mu["layers"]["attn"]["q_kernel"].sharding.spec == P(None, "fsdp", "tensor", None)


def test_schedules_and_reported_lr():
    cfg = OptimConfig(lr=1e-3, schedule="warmup_cosine", warmup_steps=4, total_steps=12, min_lr_ratio=0.1)
    sched = make_schedule(cfg)
    for t in range(14):
        if t < 4:
            want = 1e-3 * t / 4
        else:
            frac = min(t - 4, 8) / 8
            want = 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + np.cos(np.pi * frac))
        np.testing.assert_allclose(float(sched(t)), want, rtol=1e-5, atol=1e-12)
    warm = make_schedule(OptimConfig(lr=2e-3, warmup_steps=2))
    assert [float(warm(t)) for t in (0, 1, 2, 5)] == pytest.approx([0.0, 1e-3, 2e-3, 2e-3])
    opt = make_optimizer(cfg)
    params = {"w": jnp.ones(3)}
    state = opt.init(params)
    for t in range(3):
        _, state = opt.update({"w": jnp.ones(3)}, state, params)
        assert float(current_lr(state)) == pytest.approx(float(sched(t)))
    with pytest.raises(ValueError, match="OptimConfig.total_steps"):
        OptimConfig(schedule="warmup_cosine", warmup_steps=10, total_steps=10)
    with pytest.raises(ValueError, match="OptimConfig.schedule"):
        OptimConfig(schedule="linear")


LORA_CFG = CFG.replace(lora_rank=4, lora_alpha=8.0, lora_targets=("q", "v", "o", "gate", "down"))


def lora_sgd_delta(mesh_shape, tokens):
    """One SGD(lr=1) step of a LoRA policy (random base and adapters, B not zero so that A has a
    gradient too): the parameter change, base and adapters."""
    mesh = mesh_of(mesh_shape)
    rng = np.random.default_rng(1)
    draw = lambda path, leaf: (rng.normal(0.0, 0.02, leaf.shape) * (5 if "scale" in jax.tree_util.keystr(path) else 1)
                               + ("scale" in jax.tree_util.keystr(path))).astype(np.float32)
    p0 = jax.device_put(jax.tree_util.tree_map_with_path(draw, abstract_params(LORA_CFG)),
                        param_shardings(LORA_CFG, mesh))
    before = host(p0)
    step = make_train_step(LORA_CFG, NO_KL, SGD, mesh, tokens_per_device=tokens)
    p1, _, metrics = step(p0, init_opt_state(SGD, LORA_CFG, p0, mesh), train_batch())
    return jax.tree.map(lambda a, b: a - b, host(p1), before), jax.device_get(metrics)


def test_a_lora_step_sharded_over_8_devices_equals_the_single_device_step():
    from arlopti_jax.models import lora

    single, m_single = lora_sgd_delta(SINGLE, 256)
    sharded, m_sharded = lora_sgd_delta((("fsdp", 8),), 16)  # fsdp over 8 devices, many micro-batches
    for delta in (single, sharded):
        base, adapters = lora.split(delta)
        assert max(float(np.abs(x).max()) for x in jax.tree.leaves(base)) == 0.0  # the base never moves
        assert min(float(np.abs(x).max()) for x in jax.tree.leaves(adapters)) > 1e-6  # every adapter does
    assert max_diff(single, sharded) < 1e-5
    np.testing.assert_allclose(m_sharded["loss"], m_single["loss"], rtol=1e-5)
    np.testing.assert_allclose(m_sharded["grad_norm"], m_single["grad_norm"], rtol=1e-5)
