"""The shared-prefix layout (``algos/packing.py``): each group's prompt is forwarded once in the
update and log-prob passes, and every query sees exactly the context of its own unshared
sequence. Checked against the unshared layout on the same batch in float32: per-token
log-probs, the loss and every gradient leaf, Lopti's two passes, the diagnostics, on 1 and 8
devices; prompts of different lengths, left-padded, groups split across micro-batches, prompts
no other row repeats. Breaking the isolation (a response that sees a sibling) fails the check."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from arlopti_jax.runtime import sharding as shd
from arlopti_jax.algos import (AdvantageConfig, LoptiConfig, LossConfig, TokenWeightConfig, init_opt_state,
                               isolation_experiment, make_compute_logprobs, make_quartile_grad_norms,
                               make_train_step, packing, prepare_updates, update_on_batch)
from arlopti_jax.models import ModelConfig, abstract_params, param_shardings, token_logprobs
from arlopti_jax.models import decoder

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8)
PW, RW = 12, 16  # prompt (left-padded) and response widths
# (responses, prompt length) per prompt: a group of 1 and prompts no other row repeats keep the
# unshared layout; the prompt of the last two is the same tokens as the first group's (one group)
GROUPS = ((4, 9), (4, 3), (1, 6), (3, 12), (4, 5), (1, 7), (1, 8))
LOSS = LossConfig(kl_coef=0.3, kl_type="low_var_kl", entropy_coef=0.05, temperature=0.8)
SINGLE = (("fsdp", 1),)


@functools.cache
def mesh_of(shape=SINGLE):
    shape = dict(shape)
    return shd.make_mesh(shape, devices=jax.devices()[:1] if shape == {"fsdp": 1} else None)


@functools.cache
def grouped_batch(seed=0):
    """Rows of GROUPS (plus two more rows of group 0's prompt) in a shuffled order, left-padded
    prompts, right-padded responses of 1-16 tokens, GRPO advantages with AR weights and a Lopti
    low-pass mask, the KL's reference log-probs. Returns (batch, rewards, group ids)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, CFG.vocab_size, p) for _, p in GROUPS]
    spec = [(g, prompts[g]) for g, (n, _) in enumerate(GROUPS) for _ in range(n)] + [(0, prompts[0])] * 2
    order = rng.permutation(len(spec))
    rows = len(spec)
    ids = np.zeros((rows, PW + RW), np.int32)
    attn = np.zeros_like(ids)
    resp = np.zeros((rows, PW + RW), np.float32)
    gids = np.zeros(rows, np.int32)
    for r, k in enumerate(order):
        g, prompt = spec[k]
        n = int(rng.integers(1, RW + 1))
        ids[r, PW - len(prompt):PW] = prompt
        ids[r, PW:PW + n] = rng.integers(3, CFG.vocab_size, n)
        attn[r, PW - len(prompt):PW + n] = 1
        resp[r, PW:PW + n] = 1
        gids[r] = g
    old = np.where(resp > 0, np.log(rng.uniform(0.05, 1.0, resp.shape)), 0).astype(np.float32)
    ref = np.where(resp > 0, old + rng.normal(0, 0.3, resp.shape), 0).astype(np.float32)
    rewards = rng.choice([-1.0, 0.5, 3.0], rows).astype(np.float32)
    batch = dict(input_ids=ids, attention_mask=attn, response_mask=resp, old_logprobs=old, ref_logprobs=ref)
    return batch, rewards, gids


def lopti_passes(batch, rewards, gids):
    return prepare_updates(AdvantageConfig("grpo"), TokenWeightConfig("ar", alpha=0.3), LoptiConfig(True, 0.5),
                           rewards, gids, batch["response_mask"], batch["old_logprobs"])


def train_batch():
    batch, rewards, gids = grouped_batch()
    adv, mask = lopti_passes(batch, rewards, gids)[0]
    return {**batch, "advantages": np.asarray(adv), "loss_mask": np.asarray(mask)}


@functools.cache
def _host_params():
    rng = np.random.default_rng(3)
    draw = lambda path, leaf: (rng.normal(0.0, 0.2, leaf.shape) + ("scale" in jax.tree_util.keystr(path))).astype(
        np.float32)
    return jax.tree_util.tree_map_with_path(draw, abstract_params(CFG))


def params_on(mesh_shape=SINGLE):
    """Fresh device buffers (the steps donate them)."""
    return jax.device_put(_host_params(), param_shardings(CFG, mesh_of(mesh_shape)))


def plan(batch, tokens, shared=True, devices=1):
    return packing.plan_micro_batches(batch["attention_mask"], batch["response_mask"],
                                      np.arange(len(batch["input_ids"])), tokens_per_device=tokens,
                                      num_devices=devices, input_ids=batch["input_ids"] if shared else None)


@pytest.mark.parametrize("tokens,devices", [(512, 1), (64, 1), (64, 2)])
def test_each_query_sees_exactly_its_own_sequence(tokens, devices):
    """From the plan and ``segment_mask`` alone: for every real slot, the keys it may attend to,
    in order, hold the tokens of its own dense sequence up to its own token, at positions 0, 1,
    ...; every response token is a target once, predicted from the slot that holds the token
    before it; prompts are shared (fewer slots than tokens), groups are split across
    micro-batches at the small budget, and unrepeated prompts keep one segment."""
    batch, _, gids = grouped_batch()
    ids, attn, resp = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
    width = ids.shape[1]
    spans = packing.sequence_spans(attn)
    micro_batches = plan(batch, tokens, devices=devices)
    assert len(micro_batches) == 1 if tokens == 512 else len(micro_batches) > 2
    groups_in = {}
    for j, mb in enumerate(micro_batches):
        mask = np.asarray(decoder.segment_mask(jnp.asarray(mb.segment_ids), jnp.asarray(mb.prefix_ids)))[:, 0]
        per_device = mb.token_src.shape[0] // devices
        for r in range(mb.token_src.shape[0]):
            for q in np.flatnonzero(mb.token_src[r] >= 0):
                own = int(mb.token_src[r, q])
                keys = np.flatnonzero(mask[r, q])
                src = mb.token_src[r, keys]
                # the slot's sequence: the dense row of its own token (a shared prompt slot is
                # the first member's, whose context is the same tokens)
                row, t = divmod(own, width)
                start = spans[row, 0]
                np.testing.assert_array_equal(ids.reshape(-1)[src], ids[row, start:t + 1])
                np.testing.assert_array_equal(mb.positions[r, keys], np.arange(t + 1 - start))
            for seg in np.unique(mb.segment_ids[r][mb.segment_ids[r] > 0]):
                rows_of = np.unique(mb.token_src[r][mb.segment_ids[r] == seg] // width)
                groups_in.setdefault(int(gids[rows_of[0]]), set()).add(j)
        for d in range(devices):  # a target is predicted from the last key its own slot sees before itself
            rows_d = slice(d * per_device, (d + 1) * per_device)
            flat = {int(src): k for k, src in enumerate(mb.token_src[rows_d].reshape(-1)) if src >= 0}
            seen = mask[rows_d]
            for pos, src in zip(mb.target_pos[d], mb.target_src[d]):
                if src >= 0:
                    r, q = divmod(flat[int(src)], mb.row_length)
                    assert pos == r * mb.row_length + np.flatnonzero(seen[r, q])[-2]
    targets = np.concatenate([mb.target_src[mb.target_src >= 0] for mb in micro_batches])
    assert sorted(targets) == sorted(np.flatnonzero(resp.reshape(-1)))
    real = sum(mb.real_tokens for mb in micro_batches)
    assert real < attn.sum() - (60 if tokens == 512 else 20)  # prompts forwarded once per row holding their group
    if tokens == 64:
        assert any(len(mbs) > 1 for mbs in groups_in.values())  # a group split across micro-batches
    for row in np.flatnonzero(np.isin(gids, (2, 5, 6))):  # prompts no other row repeats: one whole segment
        (j, r), = {(j, r) for j, mb in enumerate(micro_batches) for r in np.nonzero(
            (mb.token_src >= 0) & (mb.token_src // width == row))[0]}
        mb = micro_batches[j]
        here = (mb.token_src[r] >= 0) & (mb.token_src[r] // width == row)
        assert here.sum() == attn[row].sum() and len(np.unique(mb.segment_ids[r, here])) == 1
        assert (mb.prefix_ids[r, here] == 0).all()


def test_unshared_plan_is_every_sequence_whole():
    batch, _, _ = grouped_batch()
    micro_batches = plan(batch, 64, shared=False)
    assert all((mb.prefix_ids == 0).all() for mb in micro_batches)
    assert sum(mb.real_tokens for mb in micro_batches) == batch["attention_mask"].sum()


@functools.cache
def logprobs_fn(shared: bool, tokens: int, mesh_shape=SINGLE):
    return make_compute_logprobs(CFG, mesh_of(mesh_shape), temperature=LOSS.temperature, tokens_per_device=tokens,
                                 shared_prefix=shared)


def assert_logprobs_match(got, want):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tokens,mesh_shape", [(512, SINGLE), (64, SINGLE), (64, (("data", 2), ("fsdp", 4)))],
                         ids=["one-micro-batch", "split-groups", "data2xfsdp4"])
def test_shared_logprobs_equal_unshared_and_dense(tokens, mesh_shape):
    batch, _, _ = grouped_batch()
    got = logprobs_fn(True, tokens, mesh_shape)(params_on(mesh_shape), batch)
    want = logprobs_fn(False, tokens)(params_on(), batch)
    assert_logprobs_match(got, want)
    shared, whole = logprobs_fn(True, tokens, mesh_shape).processed[-1], logprobs_fn(False, tokens).processed[-1]
    assert shared.real_tokens < whole.real_tokens == batch["attention_mask"].sum()  # the shared layout ran
    dense = np.asarray(token_logprobs(CFG, params_on(), batch["input_ids"], batch["attention_mask"],
                                      temperature=LOSS.temperature)[0]) * batch["response_mask"]
    assert_logprobs_match(got, dense)


def test_a_response_that_sees_a_sibling_fails_the_check(monkeypatch):
    """The negative control: a mask that also lets a response see the earlier responses of its
    group (what a layout without the isolation computes) moves the log-probs far beyond the
    check's tolerance."""
    batch, _, _ = grouped_batch()
    want = logprobs_fn(False, 512)(params_on(), batch)
    original = decoder.segment_mask

    def leaky(segment_ids, prefix_ids=None):
        slot = jnp.arange(segment_ids.shape[1])
        sibling = (prefix_ids[:, :, None] == prefix_ids[:, None, :]) & (prefix_ids[:, None, :] > 0)
        causal = slot[None, :] <= slot[:, None]
        return original(segment_ids, prefix_ids) | (sibling & causal)[:, None]

    monkeypatch.setattr(decoder, "segment_mask", leaky)
    got = make_compute_logprobs(CFG, mesh_of(), temperature=LOSS.temperature, tokens_per_device=512)(params_on(), batch)
    with pytest.raises(AssertionError):
        assert_logprobs_match(got, want)
    assert np.abs(got - want).max() > 1e-2


# Qwen3's q/k norms, and Gemma 3's pieces at this test's size: a sliding window of 4 slots (shorter than
# most prompts and responses) on layer 0 with its own RoPE theta, q/k norms, (1 + w) norms around each
# sublayer, GELU, both soft-caps
FAMILIES = {"qwen3": dataclasses.replace(CFG, architecture="Qwen3ForCausalLM", qkv_bias=False, qk_norm=True),
            "gemma3": dataclasses.replace(CFG, architecture="Gemma3ForCausalLM", qkv_bias=False, qk_norm=True,
                                          layer_types=("sliding_attention", "full_attention"), sliding_window=4,
                                          rope_local_theta=1e4, query_pre_attn_scalar=12.0, tie_word_embeddings=True,
                                          attn_logit_softcapping=3.0, final_logit_softcapping=4.0)}


@pytest.mark.parametrize("name", [pytest.param("qwen3", marks=pytest.mark.slow), "gemma3"])  # 13-18 s each
def test_other_families_shared_logprobs_and_update_equal_dense_and_unshared(name):
    """A shared prompt's responses sit further along a packed row than they are from the prompt, so a
    sliding window counts positions there, not slots: the shared layout's log-probs equal the dense
    pass's (whose window counts slots), and one SGD step's parameters equal the unshared layout's."""
    cfg = FAMILIES[name]
    rng = np.random.default_rng(4)
    host = jax.tree_util.tree_map_with_path(lambda path, leaf: (rng.normal(0.0, 0.2, leaf.shape) + (
        "scale" in jax.tree_util.keystr(path))).astype(np.float32), abstract_params(cfg))
    fresh = lambda: jax.device_put(host, param_shardings(cfg, mesh_of()))
    batch = train_batch()
    shared = make_compute_logprobs(cfg, mesh_of(), temperature=LOSS.temperature, tokens_per_device=64)
    got = shared(fresh(), batch)
    assert shared.processed[-1].real_tokens < batch["attention_mask"].sum()  # the shared layout ran
    dense = np.asarray(token_logprobs(cfg, fresh(), batch["input_ids"], batch["attention_mask"],
                                      temperature=LOSS.temperature)[0]) * batch["response_mask"]
    assert_logprobs_match(got, dense)
    minus_gradient = {}  # one SGD(1) step's parameters less the initial ones
    for layout in (True, False):
        step = make_train_step(cfg, LOSS, optax.sgd(1.0), mesh_of(), tokens_per_device=64, shared_prefix=layout)
        p0 = fresh()
        new = jax.device_get(step(p0, init_opt_state(optax.sgd(1.0), cfg, p0, mesh_of()), batch)[0])
        minus_gradient[layout] = jax.tree.map(lambda x, h: np.asarray(x, np.float64) - h, new, host)
    assert_gradients_match(minus_gradient[True], minus_gradient[False])


@functools.cache
def sgd_step(shared: bool, tokens: int, mesh_shape=SINGLE):
    return make_train_step(CFG, LOSS, optax.sgd(1.0), mesh_of(mesh_shape), tokens_per_device=tokens,
                           shared_prefix=shared)


def gradient_and_metrics(shared, tokens, mesh_shape=SINGLE):
    """(gradient tree, metrics) of one SGD(1) step: the parameter change is minus the gradient."""
    step = sgd_step(shared, tokens, mesh_shape)
    p0 = params_on(mesh_shape)
    new, _, metrics = step(p0, init_opt_state(optax.sgd(1.0), CFG, p0, mesh_of(mesh_shape)), train_batch())
    grads = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), _host_params(),
                         jax.device_get(new))
    return grads, jax.device_get(metrics)


def assert_gradients_match(got, want):
    for path, g, w in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got), jax.tree.leaves(want)):
        scale = np.abs(w).max()
        assert scale > 0
        assert np.abs(g - w).max() <= 2e-5 * scale, jax.tree_util.keystr(path[0])  # float32 sums, reordered


@functools.cache
def unshared_reference():
    return gradient_and_metrics(False, 512)


@pytest.mark.parametrize("tokens,mesh_shape", [(512, SINGLE), (64, SINGLE), (64, (("data", 2), ("fsdp", 4))),
                                               (64, (("fsdp", 4), ("tensor", 2)))],
                         ids=["one-micro-batch", "split-groups", "data2xfsdp4", "fsdp4xtensor2"])
def test_shared_update_equals_unshared(tokens, mesh_shape):
    """The loss, its metrics and every gradient leaf of one mini-batch step (KL, entropy bonus, AR
    weights, Lopti's low-pass mask), shared against unshared, within 1e-4 relative
    (two compilations: float rounding)."""
    want, want_metrics = unshared_reference()
    got, metrics = gradient_and_metrics(True, tokens, mesh_shape)
    assert_gradients_match(got, want)
    for name in ("loss", "pg_loss", "kl_loss", "entropy_loss", "entropy", "kl", "ratio_mean", "grad_norm"):
        np.testing.assert_allclose(metrics[name], want_metrics[name], rtol=1e-4, err_msg=name)
    assert metrics["n_tokens"] == want_metrics["n_tokens"]
    done = sgd_step(True, tokens, mesh_shape).processed[-1]
    assert done.real_tokens < train_batch()["attention_mask"].sum()  # the shared layout really ran


def test_lopti_passes_and_diagnostics_equal_unshared():
    """Both Lopti passes over shuffled mini-batches (groups split between them), the quartile
    gradient norms and the isolation experiment, shared against unshared. The parameters after
    the four SGD(1) steps agree to 1e-5 of each leaf's scale (float differences of one step
    move the next step's gradient: they compound, where each step's loss and gradient norm
    agree to 1e-5)."""
    batch, rewards, gids = grouped_batch()
    passes = lopti_passes(batch, rewards, gids)
    advantages = np.asarray(sum(a for a, _ in passes))
    sgd = optax.sgd(1.0)
    fresh_state = lambda p: init_opt_state(sgd, CFG, p, mesh_of())
    results = {}
    for shared in (True, False):
        step = sgd_step(shared, 64)
        mark = len(step.processed)
        p0 = params_on()
        new, _, metrics = update_on_batch(step, p0, fresh_state(p0), batch, passes, 10, shuffle_key=jax.random.key(1))
        norms = make_quartile_grad_norms(step)(params_on(), {**batch, "advantages": advantages,
                                                             "loss_mask": batch["response_mask"]})
        isolation = isolation_experiment(step, logprobs_fn(shared, 64), fresh_state, params_on(),
                                         {**batch, "advantages": advantages})
        sent = step.processed_since(mark).real_tokens + logprobs_fn(shared, 64).processed[-1].real_tokens
        # 4 steps on half the batch, 4 quartile gradients and 2 isolation steps on all of it, a log-prob pass
        whole = 9 * batch["attention_mask"].sum()
        assert sent < whole if shared else sent == whole
        results[shared] = jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(new)), metrics, norms, \
            isolation
    (got, got_m, got_norms, got_iso), (want, want_m, want_norms, want_iso) = results[True], results[False]
    assert_gradients_match(got, want)
    for g, w in zip(got_m, want_m):
        for name in ("loss", "grad_norm", "kl", "entropy"):
            np.testing.assert_allclose(g[name], w[name], rtol=1e-4, err_msg=name)
    np.testing.assert_allclose(got_norms, want_norms, rtol=1e-5)
    np.testing.assert_allclose(got_iso, want_iso, rtol=1e-4, atol=1e-6)
    assert np.abs(want_iso).max() > 1e-3


@pytest.mark.slow
def test_training_with_shared_prefix_equals_unshared(start_point, tmp_path):
    """Three RL steps from the embedded default's start point (8 devices), train.shared_prefix off
    and on, with TR weights, Lopti, the KL's reference pass, the pi_old recompute, DAPO filtering,
    the overlong penalty and the diagnostics (quartile gradients, the isolation experiment): the
    same logged metrics each step to float32 rounding, and fewer tokens forwarded by the update."""
    from run_fixtures import TIMING, assert_nothing_compiled_late, make_config, overrides, step_metrics

    from arlopti_jax.train import train

    values = {"algo.weighting": "tr", "algo.lopti_eta": 0.5, "algo.filter_groups": True, "algo.max_sample_rounds": 2,
              "algo.overlong_buffer": 4, "rollout.recompute_old_logprobs": True, "train.diagnostics_every": 1,
              "train.max_steps": 3, "loss.kl_coef": 0.001, "data.max_prompt_length": 128}
    runs = {}
    for shared in (False, True):
        run_dir = tmp_path / f"shared_{shared}"
        assert_nothing_compiled_late(train(make_config(overrides(start_point, run_dir, **values,
                                                                 **{"train.shared_prefix": shared}))))
        runs[shared] = step_metrics(run_dir)
    assert set(runs[True]) == set(runs[False]) == {1, 2, 3}
    for step, want in runs[False].items():
        got = runs[True][step]
        assert got["update/forwarded_tokens"] < want["update/forwarded_tokens"]
        for name, value in want.items():
            if name != "update/forwarded_tokens" and not name.startswith(TIMING):
                assert got[name] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, name)
