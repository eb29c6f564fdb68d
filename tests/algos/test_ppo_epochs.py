"""``train.ppo_epochs`` (the GRPO paper's mu) in ``update_on_batch``: mu epochs over one rollout
batch with pi_old held at the sampling policy, against a direct transcription (one-epoch updates
in a row, and the optimizer steps one by one), Lopti's passes in each epoch, and the metrics the
trainer logs. The tiny policy and the train steps are test_train_step's (one compile for the file)."""

import jax
import numpy as np
import pytest

from arlopti_jax.algos import AdvantageConfig, LoptiConfig, TokenWeightConfig, prepare_updates, update_on_batch
from arlopti_jax.rl.update import update_metrics
from test_train_step import _adam_state, host, logprobs_fn, max_diff, params_on, rollout, step_for

GRPO = AdvantageConfig("grpo")


def grpo_passes(batch, rewards, gids, lopti=LoptiConfig()):
    return prepare_updates(GRPO, TokenWeightConfig(), lopti, rewards, gids, batch["response_mask"],
                           batch["old_logprobs"])


def test_two_epochs_equal_two_one_epoch_updates_with_pi_old_held():
    """mu = 2 is the one-epoch update twice on the same batch, pi_old the sampler's both times
    (params and metrics to float32 rounding); recomputing pi_old after the first epoch, as a
    wrong implementation would, gives another update."""
    step, _ = step_for(optim="adam")
    batch, rewards, gids = rollout()
    passes = grpo_passes(batch, rewards, gids)
    got, _, metrics = update_on_batch(step, params_on(), _adam_state(params_on()), batch, passes, 8, epochs=2)
    assert len(metrics) == 2 and [m["optimizer_steps"] for m in metrics] == [2, 2]

    params, state, first = update_on_batch(step, params_on(), _adam_state(params_on()), batch, passes, 8)
    after_first = logprobs_fn()(params, batch)  # the policy after epoch 1 (read, not donated)
    params, state, second = update_on_batch(step, params, state, batch, passes, 8)
    assert max_diff(host(got), host(params)) < 1e-6
    for epoch, want in zip(metrics, first + second):
        assert set(epoch) == set(want)
        for name, value in want.items():
            np.testing.assert_allclose(epoch[name], value, rtol=1e-6, atol=1e-9, err_msg=name)
    # epoch 2 is measured against the sampler's pi_old: its log-ratios have moved away from 0
    kl = [abs(m["ppo_kl"]) for m in metrics]
    assert kl[1] > 10 * kl[0] and kl[1] > 1e-3

    wrong_batch = {**batch, "old_logprobs": after_first}  # pi_old recomputed between the epochs
    params, state, _ = update_on_batch(step, params_on(), _adam_state(params_on()), batch, passes, 8)
    wrong, _, (wrong_second,) = update_on_batch(step, params, state, wrong_batch, passes, 8)
    assert max_diff(host(wrong), host(got)) > 1e-4
    assert abs(wrong_second["ppo_kl"]) < kl[1] / 2


def test_lopti_two_epochs_run_low_high_low_high():
    """With Lopti, each epoch runs the low pass then the high pass over both mini-batches: the
    same as the eight optimizer steps taken one by one in that order (bit for bit: the same
    programs on the same inputs), not as both epochs of one pass before the other's. One epoch
    is exactly its first four steps."""
    step, _ = step_for(optim="adam")
    batch, rewards, gids = rollout()
    p = np.exp(batch["old_logprobs"].astype(np.float64))
    eta = float(np.median(p[batch["response_mask"] > 0]))
    passes = grpo_passes(batch, rewards, gids, LoptiConfig(True, eta))
    got, _, metrics = update_on_batch(step, params_on(), _adam_state(params_on()), batch, passes, 8, epochs=2)
    one, _, _ = update_on_batch(step, params_on(), _adam_state(params_on()), batch, passes, 8, epochs=1)
    assert len(metrics) == 4 and all(m["optimizer_steps"] == 2 for m in metrics)

    fulls = [{**batch, "advantages": np.asarray(a), "loss_mask": np.asarray(m)} for a, m in passes]

    def by_hand(order):
        params, state, trace = params_on(), _adam_state(params_on()), []
        for i in order:
            for rows in (slice(0, 8), slice(8, 16)):
                params, state, _ = step(params, state, {k: v[rows] for k, v in fulls[i].items()})
            trace.append(jax.device_get(params))
        return trace

    low_high = by_hand((0, 1, 0, 1))
    assert max_diff(host(got), host(low_high[3])) == 0.0
    assert max_diff(host(one), host(low_high[1])) == 0.0
    assert max_diff(host(got), host(by_hand((0, 0, 1, 1))[3])) > 1e-4  # the order matters


def test_the_logged_update_metrics_of_each_epoch_and_over_all_of_them():
    """``update/<pass>/...`` over every epoch (means, the ratio's max, the steps summed) and
    ``update/epochK/<pass>/...`` per epoch with mu > 1; mu = 1 keeps the names it had; a
    negative eta (high pass first) names the passes in the order they ran."""
    names = ("pg_loss", "ratio_max", "optimizer_steps", "lr")
    per_run = [dict(zip(names, (float(i), 1.0 + i % 3, 2.0, 1e-3))) for i in range(4)]  # epoch-major
    got = update_metrics(per_run, LoptiConfig(True, 0.5), epochs=2)
    assert got["update/epoch1/low/pg_loss"] == 0.0 and got["update/epoch1/high/pg_loss"] == 1.0
    assert got["update/epoch2/low/pg_loss"] == 2.0 and got["update/epoch2/high/pg_loss"] == 3.0
    assert got["update/low/pg_loss"] == pytest.approx(1.0) and got["update/high/pg_loss"] == pytest.approx(2.0)
    assert got["update/low/ratio_max"] == 3.0 and got["update/high/ratio_max"] == 2.0  # 1, 3 and 2, 1
    assert got["update/low/optimizer_steps"] == 4.0 and got["update/low/lr"] == pytest.approx(1e-3)
    assert len(got) == 3 * 2 * len(names)

    assert update_metrics(per_run[:2], LoptiConfig(True, 0.5)) == {
        f"update/{p}/{k}": per_run[i][k] for i, p in enumerate(("low", "high")) for k in names}
    assert update_metrics(per_run[:1], LoptiConfig()) == {f"update/{k}": v for k, v in per_run[0].items()}
    high_first = update_metrics(per_run[:2], LoptiConfig(True, -0.5))
    assert high_first["update/high/pg_loss"] == 0.0 and high_first["update/low/pg_loss"] == 1.0
    plain = update_metrics(per_run[:2], LoptiConfig(), epochs=2)
    assert plain["update/epoch2/pg_loss"] == 1.0 and plain["update/optimizer_steps"] == 4.0
