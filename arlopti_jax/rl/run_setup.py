"""From a validated config to everything a run is: ``assemble(config, mesh, model_cfg, ...)``.

One assembly (docs/design.md, "Principles"): ``assemble`` turns a config, a mesh and the model's shape into the
run's optimizer, sampler, sampling settings, packed log-prob passes, train step and the
abstract checkpointed state (shapes, dtypes and shardings; nothing allocated). ``train``,
``eval``, ``export`` and the compile-only check ``aot`` all build from it, so the programs
compiled for a TPU pod or an H100 by ``python -m arlopti_jax.aot`` are the ones ``train`` runs.
Weights and data are loaded beside it (``load_policy``, ``prompt_dataset``): ``aot`` needs
neither.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Callable

import jax
import ml_collections
import optax

from arlopti_jax import algos
from arlopti_jax.runtime import distributed as dist
from arlopti_jax.runtime import paths
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.runtime.startup import ConfigError
from arlopti_jax.models import ModelConfig, abstract_params, hub, load_params, lora, param_shardings
from arlopti_jax.models.hf import check_weights
from arlopti_jax.models.tokenizer import load_tokenizer  # TokenizerError: none there, unreadable, or too large
from arlopti_jax.rl import episode_host, hosts
from arlopti_jax.rl.resume import check_base, check_checkpoint, check_resume, model_settings, saved_state
from arlopti_jax.store import trackers
from arlopti_jax.rollout import Sampler, SamplingConfig
from arlopti_jax.tasks import load_reward_fn
from arlopti_jax.tasks.registry import reward_for
from arlopti_jax.tasks.data import BatchIterator, DataFile, HubSplit, PromptDataset, resolve_data_files

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Policy:
    model_cfg: ModelConfig
    params: dict
    tokenizer: object
    model_path: Path


def resolve_paths(config: ml_collections.ConfigDict, need_train: bool = True,
                  build: bool = True) -> tuple[Path, list[Path], list[Path]]:
    """(model folder, train files, test files). With no model path, the embedded default's
    start point (built once, in the run folder's parent) supplies all three. With several
    processes, process 0 builds it on its own devices while the others wait (the folder must be
    shared, or built beforehand on every host). Evaluation passes ``need_train=False`` (no
    training files are read). ``model.path`` may be a Hugging Face Hub id (``models.hub``). A
    missing path raises FileNotFoundError naming it. ``build=False`` (``aot``): neither build the
    start point nor fetch a Hub model's weights; a start point not built yet is a missing path."""
    model = config.model.path
    train, test = config.data.train_files, config.data.test_files
    for field, value in (("run_dir", config.run_dir), ("model.path", model), ("resume", config.resume),
                         *((f"data.{f}", v) for f, vs in (("train_files", train), ("test_files", test))
                           for v in vs.split(",") if v)):
        paths.check(value, f"config.{field}")  # a scheme nothing here reads stops in one line
    if not model:
        from arlopti_jax.embedded.start_point import ensure_start_point

        run_dir = paths.path(config.run_dir, "config.run_dir")  # beside the run folder; a bucket's on this host
        sp = (run_dir.parent if not paths.is_remote(config.run_dir) else paths.staging_root()) / "start_point"
        if not build and not (sp / "model").is_dir():
            raise FileNotFoundError(f"the embedded start point is not built yet ({sp})")
        if build and jax.process_index() == 0:
            try:
                ensure_start_point(sp, seed=0)
            except (ValueError, OSError) as err:  # a fault of the build, not a bad path: keep its traceback
                raise RuntimeError(f"building the embedded start point in {sp} failed") from err
        if build:
            dist.barrier("arlopti_start_point")
        model = str(sp / "model")
        train = train or str(sp / "data" / "train.parquet")
        test = test or ",".join(str(sp / "data" / f"test_{n}ppl.parquet") for n in (2, 3))
    elif paths.is_remote(model):  # a bucket's model folder: read from this host's copy
        model = str(paths.local_copy(model, "config.model.path"))
    else:
        model = str(hub.resolve(model, weights=build))  # a folder, or a Hub id's snapshot
    if not train and need_train:
        raise ValueError("config.data.train_files is empty: name the training files or folders")
    if not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(f"config.model.path={model}: not a Hugging Face model folder (no config.json)")
    try:  # an architecture this project does not implement, or a setting that cannot serve it, stops here
        model_cfg = model_config(config, Path(model))
    except ValueError as err:
        raise type(err)(f"config.model.path={config.model.path or model}: {err}") from None
    if build and not any(Path(model).glob("*.safetensors")):  # pickled weights are never read
        found = sorted(p.name for p in Path(model).glob("*.bin"))
        raise FileNotFoundError(f"config.model.path={config.model.path or model}: no *.safetensors weights in "
                                f"{model}" + (f" (only {', '.join(found[:3])}: pickled weights are not read; "
                                              "convert them to safetensors)" if found else ""))
    if build:  # every tensor there, whole, in the shapes config.json gives: from the files' headers
        check_weights(Path(model), model_cfg.replace(lora_rank=0))
    for line in model_cfg.fallbacks(jax.default_backend()):  # an 'auto' setting that runs another kernel
        log.warning("%s", line)

    def files(field, value):
        split = "train" if field == "train_files" else "test"  # a Hub dataset's split, when none is named
        try:  # a bucket's file or folder: read from this host's copy
            named = [str(paths.local_copy(p, f"config.data.{field}")) if paths.is_remote(p) else p
                     for p in value.split(",") if p]
            return resolve_data_files(named, split) if value else []
        except (FileNotFoundError, ValueError) as err:
            raise type(err)(f"config.data.{field}: {err}") from None

    return Path(model), files("train_files", train) if need_train else [], files("test_files", test)


def model_config(config, model_path: Path) -> ModelConfig:
    """The model's shape from its folder's config.json, with the config's settings (``model_settings``)."""
    return ModelConfig.from_pretrained(model_path, **model_settings(config))


def load_policy(config, mesh, model_path: Path, tokenizer=None) -> Policy:
    """The model's weights on ``mesh`` with its tokenizer (``tokenizer``, when already loaded)."""
    tokenizer = load_tokenizer(model_path) if tokenizer is None else tokenizer
    model_cfg = model_config(config, model_path)
    params = load_params(model_path, model_cfg.replace(lora_rank=0), mesh)
    if model_cfg.lora_rank:  # fresh adapters beside the folder's weights (a checkpoint replaces them on resume)
        params = lora.combine(params, lora.init_adapters(model_cfg, jax.random.key(config.seed), mesh))
    return Policy(model_cfg, params, tokenizer, model_path)


def _as_ids(value) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def eos_ids(policy: Policy) -> tuple[int, ...]:
    """Every id that ends a response: the tokenizer's EOS, config.json's ``eos_token_id`` and
    generation_config.json's (Qwen2.5-Instruct lists both <|im_end|> and <|endoftext|> there)."""
    ids = {policy.tokenizer.eos_token_id, *_as_ids(policy.model_cfg.eos_token_id)}
    generation = Path(policy.model_path) / "generation_config.json"
    if generation.is_file():
        try:
            ids.update(_as_ids(json.loads(generation.read_text()).get("eos_token_id")))
        except (json.JSONDecodeError, AttributeError) as err:
            raise ValueError(f"{generation}: not a JSON object ({err})") from None
    bad = [i for i in ids if i is not None and (type(i) is not int or i < 0)]
    if bad:
        raise ValueError(f"EOS token ids {bad} (tokenizer, config.json or generation_config.json of "
                         f"{policy.model_path}) are not token ids")
    return tuple(sorted(i for i in ids if i is not None))


def pad_id(policy: Policy) -> int:
    """The id that pads prompts and follows a finished response: the tokenizer's pad token, else
    the first EOS id."""
    pad = policy.tokenizer.pad_token_id
    return pad if pad is not None else eos_ids(policy)[0]


def sampling_config(config, eos: tuple[int, ...], pad: int, *, greedy: bool = False,
                    temperature: float | None = None, prompt_width: int = 0) -> SamplingConfig:
    """The rollout's sampling settings (``temperature`` replaces rollout.temperature, for evaluation;
    ``prompt_width``: the run's longest prompt, ``Inputs.longest_prompt``)."""
    r = config.rollout
    return SamplingConfig(max_response_len=r.max_response_length,
                          temperature=r.temperature if temperature is None else temperature, top_p=r.top_p,
                          top_k=r.top_k, greedy=greedy, eos_ids=eos, pad_id=pad, prompt_bucket=r.prompt_bucket,
                          prompt_width=prompt_width, length_aware=r.length_aware, phase_tokens=r.phase_tokens,
                          min_rows=r.min_rows)


def split_devices(config, devices=None) -> tuple[list, list]:
    """(the trainer's devices, the sampler's) of ``devices`` (default: every device of the job; ``aot``
    passes a compile-only topology's). With ``rollout.devices`` = N > 0 each process gives its last
    N / processes devices (by id) to the sampler and keeps the rest, so that every process holds
    devices of both meshes and the weight sync stays inside each process (``shd.transfer``);
    otherwise the sampler's list is empty (it shares the trainer's mesh). ConfigError for a split
    the processes cannot share."""
    devices = list(jax.devices() if devices is None else devices)
    n = config.rollout.devices
    if not n:
        return devices, []
    by_process: dict[int, list] = {}
    for d in sorted(devices, key=lambda d: d.id):
        by_process.setdefault(d.process_index, []).append(d)
    local = {len(ds) for ds in by_process.values()}
    procs = len(by_process)
    if n % procs or len(local) > 1 or n // procs >= min(local):
        raise ConfigError(f"config.rollout.devices={n} is invalid: each of the {procs} processes gives the sampler "
                          f"rollout.devices / {procs} of its {sorted(local)} devices and keeps at least one for the "
                          f"trainer, so rollout.devices must be a multiple of {procs} below {procs * min(local)}"
                          + (" (with one process per device, e.g. SLURM's one task per GPU, nothing can split: run "
                             "one process per host)" if min(local) == 1 else ""))
    per = n // procs
    trainer = [d for ds in by_process.values() for d in ds[:-per]]
    sampler = [d for ds in by_process.values() for d in ds[-per:]]
    return trainer, sampler


@dataclasses.dataclass(frozen=True)
class Layout:
    """The run's meshes, made once per command (``make_layout``) and handed down: the trainer's, and
    the sampler's own (None: it shares the trainer's); ``roles``: with sampler hosts of their own
    (``rollout.hosts``), which processes train and which sample (``rl/hosts.py``)."""

    mesh: jax.sharding.Mesh
    sampler_mesh: jax.sharding.Mesh | None
    roles: hosts.Roles | None = None


def make_layout(config, devices=None) -> Layout:
    """``make_mesh`` and ``make_sampler_mesh`` of ``devices`` (default: every device of the job); with
    ``rollout.hosts``, the trainer's mesh over the trainer hosts' devices and the sampler's its mirror
    over the sampler hosts' (``hosts.mirror_mesh``). ConfigError for a split the job cannot hold."""
    devices = list(jax.devices() if devices is None else devices)
    roles = hosts.roles(config, len({d.process_index for d in devices}))
    if roles is None:
        return Layout(make_mesh(config, devices), make_sampler_mesh(config, devices))
    mesh = dist.process_contiguous(shd.make_mesh(dict(config.mesh), devices=hosts.trainer_devices(roles, devices)))
    return Layout(mesh, hosts.mirror_mesh(mesh, roles, devices), roles)


def make_mesh(config, devices=None):
    """The trainer's mesh (``config.mesh``) over its devices of ``devices`` (``split_devices``); with
    several processes, each holds a contiguous block of batch rows."""
    return dist.process_contiguous(shd.make_mesh(dict(config.mesh), devices=split_devices(config, devices)[0]))


def make_sampler_mesh(config, devices=None):
    """The sampler's own mesh (``config.rollout.mesh`` over its devices), or None when it shares the
    trainer's (``rollout.devices=0``)."""
    sampler = split_devices(config, devices)[1]
    return dist.process_contiguous(shd.make_mesh(dict(config.rollout.mesh), devices=sampler)) if sampler else None


def eval_set_name(path: DataFile) -> str:
    """A test file's name in metrics: its stem, prefixed by its folder when generic
    (kk/3ppl/test.parquet -> 3ppl_test; test_2ppl.parquet -> test_2ppl); a Hub dataset's
    NAME[_CONFIG]_SPLIT (openai/gsm8k:main:test -> gsm8k_main_test)."""
    if isinstance(path, HubSplit):
        return path.set_name
    return f"{path.parent.name}_{path.stem}" if path.stem in ("test", "train", "eval", "validation") else path.stem


def prompt_dataset(config, files, tokenizer) -> PromptDataset:
    """The prompts of ``files``; a tool episode's with the chat template's tools section where it has one
    (``episode_host.prompt_tools``)."""
    d = config.data
    return PromptDataset(files, tokenizer, max_prompt_length=d.max_prompt_length, prompt_style=d.prompt_style,
                         prompt_key=d.prompt_key, answer_key=d.answer_key, data_source=d.data_source,
                         tools=episode_host.prompt_tools(config, tokenizer))


def train_iterator(config, dataset) -> BatchIterator:
    return BatchIterator(dataset, config.train.batch_prompts, seed=config.data.shuffle_seed, drop_last=True)


@dataclasses.dataclass
class Inputs:
    """What a run reads besides the weights (``prepare_inputs``), checked before any work."""

    model_path: Path
    tokenizer: object
    iterator: BatchIterator
    test_sets: dict[str, PromptDataset]
    base_sha256: str = ""  # a LoRA run's: ``base_digest(model_path)``, which its checkpoints record
    layout: Layout | None = None  # the meshes (``make_layout``)

    @property
    def longest_prompt(self) -> int:
        """The run's prompt width (``longest_prompt``) over its training and test prompts."""
        return longest_prompt([self.iterator.dataset, *self.test_sets.values()])


def longest_prompt(datasets) -> int:
    """Tokens of the longest prompt of ``datasets``: a run passes it to ``assemble`` and its sampler
    pads every batch to that prompt's bucket, so its rollouts and evaluations share one prompt width
    and a later batch of longer prompts compiles no new program."""
    return max(len(row["prompt_ids"]) for data in datasets for row in data.rows)


def prepare_inputs(config, layout: Layout | None = None) -> Inputs:
    """The run's paths, tokenizer and prompt datasets, with ``config.resume`` checked against
    ``run_dir`` (``check_resume``): a command's start-up calls this, so a ``run_dir`` it cannot write
    or without room for one checkpoint, a model folder that cannot serve (``check_weights``,
    ``load_tokenizer``), a missing path, a bad resume setting, a data file that cannot be read, a
    training set that cannot fill one batch of ``train.batch_prompts`` prompts, a data source the
    built-in reward does not know, a tracker of ``train.loggers`` that cannot start (process 0's,
    which alone logs), tool episodes the chat template cannot serve (``episode_host.check_episodes``:
    an empty ``env.observation_format`` with a template without tools) or a checkpoint to resume from
    that this config cannot continue (``check_checkpoint``) stops it in one line (FileNotFoundError or
    ValueError naming the field), before the weights are loaded. ``layout``: the run's meshes, when the
    command has made them."""
    layout = make_layout(config) if layout is None else layout
    paths.check_writable(config.run_dir, "config.run_dir")  # before any process writes there
    dist.check_shared_folder(paths.path(config.run_dir, "config.run_dir"), "config.run_dir")  # one for all hosts
    model_path, train_files, test_files = resolve_paths(config)
    check_resume(config)
    if jax.process_index() == 0:
        trackers.check(config.train.loggers)
    digest = check_base(config, model_path) if config.model.lora_rank else ""
    tokenizer = load_tokenizer(model_path)
    if config.env.name:  # an observation format or a tools section the chat template cannot give stops here
        episode_host.check_episodes(config, tokenizer)

    def dataset(field, files):
        try:
            return prompt_dataset(config, files, tokenizer)
        except ValueError as err:
            raise ValueError(f"config.data.{field}: {err}") from None

    train_data = dataset("train_files", train_files)
    try:
        iterator = train_iterator(config, train_data)
    except ValueError as err:
        raise ValueError(f"config.train.batch_prompts={config.train.batch_prompts}: the training prompts of "
                         f"config.data.train_files ({', '.join(map(str, train_files))}, after "
                         f"data.max_prompt_length={config.data.max_prompt_length}): {err}") from None
    test_sets = {eval_set_name(f): dataset("test_files", [f]) for f in test_files}
    if not config.reward.fn:  # the built-in reward: a source it does not know stops here, not at step 1
        for field, data in (("train_files", train_data), *(("test_files", d) for d in test_sets.values())):
            for source in sorted({row["data_source"] for row in data.rows}):
                try:
                    reward_for(source)
                except ValueError as err:
                    raise ValueError(f"config.data.{field}: {err}") from None
    model_cfg = model_config(config, model_path)
    if config.rollout.top_k > model_cfg.vocab_size:
        raise ValueError(f"config.rollout.top_k={config.rollout.top_k} exceeds the model's vocabulary "
                         f"({model_cfg.vocab_size} tokens, {model_path})")
    check_checkpoint(config, model_cfg, iterator)  # the one it resumes from, if any
    load_reward_fn(config.reward.fn or None)  # a reward module that does not import stops here
    inputs = Inputs(model_path, tokenizer, iterator, test_sets, digest, layout)
    # everything the run computes from its config, built once here without weights (nothing compiles
    # or allocates): a schedule the steps cannot span, a packing the budget cannot hold... stop here
    policy = Policy(model_cfg, None, tokenizer, model_path)
    run = assemble(config, layout.mesh, model_cfg, eos_ids=eos_ids(policy), pad_id=pad_id(policy),
                   total_steps=total_steps(config, iterator), prompt_width=inputs.longest_prompt,
                   sampler_mesh=layout.sampler_mesh)
    saved = jax.tree.leaves(saved_state(model_cfg, run.state))  # room for one checkpoint
    paths.check_writable(config.run_dir, "config.run_dir", sum(x.size * x.dtype.itemsize for x in saved))
    return inputs


def total_steps(config, iterator: BatchIterator) -> int:
    return config.train.max_steps if config.train.max_steps > 0 else config.train.epochs * iterator.steps_per_epoch


def tokens_per_micro_batch(config, mesh) -> int:
    """Tokens per data x fsdp device of one packed micro-batch: ``train.max_tokens_per_micro_batch``,
    or with 0 the dense micro-batch's per-device share, micro_batch / (data x fsdp) x (max prompt +
    max response), rounded up to a multiple of 64."""
    if config.train.max_tokens_per_micro_batch > 0:
        return config.train.max_tokens_per_micro_batch
    rows = max(1, config.train.micro_batch // shd.batch_divisor(mesh))
    longest = config.data.max_prompt_length + config.rollout.max_response_length
    return -(-rows * longest // 64) * 64


def pack_shapes(config, mesh) -> algos.packing.Shapes:
    """The packed micro-batch shapes of the run's update and log-prob passes (``packing.Shapes``):
    fixed by the config, so every program of those passes is known before the first step."""
    tokens = tokens_per_micro_batch(config, mesh)
    longest = config.data.max_prompt_length + config.rollout.max_response_length
    cpu = mesh.devices.flat[0].platform == "cpu"  # no tiles to fill there: rows as short as the sequences allow
    quantum = algos.packing.CPU_ROW_QUANTUM if cpu else algos.packing.ROW_QUANTUM
    try:
        return algos.packing.shapes_for(tokens, longest, config.train.pack_row_lengths, config.train.pack_fills,
                                        quantum)
    except ValueError as err:
        raise ValueError(f"config.train.max_tokens_per_micro_batch={config.train.max_tokens_per_micro_batch} (a "
                         f"packed micro-batch of {tokens} tokens per device; train.pack_row_lengths="
                         f"{config.train.pack_row_lengths}, train.pack_fills={config.train.pack_fills}) cannot hold "
                         f"a sequence of data.max_prompt_length + rollout.max_response_length = {longest}: {err}") \
            from None


def optimizer_steps_per_rl_step(config) -> int:
    """Mini-batches per rollout batch x passes (2 with Lopti) x ``train.ppo_epochs``: what the
    schedule counts, and what ``reproduce --matched`` matches."""
    passes = 2 if config.algo.lopti_eta else 1
    return (passes * config.train.ppo_epochs * config.train.batch_prompts * config.rollout.n
            // config.train.mini_batch)


def algo_configs(config):
    a, l = config.algo, config.loss
    adv = algos.AdvantageConfig(estimator=a.adv_estimator)
    weights = algos.TokenWeightConfig(weighting=a.weighting, alpha=a.ar_alpha, tr_scale=a.tr_scale, tr_tau=a.tr_tau,
                                      tr_mu=a.tr_mu, tr_min=a.tr_min, tr_max=a.tr_max,
                                      entropy_top_fraction=a.get("entropy_top_fraction", 0.0))
    lopti = algos.LoptiConfig(enabled=a.lopti_eta != 0, eta=a.lopti_eta or 0.5, quantile=a.lopti_split == "quantile")
    loss = algos.LossConfig(clip_low=l.clip_low, clip_high=l.clip_high, dual_clip=l.dual_clip, kl_coef=l.kl_coef,
                            kl_type=l.kl_type, entropy_coef=l.entropy_coef, agg=l.agg,
                            temperature=config.rollout.temperature, mode=l.get("mode", "ppo"),
                            ratio_level=l.get("ratio_level", "token"),
                            cispo_max_weight=l.get("cispo_max_weight", 5.0))
    return adv, weights, lopti, loss


def correction_config(config) -> algos.CorrectionConfig:
    """The off-policy correction of ``rollout.correction`` (``algos/off_policy.py``)."""
    r = config.rollout
    return algos.CorrectionConfig(kind=r.correction, tis_cap=r.tis_cap, seq_mask_bound=r.seq_mask_bound)


def optim_config(config, total_rl_steps: int | None) -> algos.OptimConfig:
    """The config's AdamW settings, its schedule counted in optimizer steps over ``total_rl_steps``
    (None: a command that never updates, eval or export, which needs the optimizer state's shapes
    alone). ValueError, one line naming the fields, where the schedule cannot span the run."""
    o = config.optim
    per_step = optimizer_steps_per_rl_step(config)
    total = o.warmup_steps + 1 if total_rl_steps is None else total_rl_steps * per_step
    if o.schedule == "warmup_cosine" and total <= o.warmup_steps:
        raise ValueError(f"config.optim.warmup_steps={o.warmup_steps}: the warmup_cosine schedule needs more "
                         f"optimizer steps than its warm-up, and this run has {total} ({total_rl_steps} RL steps x "
                         f"{per_step}); raise train.max_steps or train.epochs, or lower optim.warmup_steps")
    return algos.OptimConfig(lr=o.lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, eps=o.eps,
                             grad_clip=o.grad_clip, schedule=o.schedule, warmup_steps=o.warmup_steps,
                             min_lr_ratio=o.min_lr_ratio, total_steps=total)


def make_optimizer(config, total_rl_steps: int | None):
    return algos.make_optimizer(optim_config(config, total_rl_steps))


def abstract_state(model_cfg: ModelConfig, optimizer, mesh):
    """Shapes, dtypes and shardings of the checkpointed state, allocating nothing."""
    p_sh = param_shardings(model_cfg, mesh)
    params = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                    abstract_params(model_cfg), p_sh)
    o_sh = algos.opt_state_shardings(optimizer, model_cfg, mesh)
    opt = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                 jax.eval_shape(optimizer.init, lora.trainable(model_cfg, params)[0]), o_sh)
    key = jax.ShapeDtypeStruct((2,), jax.numpy.uint32, sharding=shd.replicated(mesh))
    return {"params": params, "opt_state": opt, "rng": key}


@dataclasses.dataclass
class Run:
    """Everything a run is but its weights and data (``assemble``)."""

    config: ml_collections.ConfigDict
    mesh: jax.sharding.Mesh
    model_cfg: ModelConfig
    eos_ids: tuple[int, ...]
    pad_id: int
    total_steps: int  # RL steps
    optimizer: optax.GradientTransformation
    adv_cfg: algos.AdvantageConfig
    weight_cfg: algos.TokenWeightConfig
    lopti_cfg: algos.LoptiConfig
    loss_cfg: algos.LossConfig
    tokens_per_device: int  # of a packed micro-batch
    sampler: Sampler  # on the trainer's mesh: evaluations, and the rollouts when colocated
    rollout_sampler: Sampler  # the rollouts' (``sampler`` itself, or one on the sampler's own mesh)
    train_step: algos.TrainStep
    logprobs: Callable  # ``make_compute_logprobs``: reference and recomputed pi_old passes
    state: dict  # the checkpointed state's abstract arrays: params, opt_state, rng
    prompt_width: int  # every rollout's and evaluation's prompts are padded as if this long (``Inputs``)

    def sampling(self, *, greedy: bool = False, temperature: float | None = None) -> SamplingConfig:
        """The rollout's sampling settings; evaluation's with ``greedy`` or its ``temperature``."""
        return sampling_config(self.config, self.eos_ids, self.pad_id, greedy=greedy, temperature=temperature,
                               prompt_width=self.prompt_width)

    @property
    def use_reference(self) -> bool:
        """Whether the run holds the frozen initial policy (the KL term)."""
        return self.loss_cfg.use_kl


def assemble(config, mesh, model_cfg: ModelConfig, *, eos_ids: tuple[int, ...], pad_id: int,
             total_steps: int, prompt_width: int = 0, device_memory: int | None = None, sampler_mesh=None) -> Run:
    """The run's objects and programs for ``config`` on ``mesh`` (nothing is compiled or allocated
    here: the programs compile on first use, or ahead of time through ``aot``). ``prompt_width``:
    the longest prompt of the run's data (``longest_prompt``; ``aot`` without the data:
    ``data.max_prompt_length``; 0: each batch pads to its own). ``device_memory``: one device's
    bytes, for the sampler's ``whole_weights`` (``aot``: its target's; default: the device's own).
    ``sampler_mesh``: the rollouts' own mesh (``make_sampler_mesh``; None: the trainer's)."""
    adv, weights, lopti, loss = algo_configs(config)
    optimizer = make_optimizer(config, total_steps)
    shapes = pack_shapes(config, mesh)
    tokens = shapes.tokens_per_device
    chunk = config.model.logprob_chunk
    sampler = Sampler(model_cfg, mesh, whole_weights=config.rollout.get("whole_weights", "auto"),
                      device_memory=device_memory)
    rollout_sampler = sampler if sampler_mesh is None else Sampler(
        model_cfg, sampler_mesh, whole_weights=config.rollout.get("whole_weights", "auto"), device_memory=device_memory)
    return Run(config=config, mesh=mesh, model_cfg=model_cfg, eos_ids=tuple(eos_ids), pad_id=int(pad_id),
               total_steps=total_steps, optimizer=optimizer, adv_cfg=adv, weight_cfg=weights, lopti_cfg=lopti,
               loss_cfg=loss, tokens_per_device=tokens, sampler=sampler, rollout_sampler=rollout_sampler,
               train_step=algos.make_train_step(model_cfg, loss, optimizer, mesh, tokens_per_device=tokens,
                                                chunk_size=chunk, shared_prefix=config.train.shared_prefix,
                                                shapes=shapes),
               logprobs=algos.make_compute_logprobs(model_cfg, mesh, temperature=config.rollout.temperature,
                                                    tokens_per_device=tokens, chunk_size=chunk,
                                                    shared_prefix=config.train.shared_prefix, shapes=shapes),
               state=abstract_state(model_cfg, optimizer, mesh), prompt_width=prompt_width)
