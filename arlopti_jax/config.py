"""The one training configuration (ml_collections) and its validation.

Every field has one meaning everywhere. ``base_config()`` holds the paper's reference
settings (PAPER.md); experiment files in ``configs/`` start from it and change what
differs. ``validate`` runs at start-up and raises ``ConfigError`` naming the field.
"""

from __future__ import annotations

import ml_collections

ADV_ESTIMATORS = ("grpo", "reinforce_plus_plus", "rloo", "dr_grpo")
WEIGHTINGS = ("none", "ar", "tr")
LOPTI_SPLITS = ("threshold", "quantile")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
SCHEDULES = ("constant", "warmup_cosine")
DTYPES = ("float32", "bfloat16")
PROMPT_STYLES = ("auto", "template", "messages")


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field."""


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.run_dir = "runs/run"
    c.seed = 42
    c.resume = "auto"  # auto | none | a checkpoint step folder

    c.model = ml_collections.ConfigDict()
    c.model.path = ""  # local Hugging Face folder; "" = the embedded tiny start point
    c.model.dtype = "bfloat16"  # activations
    c.model.param_dtype = "float32"  # weights (and so AdamW state)
    c.model.remat = True
    c.model.unroll_layers = False  # layers as straight-line code, not a loop (faster on CPU; slower compiles)
    c.model.logprob_chunk = 256  # positions per vocab-projection chunk

    c.data = ml_collections.ConfigDict()
    c.data.train_files = ""  # comma-separated files or folders (parquet / jsonl)
    c.data.test_files = ""
    c.data.prompt_style = "auto"  # template (prompt text embeds the chat template) | messages | auto
    c.data.max_prompt_length = 400
    c.data.shuffle_seed = 42

    c.rollout = ml_collections.ConfigDict()
    c.rollout.n = 8  # responses per prompt (G)
    c.rollout.temperature = 0.7
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0
    c.rollout.max_response_length = 4096
    c.rollout.prompt_bucket = 64  # prompts are padded to a multiple of this (compile once per bucket)
    c.rollout.recompute_old_logprobs = False  # pi_old from a teacher-forced pass instead of the sampler's

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

    c.loss = ml_collections.ConfigDict()
    c.loss.clip_low = 0.2
    c.loss.clip_high = 0.24
    c.loss.dual_clip = 10.0
    c.loss.kl_coef = 0.001
    c.loss.kl_type = "low_var_kl"
    c.loss.entropy_coef = 0.0
    c.loss.agg = "token-mean"

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
    c.train.micro_batch = 8  # responses per forward/backward (gradient accumulation)
    # tokens per data x fsdp device of a packed micro-batch (sequences packed without padding);
    # 0 = the dense micro-batch's share: micro_batch / (data x fsdp) x (max_prompt_length + max_response_length)
    c.train.max_tokens_per_micro_batch = 0
    c.train.epochs = 5
    c.train.max_steps = -1  # -1 = epochs x batches per epoch
    c.train.eval_every = 20
    c.train.eval_before = True
    c.train.eval_n = 1  # sampled responses per test prompt (besides greedy)
    c.train.eval_max_prompts = -1  # cap per data_source for quick evaluation; -1 = all
    c.train.save_every = 20
    c.train.keep_checkpoints = 3
    c.train.samples_every = 10  # sample completions to TensorBoard
    c.train.export_at_end = True

    c.reward = ml_collections.ConfigDict()
    c.reward.fn = ""  # "" = built-in router by data_source; or "module:function"
    c.reward.workers = 4
    c.reward.timeout_s = 10.0

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1

    c.distributed = ml_collections.ConfigDict()
    c.distributed.coordinator = ""  # host:port; "" = auto-detect (TPU pods, SLURM) or single process
    c.distributed.num_processes = 0
    c.distributed.process_id = -1
    return c


def _check(cond: bool, field: str, value, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"config.{field}={value!r} is invalid: {allowed}")


def _choice(c, field: str, allowed) -> None:
    value = c
    for part in field.split("."):
        value = value[part]
    _check(value in allowed, field, value, f"allowed values are {list(allowed)}")


def validate(c: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
    """Raise ConfigError (one line, naming the field) for any invalid value."""
    for field, allowed in [("algo.adv_estimator", ADV_ESTIMATORS), ("algo.weighting", WEIGHTINGS),
                           ("algo.lopti_split", LOPTI_SPLITS), ("loss.kl_type", KL_TYPES),
                           ("loss.agg", AGGREGATIONS), ("optim.schedule", SCHEDULES),
                           ("model.dtype", DTYPES), ("model.param_dtype", DTYPES),
                           ("data.prompt_style", PROMPT_STYLES)]:
        _choice(c, field, allowed)
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
    _check(c.rollout.prompt_bucket >= 1, "rollout.prompt_bucket", c.rollout.prompt_bucket, "must be >= 1")
    _check(c.data.max_prompt_length >= 1, "data.max_prompt_length", c.data.max_prompt_length, "must be >= 1")
    for field in ("loss.clip_low", "loss.clip_high"):
        v = c.loss[field.split(".")[1]]
        _check(0.0 < v < 1.0, field, v, "must be in (0, 1)")
    _check(c.loss.dual_clip > 1.0, "loss.dual_clip", c.loss.dual_clip, "must be > 1")
    _check(c.loss.kl_coef >= 0, "loss.kl_coef", c.loss.kl_coef, "must be >= 0")
    _check(c.optim.lr > 0, "optim.lr", c.optim.lr, "must be > 0")
    _check(c.optim.grad_clip > 0, "optim.grad_clip", c.optim.grad_clip, "must be > 0")
    _check(c.optim.warmup_steps >= 0, "optim.warmup_steps", c.optim.warmup_steps, "must be >= 0")
    _check(c.resume in ("auto", "none") or bool(c.resume), "resume", c.resume, "auto | none | a checkpoint folder")

    t = c.train
    responses = t.batch_prompts * c.rollout.n
    _check(t.batch_prompts >= 1, "train.batch_prompts", t.batch_prompts, "must be >= 1")
    _check(t.mini_batch >= 1 and responses % t.mini_batch == 0, "train.mini_batch", t.mini_batch,
           f"must divide train.batch_prompts x rollout.n = {responses}")
    _check(t.micro_batch >= 1 and t.mini_batch % t.micro_batch == 0, "train.micro_batch", t.micro_batch,
           f"must divide train.mini_batch = {t.mini_batch}")
    for field in ("epochs", "eval_every", "save_every", "keep_checkpoints", "samples_every", "eval_n"):
        _check(t[field] >= 1, f"train.{field}", t[field], "must be >= 1")
    _check(t.max_steps == -1 or t.max_steps >= 1, "train.max_steps", t.max_steps, "must be -1 or >= 1")
    longest = c.data.max_prompt_length + c.rollout.max_response_length
    _check(t.max_tokens_per_micro_batch == 0 or t.max_tokens_per_micro_batch >= longest,
           "train.max_tokens_per_micro_batch", t.max_tokens_per_micro_batch,
           f"must be 0 (auto) or hold the longest sequence, data.max_prompt_length + "
           f"rollout.max_response_length = {longest}")
    _check(c.reward.workers >= 0, "reward.workers", c.reward.workers, "must be >= 0")
    _check(c.reward.timeout_s > 0, "reward.timeout_s", c.reward.timeout_s, "must be > 0")
    _check(not c.reward.fn or ":" in c.reward.fn, "reward.fn", c.reward.fn, "must be 'module:function' or ''")

    if num_devices is not None:
        from arlopti_jax.sharding import resolve_mesh_shape
        try:
            sizes = resolve_mesh_shape(dict(c.mesh), num_devices)
        except ValueError as err:
            raise ConfigError(f"config.mesh={dict(c.mesh)} is invalid: {err}") from None
        per = sizes["data"] * sizes["fsdp"]
        _check(t.micro_batch % per == 0, "train.micro_batch", t.micro_batch,
               f"must be divisible by the mesh's data x fsdp = {per} (batch is split over those axes)")


def _field_paths(c: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    out = []
    for key, value in c.items():
        path = f"{prefix}{key}"
        out += _field_paths(value, path + ".") if isinstance(value, ml_collections.ConfigDict) else [path]
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


def _config_from_file(argv: list[str], default_file: str) -> ml_collections.ConfigDict | None:
    """The config that ``--config=FILE[:ARG]`` names (without overrides), or None if it fails."""
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), default_file)
    path, _, arg = spec.partition(":")
    try:
        return load_config_file(path, arg)
    except Exception:
        return None


def parse_command_line(argv: list[str], default_file: str, define_flags) -> list[str]:
    """Define (``define_flags()``) and parse absl flags (``--config=FILE --config.a.b=v``); on a
    bad flag print one line naming it and exit with status 2. Returns the remaining argv."""
    import difflib
    import sys

    from absl import flags

    try:
        define_flags()  # ml_collections' config flags already read sys.argv here
        rest = flags.FLAGS(argv)
        flags.FLAGS.config.keys()  # the config file loads lazily: fail here, not mid-run
        return rest
    except Exception as err:  # absl/ml_collections raise several types for bad overrides
        root = err
        while root.__cause__ is not None or root.__context__ is not None:
            root = root.__cause__ or root.__context__
        last_line = lambda e: str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__
        message = last_line(err)
        if isinstance(root, OSError):
            message = f"cannot load the config file: {last_line(root)}"
        base = _config_from_file(argv[1:], default_file)
        if base is not None:
            known = _field_paths(base)
            for arg in argv[1:]:
                if not arg.startswith("--config."):
                    continue
                field = arg[len("--config."):].split("=", 1)[0]
                if field not in known:
                    close = difflib.get_close_matches(field, known, n=1)
                    hint = f"; did you mean config.{close[0]}?" if close else ""
                    message = f"config.{field} is not a config field{hint}"
                    break
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
