"""GRPO (+ AR / Lopti) on DeepScaleR-format math data, evaluated on MATH500, AIME and AMC.

    python -m arlopti_jax.train --config=configs/math.py:grpo_ar_lopti \
        --config.model.path=/ckpt/Qwen2.5-Math-7B --config.data.train_files=data/math/deepscaler_uniform_train.parquet

docs/paper.md gives no math hyperparameters beyond the reward scheme; these follow the K&K
reference (lr, clip, KL, batch) with a 3072-token response budget: this project's choice.
"""

from arlopti_jax.config import base_config

VARIANTS = {"grpo": ("none", 0.0, 0.0), "grpo_ar": ("ar", 0.2, 0.0), "grpo_lopti": ("none", 0.0, 0.4),
            "grpo_ar_lopti": ("ar", 0.3, 0.5)}


def get_config(variant: str = "grpo_ar_lopti"):
    if variant not in VARIANTS:
        raise ValueError(f"configs/math.py:{variant}: expected one of {sorted(VARIANTS)}")
    c = base_config()
    c.run_dir = f"runs/math_{variant}"
    c.model.path = "models/Qwen2.5-Math-7B"
    c.data.train_files = "data/math/deepscaler_uniform_train.parquet"
    c.data.test_files = "data/math/math500.parquet,data/math/aime.parquet,data/math/amc.parquet"
    c.data.prompt_style = "messages"
    c.data.max_prompt_length = 1024
    c.rollout.max_response_length = 3072
    c.rollout.recompute_old_logprobs = True  # bf16 sampler log-probs drift from the update's: see configs/kk.py
    c.algo.weighting, c.algo.ar_alpha, c.algo.lopti_eta = VARIANTS[variant]
    c.train.batch_prompts = 64
    c.train.mini_batch = 256
    c.train.micro_batch = 8
    c.train.epochs = 1
    c.reward.workers = 8
    return c
