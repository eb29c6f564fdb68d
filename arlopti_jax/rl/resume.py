"""A run's checkpoints: where it resumes from, and whether a checkpoint fits the run that reads it.

``check_resume``, ``check_base`` and ``check_checkpoint`` run at every command's start-up
(``run_setup.prepare_inputs``), so a bad ``config.resume``, a checkpoint whose adapters were trained
on another base, or one written with other parameter shapes, LoRA settings or data order stops the
command with one line before anything is loaded. ``saved_state`` is what a checkpoint holds of the
train state; ``restore_from`` reads it back as ``config.resume`` says.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_collections

from arlopti_jax.models import ModelConfig, abstract_params, lora
from arlopti_jax.runtime import paths
from arlopti_jax.store.checkpoint import Checkpointer, array_metadata, compare_trees, leaves

# the model fields that shape or scale the parameters a checkpoint holds: a checkpoint is read
# with its own values (eval, export) or refused under others (resume)
PARAM_FIELDS = ("lora_rank", "lora_alpha", "lora_targets", "param_dtype")
# the fields that fix the training data's order, and which policy version samples each batch
# (a checkpoint holds the versions of the batches in flight: rl/pipeline.py): a resumed run must keep them
DATA_FIELDS = ("train.batch_prompts", "data.train_files", "data.shuffle_seed", "rollout.max_staleness")


def model_settings(config) -> dict:
    """The ModelConfig fields the run's config sets beside the model's shape: numerics and LoRA
    (``config``: a run's config, or one stored in a checkpoint, which may predate some fields)."""
    m = config.model
    targets = m.get("lora_targets", "q")
    targets = tuple(t for t in (targets.split(",") if isinstance(targets, str) else targets) if t)
    return dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat, unroll_layers=m.unroll_layers,
                attention=m.get("attention", "auto"),
                decode_attention=m.get("decode_attention", "auto"),
                decode_matmul=m.get("decode_matmul", "xla"), lora_rank=int(m.get("lora_rank", 0)),
                lora_alpha=float(m.get("lora_alpha", 16.0)), lora_targets=targets)


def stored_config(meta: dict) -> ml_collections.ConfigDict:
    """The run config a checkpoint's meta records."""
    return ml_collections.ConfigDict(json.loads(meta.get("config", "{}")))


def checkpointer(config, processes: set[int] | None = None) -> Checkpointer:
    return Checkpointer(paths.path(config.run_dir, "config.run_dir") / "checkpoints",
                        max_to_keep=config.train.keep_checkpoints, processes=processes)


def check_resume(config, ckpt: Checkpointer | None = None) -> None:
    """ValueError (one line, naming config.resume) where ``config.resume`` cannot be followed:
    ``none`` over a run folder that holds checkpoints (``ckpt``'s, or ``run_dir/checkpoints``,
    read without creating it), a path that is not a checkpoint step folder, or one of this
    ``run_dir``'s own checkpoints with later ones beside it (the run would write their steps again)."""
    if config.resume == "none":
        if ckpt is None:
            if not (paths.path(config.run_dir, "config.run_dir") / "checkpoints").is_dir():
                return
            ckpt = checkpointer(config)
            steps, directory = ckpt.steps(), ckpt.directory
            ckpt.close()
        else:
            steps, directory = ckpt.steps(), ckpt.directory
        if steps:
            raise ValueError(f"config.resume='none' but {directory} already holds checkpoints "
                             f"{steps}: use resume=auto or another run_dir")
    elif config.resume != "auto":
        folder = paths.path(config.resume, "config.resume")
        if not folder.is_dir() or not folder.name.isdigit():
            raise ValueError(f"config.resume={config.resume!r}: not a checkpoint step folder (…/checkpoints/<step>)")
        own = paths.path(config.run_dir, "config.run_dir") / "checkpoints"
        later = sorted(int(p.name) for p in own.iterdir() if p.name.isdigit() and int(p.name) > int(folder.name)) \
            if str(folder.parent) == str(own) else []
        if later:  # the run would write those steps again over checkpoints that exist
            raise ValueError(f"config.resume={config.resume!r} is a checkpoint of this run_dir, which holds later "
                             f"ones {later}: resume=auto takes the newest; to go back, move the later ones away")


def base_digest(model_path: str | Path) -> str:
    """sha256 over a model folder's config.json and weight files (names and contents, in name
    order): what a LoRA checkpoint's adapters were trained on."""
    import hashlib

    folder = Path(model_path)
    files = sorted(p for p in folder.iterdir() if p.name == "config.json" or p.suffix in (".safetensors", ".bin"))
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:  # Hub snapshots link to their blobs: read through the link
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def checkpoint_meta(folder: Path) -> dict | None:
    """A checkpoint step folder's meta JSON (``Checkpointer.save``), or None where it has none."""
    path = paths.path(folder) / "meta" / "metadata"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def resume_folder(config) -> Path | None:
    """The checkpoint step folder ``config.resume`` points at: with ``auto`` the newest one of
    ``run_dir`` that has its meta (None where there is none), with ``none`` None."""
    if config.resume == "none":
        return None
    if config.resume != "auto":
        return paths.path(config.resume, "config.resume")
    folder = paths.path(config.run_dir, "config.run_dir") / "checkpoints"
    steps = sorted((p for p in folder.iterdir() if p.name.isdigit() and checkpoint_meta(p) is not None),
                   key=lambda p: int(p.name)) if folder.is_dir() else []
    return steps[-1] if steps else None


def check_base(config, model_path: Path) -> str:
    """``base_digest(model_path)`` for a LoRA run, after checking the checkpoint it would resume
    from (``config.resume``), if any, against it (``check_checkpoint_base``)."""
    digest = base_digest(model_path)
    folder = resume_folder(config)
    if folder is not None:
        check_checkpoint_base(folder, model_path, config.model.lora_rank, digest)
    return digest


def _value(value) -> str:
    """A config value as its command-line flag spells it (lists comma-joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return json.dumps(value)


def check_checkpoint(config, model_cfg: ModelConfig, iterator=None, folder: Path | None = None,
                     resuming: bool = True) -> None:
    """ValueError, one line, where the checkpoint a run resumes from (``resume_folder``, or
    ``folder``) was written by a run it cannot continue: other LoRA settings or parameter dtype
    (``PARAM_FIELDS``), another data order (``DATA_FIELDS``, and the training set's size and batch
    by ``iterator``'s state), or parameter arrays of other shapes than ``model_cfg``'s (read from
    orbax's metadata, loading nothing). Nothing is checked where the run starts fresh. ``resuming``
    False (``eval --checkpoint``, ``export``: they read the parameters alone, at the checkpoint's own
    settings): the shapes alone are checked."""
    folder = resume_folder(config) if folder is None else folder
    meta = checkpoint_meta(folder) if folder is not None else None
    if meta is None:
        return
    saved = stored_config(meta)
    ours, theirs = model_settings(config), model_settings(saved) if "model" in saved and resuming else {}
    for name in PARAM_FIELDS:
        if name in theirs and theirs[name] != ours[name]:
            raise ValueError(f"config.model.{name}={_value(ours[name])} but the checkpoint {folder} was written "
                             f"with {_value(theirs[name])}: resume with --config.model.{name}={_value(theirs[name])}, "
                             "or use another run_dir")
    for field in DATA_FIELDS if resuming else ():
        group, name = field.split(".")
        if group not in saved or name not in saved[group]:
            continue
        mine, theirs_value = (json.loads(json.dumps(v)) for v in (config[group][name], saved[group][name]))
        if _value(mine) != _value(theirs_value):
            raise ValueError(f"config.{field}={_value(mine)} but the checkpoint {folder} was written with "
                             f"{_value(theirs_value)}: a resumed run keeps its data order and sampling schedule; "
                             f"resume with --config.{field}={_value(theirs_value)}, or use another run_dir")
    if resuming and iterator is not None and "data" in meta:
        try:
            iterator.check_state(meta["data"])
        except ValueError as err:
            raise ValueError(f"the checkpoint {folder} cannot continue this run's data: {err}") from None
    try:
        stored = array_metadata(folder)
    except Exception:  # unreadable: restore_latest sets it aside and tries the one before
        return
    params = lora.trainable(model_cfg, abstract_params(model_cfg))[0]
    compare_trees({k[len("params/"):]: v for k, v in leaves(stored).items() if k.startswith("params/")},
                  leaves(params), f"the parameters of checkpoint {folder} (model {meta.get('model_path')})")


def check_checkpoint_base(folder: Path, model_path: Path, lora_rank: int, digest: str | None = None) -> None:
    """ValueError, one line, where a LoRA checkpoint and the base model at ``model_path`` do not
    go together: adapters trained on another base (by ``base_digest``), a checkpoint without
    adapters for a LoRA config, or one from before checkpoints recorded their base."""
    meta = checkpoint_meta(folder) or {}
    rank = json.loads(meta.get("config", "{}")).get("model", {}).get("lora_rank", 0)
    if bool(rank) != bool(lora_rank):
        raise ValueError(f"{folder} is a checkpoint of a run with model.lora_rank={rank}; this one has "
                         f"model.lora_rank={lora_rank}: use the checkpoint's setting, or another run_dir")
    if not rank:
        return
    saved = meta.get("base_sha256")
    if saved is None:
        raise ValueError(f"{folder} records no base model hash (a LoRA checkpoint from before 2026-11-27's "
                         "adapter-only checkpoints): use another run_dir")
    digest = digest or base_digest(model_path)
    if saved != digest:
        raise ValueError(f"{folder} holds adapters trained on the base {meta.get('model_path')} (sha256 "
                         f"{saved[:12]}...), not on {model_path} (sha256 {digest[:12]}...): use the same base model")


def checkpoint_record(config, step: int, data_state: dict, model_path, base_sha256: str = "",
                      eval_pending: bool = False) -> dict:
    """The meta JSON a run saves beside each checkpoint's arrays: its step, the data iterator's
    position, the model folder, the whole run config (which ``check_checkpoint``, ``eval`` and
    ``export`` read back), and a LoRA run's base hash. ``eval_pending``: the step's evaluation is
    left to the resumed run (saved on a stop signal)."""
    return {"step": step, "data": data_state, "model_path": str(model_path),
            "config": config.to_json_best_effort(), "eval_pending": eval_pending,
            **({"base_sha256": base_sha256} if config.model.lora_rank else {})}


def saved_state(model_cfg: ModelConfig, state: dict) -> dict:
    """What a checkpoint holds of the train state: with LoRA the adapters alone (the base is the
    model folder's, checked by its hash), else the whole parameters; then the optimizer state and
    the RNG key. Works on arrays and on ``abstract_state``'s shapes alike."""
    return {**state, "params": lora.trainable(model_cfg, state["params"])[0]}


def restore_from(config, ckpt: Checkpointer, target):
    """``(step, state, meta)`` per ``config.resume``, or None for a fresh start."""
    check_resume(config, ckpt)
    if config.resume == "none":
        return None
    if config.resume == "auto":
        return ckpt.restore_latest(target)
    folder = paths.path(config.resume, "config.resume")
    other = Checkpointer(folder.parent, max_to_keep=10**6)
    state, meta = other.restore(int(folder.name), target)
    other.close()
    return int(folder.name), state, meta
