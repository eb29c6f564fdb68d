"""RL algorithms: advantage estimators, AR/TR token weights and Lopti, losses, the train step.

One rollout batch, top to bottom (see ``train_step.update_on_batch``):
    passes = prepare_updates(adv_cfg, weight_cfg, lopti_cfg, rewards, group_ids, response_mask, old_logprobs)
    params, opt_state, metrics = update_on_batch(step, params, opt_state, batch, passes, mini_batch_size)
"""

from arlopti_jax.algos.advantages import (AdvantageConfig, advantage_estimators, compute_advantages,
                                          register_advantage_estimator)
from arlopti_jax.algos.diagnostics import (isolation_experiment, make_quartile_grad_norms, probability_quartiles,
                                           quartile_grad_norm_metrics, quartile_masks)
from arlopti_jax.algos.losses import (AGG_MODES, KL_ESTIMATORS, LOSS_MODES, RATIO_LEVELS, LossConfig,
                                      aggregation_weights, cispo_loss, clipped_surrogate, kl_penalty,
                                      loss_mode_conflict, policy_loss, ppo_clipped_loss, sequence_ids, sequence_mean)
from arlopti_jax.algos.off_policy import (CORRECTIONS, CorrectionConfig, correct_passes, correction_weights,
                                          mismatch_metrics, sequence_log_ratio)
from arlopti_jax.algos.token_weights import (LoptiConfig, TokenWeightConfig, entropy_top_mask, lopti_masks,
                                             lopti_threshold, prepare_updates, register_token_weighting,
                                             token_weightings, weight_advantages)
from arlopti_jax.algos.train_step import (SCHEDULES, OptimConfig, TrainStep, current_lr, init_opt_state,
                                          make_compute_logprobs, make_optimizer, make_schedule, make_train_step,
                                          opt_state_shardings,
                                          update_on_batch)

__all__ = [
    "AdvantageConfig", "advantage_estimators", "compute_advantages", "register_advantage_estimator",
    "isolation_experiment", "make_quartile_grad_norms", "probability_quartiles", "quartile_grad_norm_metrics",
    "quartile_masks",
    "AGG_MODES", "KL_ESTIMATORS", "LOSS_MODES", "RATIO_LEVELS", "LossConfig", "aggregation_weights", "cispo_loss",
    "clipped_surrogate", "kl_penalty", "loss_mode_conflict", "policy_loss", "ppo_clipped_loss", "sequence_ids",
    "sequence_mean",
    "CORRECTIONS", "CorrectionConfig", "correct_passes", "correction_weights", "mismatch_metrics",
    "sequence_log_ratio",
    "LoptiConfig", "TokenWeightConfig", "entropy_top_mask", "lopti_masks", "lopti_threshold", "prepare_updates",
    "register_token_weighting", "token_weightings", "weight_advantages",
    "SCHEDULES", "OptimConfig", "TrainStep", "current_lr", "init_opt_state", "make_compute_logprobs",
    "make_optimizer", "make_schedule", "make_train_step", "opt_state_shardings", "update_on_batch",
]
