"""GSPO (loss.ratio_level='sequence'), CISPO (loss.mode='cispo') and the 80/20 high-entropy
selection (algo.entropy_top_fraction) against numpy float64 transcriptions of their papers'
formulas, gradients included, on packed micro-batches and through the train step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlopti_jax.algos import (AdvantageConfig, LoptiConfig, LossConfig, TokenWeightConfig, aggregation_weights,
                               entropy_top_mask, packing, policy_loss, prepare_updates, sequence_ids)
from test_advantages import np_grpo
from test_losses import np_agg, np_ppo

EL, EH, C = 3e-4, 4e-4, 3.0  # GSPO's clip range (the paper's), and a dual clip that binds below
GSPO = dict(clip_low=EL, clip_high=EH, dual_clip=C, kl_coef=0.0, ratio_level="sequence", agg="seq-mean-token-mean")


def np_clip_term(s, a, el=EL, eh=EH, c=C):
    """Value of -min(s A, clip(s) A) with the dual clip, and whether it is the unclipped branch."""
    unclipped, clipped = -a * s, -a * min(max(s, 1 - el), 1 + eh)
    value, live = (unclipped, True) if unclipped >= clipped else (clipped, False)
    if a < 0 and value > -a * c:
        value, live = -a * c, False
    return value, live


def np_gspo_objective(logp, old, adv, mask):
    """GSPO's loss as the paper writes it, per sequence i with advantage A_i (row i's):
    s_i = exp(mean_t (logp - old)) over its response tokens, loss = -(1/G) sum_i min(s_i A_i, clip(s_i) A_i)."""
    rows = [i for i in range(mask.shape[0]) if mask[i].sum() > 0]
    total = 0.0
    for i in rows:
        m = mask[i] > 0
        s = np.exp(np.mean(logp[i][m].astype(np.float64) - old[i][m]))
        total += np_clip_term(s, float(adv[i][m][0]))[0]
    return total / len(rows)


def np_gspo_token(logp, old, adv, mask):
    """GSPO-token (the paper's token-level-advantage form, seq-mean-token-mean): the loss and its
    analytic gradient d/d logp_t = -(1/G)(1/|o_i|) [unclipped] A_it s_i, s_{i,t} = sg[s_i] pi_t / sg[pi_t]."""
    rows = [i for i in range(mask.shape[0]) if mask[i].sum() > 0]
    loss, grad = 0.0, np.zeros(mask.shape)
    for i in rows:
        m = mask[i] > 0
        n = m.sum()
        s = np.exp(np.mean(logp[i][m].astype(np.float64) - old[i][m]))
        for t in np.flatnonzero(m):
            value, live = np_clip_term(s, float(adv[i, t]))
            loss += value / n / len(rows)
            grad[i, t] = -float(adv[i, t]) * s / n / len(rows) if live else 0.0
    return loss, grad


def finite_difference(f, x, mask, h=1e-6):
    x = x.astype(np.float64)
    grad = np.zeros(x.shape)
    for idx in zip(*np.nonzero(mask)):
        up, down = x.copy(), x.copy()
        up[idx] += h
        down[idx] -= h
        grad[idx] = (f(up) - f(down)) / (2 * h)
    return grad


def gspo_batch(seed=0, shape=(8, 9)):
    """Sequences whose ratio s_i lies inside GSPO's clip range, below it, above it, and (A < 0)
    beyond the dual clip; a per-sequence advantage on every token; old log-probs ~ -2."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(shape, np.float32)
    for i, (s, n) in enumerate([(0, 9), (1, 4), (2, 1), (0, 0), (3, 6), (0, 7), (5, 3), (1, 8)]):
        mask[i, s:s + n] = 1
    old = np.log(rng.uniform(0.05, 0.5, shape)).astype(np.float32)
    seq_shift = np.array([1e-4, -1e-4, 0.01, 0.0, -0.01, 1.5, 2e-4, -0.02])  # mean log-ratio of each sequence
    noise = rng.normal(0, 0.05, shape)
    noise -= (noise * mask).sum(1, keepdims=True) / np.maximum(mask.sum(1, keepdims=True), 1) * mask
    logp = (old + (seq_shift[:, None] + noise) * mask).astype(np.float32)
    adv = (np.array([1.0, -0.5, 0.7, 0.0, -1.2, -0.8, 0.3, 1.1])[:, None] * mask).astype(np.float32)
    return logp, old, adv, mask


def policy_loss_of(cfg, logp, old, adv, mask, **extra):
    batch = dict(advantages=adv, old_logprobs=old, response_mask=mask, loss_mask=mask,
                 agg_weight=aggregation_weights(mask, cfg.agg), sequence_id=sequence_ids(mask.shape), **extra)
    return lambda lp: policy_loss(cfg, lp, jnp.zeros_like(lp), batch)


# ---- GSPO


def test_gspo_loss_and_gradient_equal_the_papers_sequence_objective():
    logp, old, adv, mask = gspo_batch()
    cfg = LossConfig(**GSPO)
    (loss, stats), grad = jax.jit(jax.value_and_grad(policy_loss_of(cfg, logp, old, adv, mask), has_aux=True))(
        jnp.asarray(logp))
    objective = lambda lp: np_gspo_objective(lp, old, adv, mask)
    np.testing.assert_allclose(float(loss), objective(logp), rtol=1e-5)
    want = finite_difference(objective, logp, mask)  # the paper's sequence objective, differentiated numerically
    np.testing.assert_allclose(np.asarray(grad), want, rtol=2e-3, atol=1e-7)
    # every region is hit: inside the clip (live gradient), clipped, dual-clipped
    live = [np.abs(want[i]).max() > 0 for i in range(8) if mask[i].sum()]
    assert any(live) and not all(live)
    s = np.exp((logp.astype(np.float64) - old).sum(1) / np.maximum(mask.sum(1), 1))
    assert s[5] > C and adv[5].min() < 0  # dual clip binds on sequence 5
    assert float(stats["ratio_max"]) == pytest.approx(s[mask.sum(1) > 0].max(), rel=1e-5)  # the ratio is s_i
    # and it is not the token-level loss
    token = LossConfig(**{**GSPO, "ratio_level": "token"})
    assert abs(float(policy_loss_of(token, logp, old, adv, mask)(jnp.asarray(logp))[0]) - float(loss)) > 1e-3


def test_gspo_token_with_token_level_advantages_matches_numpy():
    logp, old, _, mask = gspo_batch(seed=1)
    adv = (np.random.default_rng(1).choice([-1.5, -0.4, 0.0, 0.6, 2.0], mask.shape) * mask).astype(np.float32)
    cfg = LossConfig(**GSPO)
    loss, grad = jax.jit(jax.value_and_grad(lambda lp: policy_loss_of(cfg, logp, old, adv, mask)(lp)[0]))(
        jnp.asarray(logp))
    want_loss, want_grad = np_gspo_token(logp, old, adv, mask)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-8)


def test_gspo_on_packed_micro_batches_equals_the_whole_batch():
    """The sequence ratio is computed inside each micro-batch from each target's sequence_id:
    packed into many micro-batches of several sequences per row on 2 devices, the summed loss and
    its gradient are the paper's whole-batch ones (every sequence lies in one micro-batch)."""
    logp, old, adv, mask = gspo_batch(seed=2)
    rows, width = mask.shape
    prompt = 3  # each row: a left-padded prompt, then its response
    attn = np.zeros((rows, width + prompt), np.int32)
    resp = np.zeros_like(attn, dtype=np.float32)
    dense = {k: np.zeros_like(resp) for k in ("logp", "old", "adv")}
    for i in range(rows):
        cols = np.flatnonzero(mask[i])
        start = cols[0] if cols.size else 0
        attn[i, start:start + prompt + cols.size] = 1
        resp[i, start + prompt:start + prompt + cols.size] = 1
        for name, x in (("logp", logp), ("old", old), ("adv", adv)):
            dense[name][i, start + prompt:start + prompt + cols.size] = x[i, cols]
    plan = packing.plan_micro_batches(attn, resp, np.arange(rows), tokens_per_device=16, num_devices=2)
    assert len(plan) >= 2 and any(mb.sequences > 2 for mb in plan)
    for i in np.flatnonzero(resp.sum(1)):  # each sequence's targets lie in exactly one micro-batch
        flat = set(i * attn.shape[1] + np.flatnonzero(resp[i]))
        assert sum(bool(flat & set(mb.target_src.ravel().tolist())) for mb in plan) == 1
    cfg = LossConfig(**GSPO)
    weight = aggregation_weights(resp, cfg.agg)
    targets = dict(old_logprobs=dense["old"], advantages=dense["adv"], response_mask=resp, loss_mask=resp,
                   agg_weight=weight, sequence_id=sequence_ids(resp.shape))

    def packed(lp):
        total = 0.0
        for mb in plan:
            arrays = packing.gather(mb, {}, targets)
            used = mb.target_src >= 0
            lp_mb = jnp.where(used, lp.reshape(-1)[np.maximum(mb.target_src, 0)], 0.0)
            total = total + policy_loss(cfg, lp_mb, jnp.zeros_like(lp_mb),
                                        {k: arrays[k] for k in targets})[0]
        return total

    loss, grad = jax.jit(jax.value_and_grad(packed))(jnp.asarray(dense["logp"]))
    want_loss, want_grad = np_gspo_token(dense["logp"], dense["old"], dense["adv"], resp)
    np.testing.assert_allclose(float(loss), np_gspo_objective(dense["logp"], dense["old"], dense["adv"], resp),
                               rtol=1e-5)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-8)


@pytest.mark.slow  # about a minute on 2 cores; CI runs the slow tests
def test_gspo_train_step_gradient_is_the_sequence_objectives_on_a_model():
    """Through the packed train step on a tiny model (many micro-batches): the accumulated
    gradient equals autodiff of the paper's sequence-level GSPO objective on dense logits."""
    from arlopti_jax.models import logits
    from test_train_step import CFG, SINGLE, host, max_diff, params_on, rollout, step_for

    batch, rewards, gids = rollout()
    mask = batch["response_mask"]
    rng = np.random.default_rng(5)
    shift = rng.choice([-2e-4, 1e-4, 0.3, -0.3], mask.shape[0])[:, None]  # inside and outside the clip
    old = (batch["old_logprobs"] - shift * mask).astype(np.float32)
    adv = np_grpo(rewards, gids, mask).astype(np.float32)
    train = {**batch, "old_logprobs": old, "advantages": adv, "loss_mask": mask}
    cfg = LossConfig(clip_low=EL, clip_high=EH, dual_clip=C, kl_coef=0.0, ratio_level="sequence",
                     agg="seq-mean-token-mean")
    step, _ = step_for(SINGLE, 64, "sgd", loss=cfg)
    assert len(step.plan(train, np.arange(mask.shape[0]))) >= 2
    grads, _ = step.gradient(params_on(), train)

    def objective(prm):  # the paper's J, differentiated directly (no stop-gradient trick)
        lg = jax.nn.log_softmax(logits(CFG, prm, train["input_ids"], train["attention_mask"]), -1)
        lp = jnp.take_along_axis(lg[:, :-1], train["input_ids"][:, 1:, None], -1)[..., 0]
        m = mask[:, 1:]
        n = m.sum(1)
        s = jnp.exp(((lp - old[:, 1:]) * m).sum(1) / np.maximum(n, 1))
        a = adv[np.arange(len(n)), np.argmax(mask, 1)]
        term = jnp.maximum(-a * s, -a * jnp.clip(s, 1 - EL, 1 + EH))
        term = jnp.where(a < 0, jnp.minimum(term, -a * C), term)
        return jnp.sum(jnp.where(n > 0, term, 0.0)) / (n > 0).sum()

    want = host(jax.jit(jax.grad(objective))(params_on()))
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(want))
    assert scale > 1e-3 and max_diff(host(grads), want) < 1e-5 * scale


# ---- CISPO


def test_cispo_loss_and_gradient_match_the_papers_formula():
    from test_losses import _tokens

    logp, old, adv, mask = _tokens(seed=6)
    cap = 2.5
    cfg = LossConfig(mode="cispo", cispo_max_weight=cap, kl_coef=0.0, agg="token-mean")
    (loss, stats), grad = jax.jit(jax.value_and_grad(policy_loss_of(cfg, logp, old, adv, mask), has_aux=True))(
        jnp.asarray(logp))
    # J = 1 / sum_i |o_i| sum_{i,t} sg(r^_{i,t}) A_{i,t} log pi_{i,t}, r^ = min(r, 1 + eps_high^IS)
    ratio = np.exp(logp.astype(np.float64) - old)
    weight = np.minimum(ratio, cap)
    np.testing.assert_allclose(float(loss), -(weight * adv * logp * mask).sum() / mask.sum(), rtol=1e-5)
    want_grad = -weight * adv * mask / mask.sum()  # the weight is a constant: d/dlogp = -w A / N
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-8)
    capped = (ratio > cap) & (adv != 0) & (mask > 0)
    assert capped.any() and float(stats["clipfrac_high_sum"]) == capped.sum()
    # a token PPO's clip silences (A > 0, ratio above 1 + eps_high) still carries CISPO's gradient
    _, ppo_grad, _, high, _ = np_ppo(logp, old, adv)
    silenced = high & (mask > 0) & (ppo_grad == 0)
    assert silenced.any() and np.all(np.abs(np.asarray(grad))[silenced] > 0)


def test_loss_modes_refuse_bad_values_naming_the_field():
    for kw, field in [({"mode": "reinforce"}, "mode"), ({"ratio_level": "group"}, "ratio_level"),
                      ({"cispo_max_weight": 0.5}, "cispo_max_weight"),
                      ({"mode": "cispo", "ratio_level": "sequence"}, "ratio_level")]:
        with pytest.raises(ValueError, match=f"LossConfig.{field}"):
            LossConfig(**kw)
    with pytest.raises(ValueError, match="TokenWeightConfig.entropy_top_fraction"):
        TokenWeightConfig(entropy_top_fraction=1.0)


# ---- 80/20: high-entropy tokens


def np_top_entropy(entropies, mask, fraction):
    """The paper's I[H >= tau], tau the (1 - rho)-quantile of the batch's valid tokens' entropies."""
    valid = mask > 0
    tau = np.quantile(entropies[valid].astype(np.float64), 1 - fraction)
    return valid & (entropies >= tau)


@pytest.mark.parametrize("fraction", [0.2, 0.5])
def test_entropy_selection_keeps_the_batchs_top_fraction(fraction):
    from test_losses import _tokens

    _, _, _, mask = _tokens(seed=7)
    h = np.random.default_rng(7).gamma(0.5, 1.0, mask.shape).astype(np.float32)
    got = np.asarray(entropy_top_mask(fraction, jnp.asarray(h), jnp.asarray(mask))) > 0
    np.testing.assert_array_equal(got, np_top_entropy(h, mask, fraction))
    n = int(mask.sum())
    assert got.sum() == n - int(np.ceil((n - 1) * (1 - fraction)))  # distinct values: the top ~rho N
    assert h[got].min() > h[(mask > 0) & ~got].max()  # exactly the highest-entropy valid tokens
    assert not (got & (mask == 0)).any()


def test_prepare_updates_selects_high_entropy_tokens_per_batch_before_lopti():
    from test_losses import _tokens

    _, old, _, mask = _tokens(seed=8)
    rng = np.random.default_rng(8)
    h = rng.gamma(0.5, 1.0, mask.shape).astype(np.float32)
    rewards = rng.choice([0.0, 1.0], mask.shape[0]).astype(np.float32)
    gids = np.array([0, 0, 0, 1, 1, 1], np.int32)
    weights = TokenWeightConfig(weighting="none", entropy_top_fraction=0.2)
    top = np_top_entropy(h, mask, 0.2)
    grpo = np_grpo(rewards, gids, mask)
    (adv, loss_mask), = prepare_updates(AdvantageConfig(), weights, LoptiConfig(), rewards, gids, mask, old, h)
    np.testing.assert_allclose(np.asarray(adv), grpo * top, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(loss_mask), mask)  # KL and entropy terms keep every token
    # with Lopti the two passes split the selected tokens by pi_old, the selection still over the whole batch
    lopti = LoptiConfig(enabled=True, eta=0.4)
    low, high = prepare_updates(AdvantageConfig(), weights, lopti, rewards, gids, mask, old, h)
    is_low = (np.exp(old) < 0.4) & (mask > 0)
    np.testing.assert_allclose(np.asarray(low[0]), grpo * top * is_low, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(high[0]), grpo * top * ~is_low, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="entropy_top_fraction > 0 needs the batch's entropies"):
        prepare_updates(AdvantageConfig(), weights, LoptiConfig(), rewards, gids, mask, old)


def test_entropy_selection_gradient_is_the_ppo_gradient_on_the_selected_tokens():
    """The paper's J_HighEnt: (1 / sum_i |o_i|) sum I[H >= tau] min(r A, clip(r) A), every token in the denominator."""
    from test_losses import EH as PPO_EH, EL as PPO_EL, _tokens

    logp, old, adv, mask = _tokens(seed=9)
    h = np.random.default_rng(9).gamma(0.5, 1.0, mask.shape).astype(np.float32)
    top = np_top_entropy(h, mask, 0.2)
    selected = np.asarray(adv * entropy_top_mask(0.2, jnp.asarray(h), jnp.asarray(mask)))
    cfg = LossConfig(clip_low=PPO_EL, clip_high=PPO_EH, dual_clip=3.0, kl_coef=0.0)
    loss, grad = jax.value_and_grad(lambda lp: policy_loss_of(cfg, logp, old, selected, mask)(lp)[0])(
        jnp.asarray(logp))
    value, d, *_ = np_ppo(logp, old, adv * top)
    np.testing.assert_allclose(float(loss), np_agg(value, mask, "token-mean"), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), d * top * mask / mask.sum(), rtol=1e-5, atol=1e-8)
    assert (np.asarray(grad)[(mask > 0) & ~top] == 0).all() and np.abs(np.asarray(grad)[top]).max() > 0


def test_teacher_forced_entropies_are_pi_olds_at_the_rollout_temperature():
    from arlopti_jax.algos import make_compute_logprobs
    from arlopti_jax.models import logits
    from test_train_step import CFG, SINGLE, mesh_of, params_on, rollout

    batch, _, _ = rollout()
    temperature = 0.7
    fn = make_compute_logprobs(CFG, mesh_of(SINGLE), temperature=temperature, tokens_per_device=64)
    logp, entropy = fn(params_on(), batch, with_entropy=True)
    # the same log-probs as without entropies (another program: to float32 rounding)
    np.testing.assert_allclose(logp, fn(params_on(), batch), rtol=1e-6, atol=2e-6)
    z = np.asarray(logits(CFG, params_on(), batch["input_ids"], batch["attention_mask"]), np.float64) / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.zeros(batch["response_mask"].shape)
    want[:, 1:] = -(p * np.log(p)).sum(-1)[:, :-1]  # the distribution that predicted token t
    want *= batch["response_mask"]
    np.testing.assert_allclose(entropy, want, rtol=1e-4, atol=1e-5)
    assert entropy[batch["response_mask"] > 0].min() > 0.1


def test_config_refuses_bad_values_and_the_meaningless_combination_in_one_line():
    from arlopti_jax.config import ConfigError, FIELD_DOCS, base_config, validate

    cases = [({"loss.mode": "reinforce"}, "loss.mode='reinforce' is invalid: allowed values"),
             ({"loss.ratio_level": "group"}, "loss.ratio_level='group' is invalid: allowed values"),
             ({"loss.cispo_max_weight": 0.9}, "loss.cispo_max_weight=0.9 is invalid: must be >= 1"),
             ({"algo.entropy_top_fraction": 1.0}, "algo.entropy_top_fraction=1.0 is invalid: must be in [0, 1)"),
             ({"algo.entropy_top_fraction": -0.1}, "algo.entropy_top_fraction=-0.1 is invalid"),
             ({"loss.mode": "cispo", "loss.ratio_level": "sequence"},
              "loss.ratio_level='sequence' is invalid: 'sequence' is GSPO's clipped sequence ratio and "
              "loss.mode='cispo' weights each token: choose one")]
    for values, message in cases:
        c = base_config()
        for field, value in values.items():
            group, name = field.split(".")
            c[group][name] = value
        with pytest.raises(ConfigError) as err:
            validate(c)
        assert str(err.value).startswith(f"config.{message}") and "\n" not in str(err.value), str(err.value)
    # what composes is accepted: GSPO with AR and Lopti, CISPO with Lopti, 80/20 with both
    for values in ({"loss.ratio_level": "sequence", "algo.weighting": "ar", "algo.ar_alpha": 0.3,
                    "algo.lopti_eta": 0.5},
                   {"loss.mode": "cispo", "algo.lopti_eta": 0.4, "algo.entropy_top_fraction": 0.2},
                   {"loss.ratio_level": "sequence", "algo.entropy_top_fraction": 0.2, "algo.weighting": "tr"}):
        c = base_config()
        for field, value in values.items():
            group, name = field.split(".")
            c[group][name] = value
        validate(c)
    assert all(f in FIELD_DOCS for f in ("loss.mode", "loss.ratio_level", "loss.cispo_max_weight",
                                         "algo.entropy_top_fraction"))
