"""The paper's Knights-and-Knaves runs (docs/paper.md, "Reference K&K run").

    python -m arlopti_jax.train --config=configs/kk.py:3b,grpo_ar_lopti \
        --config.model.path=/ckpt/Qwen2.5-3B-Instruct \
        --config.data.train_files=data/kk/3ppl/train.parquet,data/kk/4ppl/train.parquet \
        --config.run_dir=runs/kk3b_ar_lopti

The argument is MODEL,VARIANT:
  MODEL    3b  (Qwen2.5-3B-Instruct) | 7b  (Qwen2.5-7B-Instruct-1M) | qwen3-8b (Qwen3-8B)
           gemma3-4b (gemma-3-4b-it's text model)
  VARIANT  grpo | grpo_ar | grpo_lopti | grpo_ar_lopti                    (GRPO, the paper's table)
           rpp  | rpp_ar  | rpp_lopti  | rpp_ar_lopti                     (REINFORCE++ baseline)
Data defaults follow the reference layout (data/kk/{3..7}ppl/{train,test}.parquet); name train
files only: a folder is not searched below its own files, and the reference's folder-level path
also pulled the test files into training.
"""

from arlopti_jax.config import base_config

MODELS = {"3b": "models/Qwen2.5-3B-Instruct", "7b": "models/Qwen2.5-7B-Instruct-1M", "qwen3-8b": "models/Qwen3-8B",
          "gemma3-4b": "models/gemma-3-4b-it"}
# (weighting, alpha, lopti eta): alpha 0.2 for AR alone, 0.3 with Lopti; eta 0.4 alone, 0.5 with AR.
VARIANTS = {"": ("none", 0.0, 0.0), "_ar": ("ar", 0.2, 0.0), "_lopti": ("none", 0.0, 0.4),
            "_ar_lopti": ("ar", 0.3, 0.5)}
SIZES = range(3, 8)


def get_config(arg: str = "3b,grpo_ar_lopti"):
    try:
        model, variant = arg.split(",")
        estimator, suffix = variant.split("_", 1) if "_" in variant else (variant, "")
        suffix = f"_{suffix}" if suffix else ""
        weighting, alpha, eta = VARIANTS[suffix]
        estimator = {"grpo": "grpo", "rpp": "reinforce_plus_plus"}[estimator]
        path = MODELS[model]
    except (ValueError, KeyError):
        raise ValueError(f"configs/kk.py:{arg}: expected MODEL,VARIANT with MODEL in {sorted(MODELS)} and VARIANT "
                         "in grpo|rpp + ''|_ar|_lopti|_ar_lopti (e.g. 3b,grpo_ar_lopti)") from None
    c = base_config()
    c.run_dir = f"runs/kk_{model}_{variant}"
    c.model.path = path
    c.model.dtype = "bfloat16"
    c.model.remat = True
    c.data.train_files = ",".join(f"data/kk/{n}ppl/train.parquet" for n in SIZES)
    c.data.test_files = ",".join(f"data/kk/{n}ppl/test.parquet" for n in SIZES)
    c.data.max_prompt_length = 400
    c.data.shuffle_seed = 42
    c.rollout.n = 8
    c.rollout.temperature = 0.7
    c.rollout.top_p = 1.0
    c.rollout.max_response_length = 4096
    # bf16: the sampler's log-probs and a teacher-forced pass can differ enough to clip tokens before
    # the policy moves (6.4% of the first mini-batch against 1.1% with recompute, on a random 1.5B
    # model with logits scaled x3; 0% for both unscaled): docs/measurements/journal.md, GPU section
    c.rollout.recompute_old_logprobs = True
    c.algo.adv_estimator = estimator
    c.algo.weighting, c.algo.ar_alpha, c.algo.lopti_eta = weighting, alpha, eta
    c.loss.kl_coef = 0.001
    c.loss.kl_type = "low_var_kl"
    c.optim.lr = 1e-6
    c.optim.weight_decay = 0.01
    c.optim.schedule = "constant"
    c.train.batch_prompts = 64
    c.train.mini_batch = 256
    c.train.micro_batch = 8
    c.train.epochs = 5
    c.train.eval_every = 20
    c.train.save_every = 20
    c.train.eval_n = 1
    c.train.eval_temperature = 1.0  # the reference samples its evaluation at 1.0 (top_p 1), not at 0.7
    return c
