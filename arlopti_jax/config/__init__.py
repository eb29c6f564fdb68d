"""The one training configuration (ml_collections) and its validation.

Every field has one meaning everywhere. ``base_config()`` holds the paper's reference
settings (docs/paper.md); experiment files in ``configs/`` start from it and change what
differs. ``validate`` runs at start-up and raises ``ConfigError`` naming the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_collections
from ml_collections import config_dict

from arlopti_jax.runtime.startup import ConfigError  # noqa: F401  (re-exported: config.ConfigError)

from arlopti_jax import algos
from arlopti_jax.config.field_docs import FIELD_DOCS  # noqa: F401  (re-exported: config.FIELD_DOCS)
from arlopti_jax.models.config import ATTENTION_IMPLS, DECODE_ATTENTION_IMPLS, DECODE_MATMUL_IMPLS, LORA_TARGETS
from arlopti_jax.rollout.sampler import WHOLE_WEIGHTS
from arlopti_jax.tasks.data import PROMPT_STYLES

# The config file the train and eval commands use without --config: the embedded default (numerics per backend).
DEFAULT_CONFIG = str(Path(__file__).resolve().parents[1] / "embedded" / "default.py")
LOPTI_SPLITS = ("threshold", "quantile")  # config's own: algos takes LoptiConfig(quantile=...)
DTYPES = ("float32", "bfloat16")
LOGGERS = ("tensorboard", "wandb", "mlflow")  # train.loggers; store/trackers.py implements each


def choices() -> dict[str, tuple[str, ...]]:
    """Each choice field's allowed values, from the registries of the code that implements them
    (``algos``' estimators, weightings, loss modes...; registered ones included), so no list here
    can drift from what runs."""
    return {"algo.adv_estimator": tuple(algos.advantage_estimators()),
            "algo.weighting": tuple(algos.token_weightings()), "algo.lopti_split": LOPTI_SPLITS,
            "loss.kl_type": tuple(algos.KL_ESTIMATORS), "loss.agg": algos.AGG_MODES, "loss.mode": algos.LOSS_MODES,
            "loss.ratio_level": algos.RATIO_LEVELS, "optim.schedule": algos.SCHEDULES,
            "model.dtype": DTYPES, "model.param_dtype": DTYPES, "model.attention": ATTENTION_IMPLS,
            "model.decode_attention": DECODE_ATTENTION_IMPLS,
            "model.decode_matmul": DECODE_MATMUL_IMPLS, "rollout.whole_weights": WHOLE_WEIGHTS,
            "rollout.correction": algos.CORRECTIONS,
            "data.prompt_style": PROMPT_STYLES}


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.run_dir = "runs/run"
    c.seed = 42
    c.resume = "auto"  # auto | none | a checkpoint step folder
    # JAX's persistent compilation cache (arlopti_jax.runtime.compile_cache)
    c.compile_cache_dir = "~/.cache/arlopti_jax/jax"

    c.model = ml_collections.ConfigDict()
    c.model.path = ""  # local Hugging Face folder; "" = the embedded tiny start point
    c.model.dtype = "bfloat16"  # activations
    c.model.param_dtype = "float32"  # weights (and so AdamW state)
    c.model.remat = True
    c.model.unroll_layers = False  # layers as straight-line code, not a loop (faster on CPU; slower compiles)
    c.model.attention = "auto"  # training/prefill attention: auto (cuDNN's fused kernel on GPUs at 16-bit), xla, cudnn
    c.model.decode_attention = "auto"  # the sampler's decode attention: auto (the Pallas kernel on GPUs), xla, pallas
    c.model.decode_matmul = "xla"  # the decode steps' weight products: xla, pallas (GPU; fused norms and adds)
    c.model.logprob_chunk = 256  # targets per packed row in each vocab-projection chunk
    c.model.lora_rank = 0  # LoRA adapters' rank (0 = train every weight)
    c.model.lora_alpha = 16.0  # LoRA's scale is lora_alpha / lora_rank
    c.model.lora_targets = "q,k,v,o,gate,up,down"  # the projections that get adapters

    c.data = ml_collections.ConfigDict()
    c.data.train_files = ""  # comma-separated files or folders (parquet / jsonl), or Hub datasets ORG/NAME[:SPLIT]
    c.data.test_files = ""
    c.data.prompt_key = "prompt"  # the prompt's column (a string or chat messages)
    c.data.answer_key = "reward_model.ground_truth"  # the ground truth's column (dotted: nested)
    c.data.data_source = ""  # for rows without a data_source column; "" = every row has one
    c.data.prompt_style = "auto"  # template (prompt text embeds the chat template) | messages | auto
    c.data.max_prompt_length = 400
    c.data.shuffle_seed = 42

    c.rollout = ml_collections.ConfigDict()
    c.rollout.n = 8  # responses per prompt (G)
    c.rollout.temperature = 0.7
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0
    c.rollout.max_response_length = 4096
    c.rollout.stop = ()  # strings that end a response (vLLM's stop), matched on the decoded text
    c.rollout.include_stop_str = False  # the rewards' text keeps the stop string (vLLM's include_stop_str_in_output)
    c.rollout.prompt_bucket = 64  # prompts are padded to a multiple of this (compile once per bucket)
    c.rollout.recompute_old_logprobs = False  # pi_old from a teacher-forced pass instead of the sampler's
    c.rollout.length_aware = True  # decode cost follows the real response lengths (same tokens as the dense path)
    c.rollout.phase_tokens = 0  # response slots of the first decode phase; 0 = max_response_length / 4 (power of 2)
    c.rollout.min_rows = 16  # rows per device below which finished rows are no longer compacted away
    c.rollout.whole_weights = "auto"  # the sampler's weights whole along the batch axes: auto, on, off
    # the sampling loop: the update of step t consumes the batch sampled k policy versions earlier (rl/pipeline.py)
    c.rollout.max_staleness = 0  # k; 0 = on-policy (sample, then update, one after the other)
    c.rollout.correction = "none"  # none | tis | seq_mask: the pi_old / behaviour-policy gap (algos/off_policy.py)
    c.rollout.tis_cap = 2.0  # tis: C of min(pi_old / pi_behaviour, C)
    c.rollout.seq_mask_bound = 1.01  # seq_mask: keep a response whose geometric-mean ratio is in [1/B, B]
    c.rollout.max_kl = 0.5  # stop the run where the sampler's log-probs are this far (KL) from pi_old; 0 = never
    # the sampler's own devices: 0 = the trainer's mesh (colocated); N = the last N / processes of each process's
    c.rollout.devices = 0
    c.rollout.hosts = 0  # sampler hosts of their own: the last N processes sample with all their devices (rl/hosts.py)
    c.rollout.mesh = ml_collections.ConfigDict()  # the sampler's mesh over those devices (rollout.devices > 0)
    c.rollout.mesh.data = -1
    c.rollout.mesh.fsdp = 1
    c.rollout.mesh.tensor = 1

    c.algo = ml_collections.ConfigDict()
    c.algo.adv_estimator = "grpo"
    c.algo.weighting = "none"  # none | ar | tr
    c.algo.ar_alpha = 0.0
    # TR-GRPO: w = clip(tr_scale * (sigmoid(p / tr_tau) - tr_mu), tr_min, tr_max); defaults are
    # this project's choice (the paper's constants were unavailable): see algos/token_weights.py.
    c.algo.tr_scale = 2.0
    c.algo.tr_tau = 0.25
    c.algo.tr_mu = 0.5
    c.algo.tr_min = 0.1
    c.algo.tr_max = 1.0
    c.algo.lopti_eta = 0.0  # 0 = off; >0 low-probability pass first; <0 high-probability pass first
    c.algo.lopti_split = "threshold"  # threshold on pi_old, or the eta-quantile of the batch
    c.algo.entropy_top_fraction = 0.0  # "80/20": policy gradient on the batch's top fraction by entropy; 0 = off
    # DAPO's dynamic sampling and soft overlong penalty; both off, so the paper's runs are unchanged
    c.algo.filter_groups = False
    c.algo.max_sample_rounds = 4
    c.algo.overlong_buffer = 0
    c.algo.overlong_penalty = 1.0

    c.loss = ml_collections.ConfigDict()
    c.loss.clip_low = 0.2
    c.loss.clip_high = 0.24
    c.loss.dual_clip = 10.0
    c.loss.kl_coef = 0.001
    c.loss.kl_type = "low_var_kl"
    c.loss.entropy_coef = 0.0
    c.loss.agg = "token-mean"
    c.loss.mode = "ppo"  # ppo | cispo (MiniMax-M1's clipped, stop-gradient importance weight)
    c.loss.ratio_level = "token"  # token | sequence (GSPO's sequence-level ratio)
    c.loss.cispo_max_weight = 5.0  # CISPO's upper bound on the importance weight

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 1e-6
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.weight_decay = 0.01
    c.optim.eps = 1e-8
    c.optim.grad_clip = 1.0
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 0
    c.optim.min_lr_ratio = 0.0  # warmup_cosine decays to lr x this

    c.train = ml_collections.ConfigDict()
    c.train.batch_prompts = 64  # prompts per RL step (x rollout.n responses)
    c.train.mini_batch = 256  # responses per optimizer step
    c.train.ppo_epochs = 1  # updates over each rollout batch (the GRPO paper's mu), pi_old the sampler's
    c.train.micro_batch = 8  # sizes the packed micro-batch (with max_tokens_per_micro_batch = 0)
    # tokens per data x fsdp device of a packed micro-batch (sequences packed without padding);
    # 0 = the dense micro-batch's share: micro_batch / (data x fsdp) x (max_prompt_length + max_response_length)
    c.train.max_tokens_per_micro_batch = 0
    c.train.shared_prefix = True  # a group's prompt forwarded once per pass (algos/packing.py)
    c.train.pack_row_lengths = 2  # packed row lengths (algos/packing.py: Shapes): programs per pass =
    c.train.pack_fills = 4  # ... row lengths x these row counts (full, 1/2, 1/4, 1/8 of a micro-batch)
    c.train.epochs = 5
    c.train.max_steps = -1  # -1 = epochs x batches per epoch
    c.train.eval_every = 20
    c.train.eval_before = True
    c.train.eval_n = 1  # sampled responses per test prompt (besides greedy)
    c.train.eval_ks = (1,)  # pass@k / maj@k / mean@k for these k (each <= eval_n)
    c.train.eval_temperature = 1.0  # the reference samples its evaluation at 1.0, not the rollout temperature
    c.train.eval_max_prompts = -1  # cap per data_source for quick evaluation; -1 = all
    c.train.save_generations = True  # every evaluation's responses, per test set, as jsonl
    c.train.save_every = 20
    c.train.save_every_s = 0.0  # also a checkpoint when this many seconds passed since the last (0 = off)
    c.train.grace_s = 30.0  # the seconds a stop signal leaves before SIGKILL (Spot VMs, SLURM's default)
    c.train.keep_checkpoints = 3
    c.train.samples_every = 10  # sample completions to the trackers
    c.train.loggers = "tensorboard"  # comma-separated trackers: tensorboard, wandb, mlflow
    c.train.export_at_end = True
    c.train.diagnostics_every = 0  # gradient norm per pi_old quartile every this many steps; 0 = off
    c.train.diagnostics_rows = 0  # rows it is measured on: 0 = the first mini-batch, -1 = the whole batch
    # with the diagnostics: the isolation experiment at the first step; off by default, since its one
    # fresh-AdamW step cannot show what the paper's Figure 1 shows (field_docs.py says why)
    c.train.isolation_experiment = False

    c.reward = ml_collections.ConfigDict()
    c.reward.fn = ""  # "" = built-in router by data_source; or "module:function"
    c.reward.workers = 4
    c.reward.timeout_s = 10.0
    # a response counts as correct when its score >= this; None: the reward's `acc`, else the task's full score
    c.reward.correct_at = config_dict.placeholder(float)

    # tool episodes (rl/episode_host.py): the policy calls an environment's tools over several turns
    c.env = ml_collections.ConfigDict()
    c.env.name = ""  # "" = single-turn responses; a built-in environment (calc) or 'package.module:Name'
    c.env.params = ""  # the environment's parameters as a JSON object; "" = its defaults
    c.env.max_turns = 4  # turns per episode (each ends at a tool call's close, an EOS or turn_tokens)
    c.env.turn_tokens = 256  # the policy's tokens per turn
    c.env.observation_tokens = 128  # tokens per observation (longer ones are cut, with a marker)
    c.env.observation_format = ""  # "" = the chat template's tool message; or text around {observation}
    c.env.template_tools = True  # prompts with the chat template's own tools section, where it has one
    c.env.step_timeout_s = 60.0  # the environments' resets or steps of one turn's episodes, at most
    c.env.workers = 32  # threads that run the environments' steps

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    c.mesh.dcn_data = -1  # TPU multislice: slices the data axis spans (-1 = all); the rest extend fsdp

    c.distributed = ml_collections.ConfigDict()
    c.distributed.coordinator = ""  # host:port; "" = auto-detect (TPU pods, SLURM) or single process
    c.distributed.num_processes = 0
    c.distributed.process_id = -1
    c.distributed.heartbeat_timeout_s = 100
    return c


def _check(cond: bool, field: str, value, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"config.{field}={value!r} is invalid: {allowed}")


def _choice(c, field: str, allowed) -> None:
    value = c
    for part in field.split("."):
        value = value[part]
    _check(value in allowed, field, value, f"allowed values are {list(allowed)}")


def validate(c: ml_collections.ConfigDict, num_devices: int | None = None, platform: str | None = None,
             num_slices: int = 1) -> None:
    """Raise ConfigError (one line, naming the field) for any invalid value. ``num_devices`` (over
    ``num_slices`` TPU slices) and ``platform`` (``"cpu"``, ``"gpu"``, ``"tpu"``: what the programs are
    compiled for, this machine's ``jax.default_backend()`` or ``aot``'s target's) check the fields
    that depend on them."""
    for field, allowed in choices().items():
        _choice(c, field, allowed)
    _check(platform is None or c.model.attention != "cudnn" or platform == "gpu", "model.attention",
           c.model.attention, f"cuDNN's fused attention runs only on a GPU, and this runs on {platform} "
           "(use 'auto' or 'xla')")
    _check(platform is None or c.model.decode_attention != "pallas" or platform == "gpu", "model.decode_attention",
           c.model.decode_attention, f"the Pallas decode kernel runs only on a GPU, and this runs on {platform} "
           "(use 'auto' or 'xla')")
    _check(platform is None or c.model.decode_matmul != "pallas" or platform == "gpu", "model.decode_matmul",
           c.model.decode_matmul, f"the Pallas decode products run only on a GPU, and this runs on {platform} "
           "(use 'xla')")
    _check(c.model.decode_matmul != "pallas" or c.model.decode_attention != "xla", "model.decode_matmul",
           c.model.decode_matmul, "the fused products run in the Pallas attention's decode steps: they need "
           "model.decode_attention 'auto' or 'pallas'")
    _check(c.model.attention != "cudnn" or c.model.dtype == "bfloat16", "model.attention", c.model.attention,
           "cuDNN's fused attention needs model.dtype='bfloat16' ('auto' falls back to XLA by itself)")
    _check(c.model.lora_rank >= 0, "model.lora_rank", c.model.lora_rank, "must be >= 0 (0 = no LoRA)")
    _check(c.model.lora_alpha > 0, "model.lora_alpha", c.model.lora_alpha, "must be > 0")
    targets = [t for t in str(c.model.lora_targets).split(",") if t]
    _check(bool(targets) and set(targets) <= set(LORA_TARGETS), "model.lora_targets", c.model.lora_targets,
           f"comma-separated names from {','.join(LORA_TARGETS)}")
    _check(0.0 <= c.algo.ar_alpha <= 1.0, "algo.ar_alpha", c.algo.ar_alpha, "must be in [0, 1]")
    eta = c.algo.lopti_eta
    _check(-1.0 <= eta <= 1.0, "algo.lopti_eta", eta, "must be in [-1, 1] (0 = off, sign = pass order)")
    _check(c.algo.weighting == "ar" or c.algo.ar_alpha == 0.0, "algo.ar_alpha", c.algo.ar_alpha,
           "only used with algo.weighting='ar'; set algo.weighting='ar' or ar_alpha=0")
    _check(c.algo.tr_tau > 0, "algo.tr_tau", c.algo.tr_tau, "must be > 0")
    _check(c.algo.tr_scale > 0, "algo.tr_scale", c.algo.tr_scale, "must be > 0 (weight increasing in p)")
    _check(c.algo.tr_min <= c.algo.tr_max, "algo.tr_min", c.algo.tr_min, "must be <= algo.tr_max")
    _check(not (c.algo.lopti_split == "quantile" and abs(eta) >= 1), "algo.lopti_eta", eta,
           "with lopti_split='quantile', |eta| is a quantile level in (0, 1)")
    _check(c.rollout.n >= 1, "rollout.n", c.rollout.n, "must be >= 1")
    _check(c.rollout.temperature > 0, "rollout.temperature", c.rollout.temperature, "must be > 0")
    _check(0.0 < c.rollout.top_p <= 1.0, "rollout.top_p", c.rollout.top_p, "must be in (0, 1]")
    _check(c.rollout.top_k >= 0, "rollout.top_k", c.rollout.top_k, "must be >= 0 (0 = off)")
    _check(c.rollout.max_response_length >= 1, "rollout.max_response_length", c.rollout.max_response_length,
           "must be >= 1")
    stop = c.rollout.stop
    _check(isinstance(stop, (tuple, list)) and all(isinstance(s, str) and s for s in stop), "rollout.stop", stop,
           "must be a tuple of non-empty strings, e.g. --config.rollout.stop=\"('</answer>',)\" (() = none)")
    _check(c.rollout.prompt_bucket >= 1, "rollout.prompt_bucket", c.rollout.prompt_bucket, "must be >= 1")
    _check(c.data.max_prompt_length >= 1, "data.max_prompt_length", c.data.max_prompt_length, "must be >= 1")
    for field in ("loss.clip_low", "loss.clip_high"):
        v = c.loss[field.split(".")[1]]
        _check(0.0 < v < 1.0, field, v, "must be in (0, 1)")
    _check(c.loss.dual_clip > 1.0, "loss.dual_clip", c.loss.dual_clip, "must be > 1")
    _check(c.loss.kl_coef >= 0, "loss.kl_coef", c.loss.kl_coef, "must be >= 0")
    _check(c.loss.cispo_max_weight >= 1, "loss.cispo_max_weight", c.loss.cispo_max_weight,
           "must be >= 1 (an upper bound on the importance weight, whose on-policy value is 1)")
    conflict = algos.loss_mode_conflict(c.loss.mode, c.loss.ratio_level)
    _check(conflict is None, "loss.ratio_level", c.loss.ratio_level, conflict)
    top = c.algo.entropy_top_fraction
    _check(0.0 <= top < 1.0, "algo.entropy_top_fraction", top, "must be in [0, 1) (0 = off; the paper: 0.2)")
    _check(c.optim.lr > 0, "optim.lr", c.optim.lr, "must be > 0")
    _check(c.optim.grad_clip > 0, "optim.grad_clip", c.optim.grad_clip, "must be > 0")
    _check(c.optim.warmup_steps >= 0, "optim.warmup_steps", c.optim.warmup_steps, "must be >= 0")
    _check(c.resume in ("auto", "none") or bool(c.resume), "resume", c.resume, "auto | none | a checkpoint folder")

    t = c.train
    responses = t.batch_prompts * c.rollout.n
    _check(t.batch_prompts >= 1, "train.batch_prompts", t.batch_prompts, "must be >= 1")
    _check(t.mini_batch >= 1 and responses % t.mini_batch == 0, "train.mini_batch", t.mini_batch,
           f"must divide train.batch_prompts x rollout.n = {responses}")
    _check(type(t.ppo_epochs) is int and t.ppo_epochs >= 1, "train.ppo_epochs", t.ppo_epochs,
           "must be an integer >= 1 (1 = one update over each rollout batch)")
    sized_by_rows = t.max_tokens_per_micro_batch == 0  # else the token budget sizes the micro-batch, not micro_batch
    _check(not sized_by_rows or t.micro_batch >= 1 and t.mini_batch % t.micro_batch == 0, "train.micro_batch",
           t.micro_batch, f"must divide train.mini_batch = {t.mini_batch}")
    for field in ("epochs", "eval_every", "save_every", "keep_checkpoints", "samples_every", "eval_n",
                  "pack_row_lengths", "pack_fills"):
        _check(t[field] >= 1, f"train.{field}", t[field], "must be >= 1")
    _check(t.max_steps == -1 or t.max_steps >= 1, "train.max_steps", t.max_steps, "must be -1 or >= 1")
    _check(t.save_every_s >= 0, "train.save_every_s", t.save_every_s, "must be >= 0 (0 = off)")
    _check(t.grace_s > 0, "train.grace_s", t.grace_s, "must be > 0")
    longest = c.data.max_prompt_length + c.rollout.max_response_length
    _check(t.max_tokens_per_micro_batch == 0 or t.max_tokens_per_micro_batch >= longest,
           "train.max_tokens_per_micro_batch", t.max_tokens_per_micro_batch,
           f"must be 0 (auto) or hold the longest sequence, data.max_prompt_length + "
           f"rollout.max_response_length = {longest}")
    ks = t.eval_ks
    _check(isinstance(ks, (tuple, list)) and len(ks) > 0 and all(type(k) is int and 1 <= k <= t.eval_n for k in ks),
           "train.eval_ks", ks, f"must be integers k with 1 <= k <= train.eval_n = {t.eval_n}, e.g. 1,4,8")
    _check(t.eval_temperature > 0, "train.eval_temperature", t.eval_temperature, "must be > 0")
    _check(t.diagnostics_every >= 0, "train.diagnostics_every", t.diagnostics_every, "must be >= 0 (0 = off)")
    _check(t.diagnostics_rows >= -1, "train.diagnostics_rows", t.diagnostics_rows,
           "must be -1 (the whole batch), 0 (the first mini-batch) or a row count")
    a = c.algo
    _check(a.max_sample_rounds >= 1, "algo.max_sample_rounds", a.max_sample_rounds, "must be >= 1")
    _check(not a.filter_groups or c.rollout.n >= 2, "algo.filter_groups", a.filter_groups,
           "needs rollout.n >= 2 (a group of one response never has unequal rewards)")
    _check(0 <= a.overlong_buffer < c.rollout.max_response_length, "algo.overlong_buffer", a.overlong_buffer,
           f"must be in [0, rollout.max_response_length = {c.rollout.max_response_length}) (0 = off)")
    _check(a.overlong_penalty >= 0, "algo.overlong_penalty", a.overlong_penalty, "must be >= 0")
    _check(c.rollout.phase_tokens >= 0, "rollout.phase_tokens", c.rollout.phase_tokens, "must be >= 0 (0 = auto)")
    _check(c.rollout.min_rows >= 1, "rollout.min_rows", c.rollout.min_rows, "must be >= 1")
    k = c.rollout.max_staleness
    _check(type(k) is int and k >= 0, "rollout.max_staleness", k,
           "must be an integer >= 0 (0 = on-policy; k = the update of step t consumes the batch sampled by the "
           "policy of step t - k)")
    _check(c.rollout.correction == "none" or k >= 1 or c.rollout.recompute_old_logprobs or c.rollout.devices
           or c.rollout.hosts,
           "rollout.correction", c.rollout.correction, "corrects pi_old against the sampler's log-probs, and with "
           "rollout.max_staleness=0, rollout.devices=0 and rollout.recompute_old_logprobs=False pi_old may be the "
           "sampler's: set one of them, or correction='none'")
    _check(math.isfinite(c.rollout.max_kl) and c.rollout.max_kl >= 0, "rollout.max_kl", c.rollout.max_kl,
           "must be a finite number >= 0 (0 = no bound)")
    _check(type(c.rollout.hosts) is int and c.rollout.hosts >= 0, "rollout.hosts", c.rollout.hosts,
           "must be an integer >= 0 (0 = the sampler shares the trainer's hosts)")
    _check(not c.rollout.hosts or not c.rollout.devices, "rollout.hosts", c.rollout.hosts,
           f"cannot be set beside rollout.devices={c.rollout.devices}: the sampler has either hosts of its own or "
           "devices of every host")
    _check(math.isfinite(c.rollout.tis_cap) and c.rollout.tis_cap >= 1, "rollout.tis_cap", c.rollout.tis_cap,
           "must be a finite number >= 1 (the cap on pi_old / pi_behaviour, whose on-policy value is 1)")
    _check(math.isfinite(c.rollout.seq_mask_bound) and c.rollout.seq_mask_bound > 1, "rollout.seq_mask_bound",
           c.rollout.seq_mask_bound, "must be a finite number > 1 (responses whose geometric-mean ratio leaves "
           "[1/B, B] are masked)")
    _check(c.distributed.heartbeat_timeout_s >= 1, "distributed.heartbeat_timeout_s", c.distributed.heartbeat_timeout_s,
           "must be >= 1")
    _check(c.reward.workers >= 0, "reward.workers", c.reward.workers, "must be >= 0")
    _check(c.reward.timeout_s > 0, "reward.timeout_s", c.reward.timeout_s, "must be > 0")
    _check(not c.reward.fn or ":" in c.reward.fn, "reward.fn", c.reward.fn, "must be 'module:function' or ''")
    at = c.reward.correct_at
    _check(at is None or math.isfinite(at), "reward.correct_at", at, "must be a finite number (or unset)")
    for field in ("prompt_key", "answer_key"):
        key = c.data[field]
        _check(bool(key) and all(key.split(".")), f"data.{field}", key, "must name a column (dotted: a nested one)")
    loggers = [name for name in str(c.train.loggers).split(",") if name]
    _check(set(loggers) <= set(LOGGERS) and len(set(loggers)) == len(loggers), "train.loggers", c.train.loggers,
           f"comma-separated names from {','.join(LOGGERS)}, each once ('' = metrics.jsonl alone)")
    _validate_env(c)

    _check(c.mesh.dcn_data == -1 or c.mesh.dcn_data >= 1, "mesh.dcn_data", c.mesh.dcn_data,
           "must be -1 (every slice) or a slice count >= 1")
    split = c.rollout.devices
    _check(type(split) is int and split >= 0, "rollout.devices", split,
           "must be an integer >= 0 (0 = the sampler shares the trainer's mesh)")
    _check(not split or num_devices is None or split < num_devices, "rollout.devices", split,
           f"must leave the trainer at least one of the {num_devices} devices")
    _check(not split or num_slices == 1, "rollout.devices", split,
           f"split meshes are laid out inside one TPU slice, and this job spans {num_slices}")
    if split and num_devices is not None:
        from arlopti_jax.runtime.sharding import mesh_sizes
        try:
            mesh_sizes(dict(c.rollout.mesh), split)
        except ValueError as err:
            raise ConfigError(f"config.rollout.mesh={dict(c.rollout.mesh)} is invalid for the sampler's "
                              f"rollout.devices={split}: {err}") from None
        num_devices -= split  # the trainer's
    if c.rollout.hosts and num_devices is not None:
        num_devices //= 2  # the trainer's hosts hold half the job's devices (rl/hosts.roles checks the split)
    if num_devices is not None:
        from arlopti_jax.runtime.sharding import mesh_sizes
        try:
            sizes = mesh_sizes(dict(c.mesh), num_devices, num_slices)
        except ValueError as err:
            raise ConfigError(f"config.mesh={dict(c.mesh)} is invalid"
                              + (f" for the trainer's {num_devices} devices (rollout.devices={split} sample)"
                                 if split else "") + f": {err}") from None
        per = sizes["data"] * sizes["fsdp"]
        _check(not sized_by_rows or t.micro_batch % per == 0, "train.micro_batch", t.micro_batch,
               f"must be divisible by the mesh's data x fsdp = {per} (batch is split over those axes)")


def _validate_env(c: ml_collections.ConfigDict) -> None:
    """``env.*``; with ``env.name`` set, the environment is made once (a bad name, module or parameter
    stops here: ``tasks.envs.load_environment``) and its stop string checked."""
    e = c.env
    for field in ("max_turns", "turn_tokens", "observation_tokens", "workers"):
        _check(type(e[field]) is int and e[field] >= 1, f"env.{field}", e[field], "must be an integer >= 1")
    _check(e.step_timeout_s > 0, "env.step_timeout_s", e.step_timeout_s, "must be > 0")
    _check(not e.observation_format or e.observation_format.count("{observation}") == 1, "env.observation_format",
           e.observation_format, "must hold {observation} once, where the tool's output goes ('' = the chat "
           "template's tool message)")
    if not e.name:
        return
    from arlopti_jax.rollout.markers import check_marker
    from arlopti_jax.tasks.envs import load_environment

    r = c.rollout.max_response_length
    _check(e.turn_tokens <= r, "env.turn_tokens", e.turn_tokens,
           f"must be at most rollout.max_response_length = {r} (an episode's tokens after the prompt, in all)")
    _check(e.observation_tokens < r, "env.observation_tokens", e.observation_tokens,
           f"must be below rollout.max_response_length = {r}")
    _check(not c.rollout.stop, "rollout.stop", c.rollout.stop, "must be () with env.name: an episode's turns end at "
           "the environment's own stop string")
    try:
        params = json.loads(e.params or "{}")
    except ValueError as err:
        raise ConfigError(f"config.env.params={e.params!r} is invalid: not JSON ({err})") from None
    _check(isinstance(params, dict), "env.params", e.params, "must be a JSON object of the environment's parameters")
    factory = load_environment(e.name, params, field="config.env.name")  # EnvironmentLoadError: a ConfigError
    stops = factory.stop_strings
    _check(len(stops) == 1, "env.name", e.name, f"the environment's stop_strings {stops!r} must be one string, the "
           "close of a tool call (where a turn ends)")
    problem = check_marker(stops[0])
    _check(problem is None, "env.name", e.name, f"the environment's stop string {stops[0]!r} {problem}")


def field_paths(c: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """Every leaf field's dotted path."""
    out = []
    for key, value in c.items():
        path = f"{prefix}{key}"
        out += field_paths(value, path + ".") if isinstance(value, ml_collections.ConfigDict) else [path]
    return out


def load_config_file(path, arg: str = "") -> ml_collections.ConfigDict:
    """``get_config(arg)`` of a Python config file (as ``--config=PATH:ARG`` would load it)."""
    import importlib.util

    module_spec = importlib.util.spec_from_file_location("_arlopti_config", str(path))
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def apply_layout(c: ml_collections.ConfigDict, data: int, fsdp: int, tensor: int,
                 param_dtype: str | None = None) -> ml_collections.ConfigDict:
    """Set a mesh layout: one sequence per data x fsdp device per micro-batch, per-layer remat."""
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = data, fsdp, tensor
    c.train.micro_batch = data * fsdp
    if param_dtype is not None:
        c.model.param_dtype = param_dtype
    c.model.remat = True
    return c
