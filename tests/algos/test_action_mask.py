"""The action mask of tool episodes: ``response_mask`` with holes (observation tokens inside the
response span, attended but not the policy's). Every consumer of the update reads only the
policy's tokens: garbage in pi_old, the reference's and the behaviour policy's log-probs, the
entropies and the log-probs at the observations changes nothing anywhere; the whole objective
(GRPO / REINFORCE++ advantages, AR and TR weights, Lopti's split, the clipped loss, the KL, the
token-mean) equals a numpy transcription run on each episode with its observations left out; and
the packed update, shared prefix or not, on 1 and 8 devices, equals the dense gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from arlopti_jax.runtime import sharding as shd
from arlopti_jax.algos import (AdvantageConfig, CorrectionConfig, LoptiConfig, LossConfig, TokenWeightConfig,
                               aggregation_weights, compute_advantages, correction_weights, init_opt_state,
                               make_compute_logprobs, make_train_step, mismatch_metrics, policy_loss,
                               prepare_updates, probability_quartiles)
from arlopti_jax.models import ModelConfig, abstract_params, param_shardings, token_logprobs

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8)
PW, RW = 10, 24
LOSS = LossConfig(kl_coef=0.3, kl_type="low_var_kl", entropy_coef=0.05, temperature=0.8)


def episodes(seed: int, groups=((4, 7), (3, 4), (1, 9), (4, 6)), first_observation=False):
    """A batch of tool episodes: per group (responses, prompt length) a left-padded prompt, then
    turns of 1-5 drawn tokens each followed by an observation of 1-4 tokens (the last turn none), right
    padding. Returns (batch, rewards, group ids, holes: the observations' [B, T] mask)."""
    rng = np.random.default_rng(seed)
    spec = [(g, rng.integers(3, CFG.vocab_size, p)) for g, (n, p) in enumerate(groups)]
    rows = sum(n for n, _ in groups)
    ids = np.zeros((rows, PW + RW), np.int32)
    attn, action, holes = (np.zeros((rows, PW + RW), np.float32) for _ in range(3))
    gids = np.zeros(rows, np.int32)
    r = 0
    for g, (n, _) in enumerate(groups):
        for _ in range(n):
            prompt = spec[g][1]
            ids[r, PW - len(prompt):PW] = prompt
            t = PW
            turns = int(rng.integers(1, 4))
            for turn in range(turns):
                if turn == 0 and first_observation:  # the environment speaks first
                    k = int(rng.integers(1, 3))
                    holes[r, t:t + k] = 1
                    t += k
                k = int(rng.integers(1, 6))
                action[r, t:t + k] = 1
                t += k
                if turn + 1 < turns:
                    k = int(rng.integers(1, 5))
                    holes[r, t:t + k] = 1
                    t += k
            ids[r, PW:t] = rng.integers(3, CFG.vocab_size, t - PW)
            attn[r, PW - len(prompt):t] = 1
            gids[r] = g
            r += 1
    old = np.where(action > 0, np.log(rng.uniform(0.05, 1.0, action.shape)), 0).astype(np.float32)
    ref = np.where(action > 0, old + rng.normal(0, 0.3, action.shape), 0).astype(np.float32)
    rewards = rng.choice([-1.0, 0.5, 1.0, 3.0], rows).astype(np.float32)
    batch = dict(input_ids=ids, attention_mask=attn, response_mask=action, old_logprobs=old, ref_logprobs=ref)
    return batch, rewards, gids, holes


def with_garbage(x, holes, seed):
    """``x`` with large finite values at the observations."""
    return np.where(holes > 0, np.random.default_rng(seed).uniform(-40, 40, x.shape), x).astype(np.float32)


METHODS = [(AdvantageConfig("grpo"), TokenWeightConfig("none"), LoptiConfig()),
           (AdvantageConfig("grpo"), TokenWeightConfig("ar", alpha=0.3), LoptiConfig(True, 0.5)),
           (AdvantageConfig("reinforce_plus_plus"), TokenWeightConfig("tr"), LoptiConfig(True, 0.4, quantile=True)),
           (AdvantageConfig("rloo"), TokenWeightConfig("ar", alpha=0.2, entropy_top_fraction=0.3), LoptiConfig()),
           (AdvantageConfig("dr_grpo"), TokenWeightConfig("none"), LoptiConfig(True, -0.5))]


@pytest.mark.parametrize("first_observation", [False, True])
def test_nothing_reads_the_observation_tokens(first_observation):
    batch, rewards, gids, holes = episodes(0, first_observation=first_observation)
    mask = batch["response_mask"]
    rng = np.random.default_rng(5)
    entropies = np.where(mask > 0, rng.uniform(0, 3, mask.shape), 0).astype(np.float32)
    behaviour = np.where(mask > 0, batch["old_logprobs"] + rng.normal(0, 0.1, mask.shape), 0).astype(np.float32)
    logp = np.where(mask > 0, batch["old_logprobs"] + rng.normal(0, 0.2, mask.shape), 0).astype(np.float32)

    def everything(old, ref, ent, beh, lp):
        out = []
        for adv_cfg, weight_cfg, lopti in METHODS:
            passes = prepare_updates(adv_cfg, weight_cfg, lopti, rewards, gids, mask, old, ent)
            out += [np.asarray(x) for p in passes for x in p]
            for advantages, loss_mask in passes:
                targets = {"advantages": advantages, "old_logprobs": old, "response_mask": mask, "loss_mask": loss_mask,
                           "agg_weight": aggregation_weights(mask, "seq-mean-token-mean"), "ref_logprobs": ref,
                           "sequence_id": np.broadcast_to(np.arange(len(mask))[:, None], mask.shape)}
                for loss in (LOSS, LossConfig(ratio_level="sequence", kl_coef=0.1), LossConfig(mode="cispo")):
                    value, stats = policy_loss(loss, jnp.asarray(lp), jnp.asarray(ent), targets)
                    out += [np.asarray(value)] + [np.asarray(v) for v in stats.values()]
        for kind in ("tis", "seq_mask"):
            cfg = CorrectionConfig(kind, tis_cap=1.05, seq_mask_bound=1.05)
            out.append(np.asarray(correction_weights(cfg, old, beh, mask)))
            out += list(mismatch_metrics(cfg, old, beh, mask).values())
        out += [np.asarray(v) for v in probability_quartiles(old, np.asarray(passes[0][0]), mask).values()]
        return out

    clean = everything(batch["old_logprobs"], batch["ref_logprobs"], entropies, behaviour, logp)
    dirty = everything(*(with_garbage(x, holes, i) for i, x in enumerate(
        (batch["old_logprobs"], batch["ref_logprobs"], entropies, behaviour, logp))))
    assert len(clean) == len(dirty) > 100
    for a, b in zip(clean, dirty):
        np.testing.assert_array_equal(a, b)
    assert all(np.all(np.asarray(a)[holes > 0] == 0) for a in clean if np.shape(a) == mask.shape)


def _compact(x, mask):
    """Per row, the values at the row's masked-in tokens (an episode with its observations left out)."""
    return [np.asarray(x[r][mask[r] > 0], np.float64) for r in range(len(mask))]


def np_objective(batch, rewards, gids, logp, entropy, alpha, eta, loss: LossConfig):
    """GRPO -> AR -> Lopti's first (low) pass -> the clipped loss, KL and entropy, token-mean: per
    episode on its drawn tokens only, in float64 (docs/paper.md)."""
    mask = batch["response_mask"]
    old, ref, lp, ent = (_compact(x, mask) for x in (batch["old_logprobs"], batch["ref_logprobs"], logp, entropy))
    rows = [r for r in range(len(mask)) if len(old[r])]
    total, kl_total, ent_total = 0.0, 0.0, 0.0
    count = sum(len(old[r]) for r in rows)
    for r in rows:
        group = [s for s in rows if gids[s] == gids[r]]
        values = np.array([rewards[s] for s in group], np.float64)
        mean, std = (values.mean(), values.std(ddof=1)) if len(group) > 1 else (0.0, 1.0)
        a = (rewards[r] - mean) / (std + 1e-6)
        p = np.exp(old[r])
        low = p < eta
        adv = (alpha * p + 1 - alpha) * a * low
        ratio = np.exp(lp[r] - old[r])
        pg = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - loss.clip_low, 1 + loss.clip_high))
        pg = np.where(adv < 0, np.minimum(pg, -adv * loss.dual_clip), pg)
        d = np.clip(ref[r] - lp[r], -5, 5)
        kl = np.clip(np.exp(d) - d - 1, -10, 10)
        total += pg.sum()
        kl_total += (kl * low).sum()
        ent_total += (ent[r] * low).sum()
    return (total + loss.kl_coef * kl_total - loss.entropy_coef * ent_total) / count


def np_reinforce_pp(batch, rewards):
    """REINFORCE++'s whitened returns (gamma 1) per episode on its drawn tokens only."""
    mask = batch["response_mask"]
    returns = [np.full(int(m.sum()), float(rewards[r])) for r, m in enumerate(mask)]
    flat = np.concatenate(returns)
    mean, var = flat.mean(), flat.var(ddof=1)
    return [(g - mean) / np.sqrt(var + 1e-8) for g in returns]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_objective_is_a_numpy_transcription_without_the_observations(seed):
    batch, rewards, gids, holes = episodes(seed, first_observation=seed == 2)
    mask = batch["response_mask"]
    rng = np.random.default_rng(seed + 10)
    logp = with_garbage(np.where(mask > 0, batch["old_logprobs"] + rng.normal(0, 0.3, mask.shape), 0), holes, 3)
    entropy = with_garbage(np.where(mask > 0, rng.uniform(0, 2, mask.shape), 0), holes, 4)
    garbled = {**batch, **{k: with_garbage(batch[k], holes, i) for i, k in enumerate(("old_logprobs", "ref_logprobs"))}}
    advantages, loss_mask = prepare_updates(AdvantageConfig("grpo"), TokenWeightConfig("ar", alpha=0.3),
                                            LoptiConfig(True, 0.5), rewards, gids, mask, garbled["old_logprobs"])[0]
    targets = {"advantages": advantages, "old_logprobs": garbled["old_logprobs"], "response_mask": mask,
               "loss_mask": loss_mask, "agg_weight": aggregation_weights(mask, "token-mean"),
               "ref_logprobs": garbled["ref_logprobs"]}
    got, _ = policy_loss(LOSS, jnp.asarray(logp), jnp.asarray(entropy), targets)
    want = np_objective(batch, rewards, gids, logp, entropy, 0.3, 0.5, LOSS)
    np.testing.assert_allclose(float(got), want, rtol=2e-5)
    assert holes.sum() > 10 and abs(want) > 1e-3
    rpp = np.asarray(compute_advantages(AdvantageConfig("reinforce_plus_plus"), rewards, gids, mask))
    for r, want_row in enumerate(np_reinforce_pp(batch, rewards)):
        np.testing.assert_allclose(rpp[r][mask[r] > 0], want_row, rtol=1e-5, atol=1e-6)
    assert np.all(rpp[holes > 0] == 0)


@functools.cache
def mesh_of(shape=(("fsdp", 1),)):
    shape = dict(shape)
    return shd.make_mesh(shape, devices=jax.devices()[:1] if shape == {"fsdp": 1} else None)


@functools.cache
def _host_params():
    rng = np.random.default_rng(3)
    draw = lambda path, leaf: (rng.normal(0.0, 0.2, leaf.shape) + ("scale" in jax.tree_util.keystr(path))).astype(
        np.float32)
    return jax.tree_util.tree_map_with_path(draw, abstract_params(CFG))


def params_on(mesh):
    return jax.device_put(_host_params(), param_shardings(CFG, mesh))


def update_batch():
    batch, rewards, gids, holes = episodes(7)
    advantages, loss_mask = prepare_updates(AdvantageConfig("grpo"), TokenWeightConfig("ar", alpha=0.3),
                                            LoptiConfig(True, 0.5), rewards, gids, batch["response_mask"],
                                            batch["old_logprobs"])[0]
    garbled = {k: with_garbage(batch[k], holes, i) for i, k in enumerate(("old_logprobs", "ref_logprobs"))}
    return {**batch, **garbled, "advantages": np.asarray(advantages), "loss_mask": np.asarray(loss_mask)}, holes


def dense_gradient(batch):
    """The gradient of the dense objective: one forward over each whole row, the loss at the drawn tokens."""
    def loss_of(params):
        logp, entropy = token_logprobs(CFG, params, jnp.asarray(batch["input_ids"]),
                                       jnp.asarray(batch["attention_mask"]), temperature=LOSS.temperature)
        targets = {k: batch[k] for k in ("advantages", "old_logprobs", "response_mask", "loss_mask", "ref_logprobs")}
        targets["agg_weight"] = aggregation_weights(batch["response_mask"], LOSS.agg)
        return policy_loss(LOSS, logp, entropy, targets)[0]

    with shd.activate(mesh_of()):
        return jax.device_get(jax.jit(jax.grad(loss_of))(params_on(mesh_of())))


@pytest.mark.parametrize("shared,mesh_shape", [(True, (("fsdp", 1),)), (False, (("fsdp", 1),)),
                                               (True, (("data", 2), ("fsdp", 4)))],
                         ids=["shared", "unshared", "shared-data2xfsdp4"])
def test_the_packed_update_with_holes_equals_the_dense_one(shared, mesh_shape):
    batch, holes = update_batch()
    mesh = mesh_of(mesh_shape)
    step = make_train_step(CFG, LOSS, optax.sgd(1.0), mesh, tokens_per_device=64, shared_prefix=shared)
    p0 = params_on(mesh)
    new = jax.device_get(step(p0, init_opt_state(optax.sgd(1.0), CFG, p0, mesh), batch)[0])
    got = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), _host_params(), new)
    want = dense_gradient(batch)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.abs(w).max() > 0
        assert np.abs(g - w).max() <= 2e-5 * np.abs(w).max()
    done = step.processed[-1]
    assert (done.real_tokens < batch["attention_mask"].sum()) == shared  # the shared layout ran
    logprobs = make_compute_logprobs(CFG, mesh, temperature=LOSS.temperature, tokens_per_device=64,
                                     shared_prefix=shared)(params_on(mesh), batch)
    assert np.all(logprobs[holes > 0] == 0)  # no log-prob is made for an observation
    dense = np.asarray(token_logprobs(CFG, params_on(mesh_of()), batch["input_ids"], batch["attention_mask"],
                                      temperature=LOSS.temperature)[0]) * batch["response_mask"]
    np.testing.assert_allclose(logprobs, dense, atol=1e-5)
