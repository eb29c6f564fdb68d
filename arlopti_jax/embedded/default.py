"""The embedded default: GRPO + AR + Lopti on a tiny Qwen2-architecture policy, on CPU.

``python -m arlopti_jax.train`` with no flags uses this. Nothing is downloaded: the start
point (a tokenizer trained on generated K&K text and a small model warm-started on
generated 2-3 person puzzles; see ``arlopti_jax.embedded.start_point``) is built once in the run
folder's parent. Sizes are chosen to finish on 2 CPU cores in minutes.
"""

from arlopti_jax.config import base_config


def get_config():
    c = base_config()
    c.run_dir = "runs/default"
    c.model.path = ""  # the embedded start point
    c.model.dtype = "float32"
    c.model.remat = False
    c.model.unroll_layers = True  # 4 layers: straight-line code is faster on CPU
    c.data.max_prompt_length = 256
    c.rollout.n = 8
    c.rollout.temperature = 1.0
    c.rollout.max_response_length = 48
    # 48-token responses: the dense sampler's few programs per batch shape compile faster than the
    # length-aware sampler's phases and row buckets save in decoding (about 75 s per run)
    c.rollout.length_aware = False
    c.rollout.prompt_bucket = 64
    c.algo.weighting = "ar"  # the paper's best combination: AR (alpha 0.3) + Lopti (eta 0.5)
    c.algo.ar_alpha = 0.3
    c.algo.lopti_eta = 0.5
    c.optim.lr = 5e-4  # a tiny model needs far more than the paper's 1e-6; decayed to damp late drift
    c.optim.weight_decay = 0.0
    c.optim.schedule = "warmup_cosine"
    c.optim.warmup_steps = 4  # optimizer steps (4 per RL step with Lopti)
    c.optim.min_lr_ratio = 0.1
    c.train.batch_prompts = 8
    c.train.mini_batch = 32
    c.train.micro_batch = 32
    c.train.max_steps = 30
    c.train.eval_every = 15
    c.train.save_every = 10
    c.train.eval_n = 1
    c.train.samples_every = 5
    c.reward.workers = 0  # K&K scoring is cheap: inline
    return c
