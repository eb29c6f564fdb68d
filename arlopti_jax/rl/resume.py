"""A run's checkpoints: where it resumes from, and whether a LoRA checkpoint fits its base model.

``check_resume`` and ``check_base`` run at every command's start-up (``run_setup.prepare_inputs``),
so a bad ``config.resume`` or a checkpoint whose adapters were trained on another base stops the
command with one line before anything is loaded. ``saved_state`` is what a checkpoint holds of
the train state; ``restore_from`` reads it back as ``config.resume`` says.
"""

from __future__ import annotations

import json
from pathlib import Path

from arlopti_jax.models import ModelConfig, lora
from arlopti_jax.store.checkpoint import Checkpointer


def checkpointer(config) -> Checkpointer:
    return Checkpointer(Path(config.run_dir) / "checkpoints", max_to_keep=config.train.keep_checkpoints)


def check_resume(config, ckpt: Checkpointer | None = None) -> None:
    """ValueError (one line, naming config.resume) where ``config.resume`` cannot be followed:
    ``none`` over a run folder that holds checkpoints (``ckpt``'s, or ``run_dir/checkpoints``,
    read without creating it), or a path that is not a checkpoint step folder."""
    if config.resume == "none":
        if ckpt is None:
            if not (Path(config.run_dir) / "checkpoints").is_dir():
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
        folder = Path(config.resume)
        if not folder.is_dir() or not folder.name.isdigit():
            raise ValueError(f"config.resume={config.resume!r}: not a checkpoint step folder (…/checkpoints/<step>)")


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
    path = Path(folder) / "meta" / "metadata"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def check_base(config, model_path: Path) -> str:
    """``base_digest(model_path)`` for a LoRA run, after checking the checkpoint it would resume
    from (``config.resume``), if any, against it (``check_checkpoint_base``)."""
    digest = base_digest(model_path)
    if config.resume == "auto":
        folder = Path(config.run_dir) / "checkpoints"
        steps = sorted((p for p in folder.iterdir() if p.name.isdigit() and checkpoint_meta(p) is not None),
                       key=lambda p: int(p.name)) if folder.is_dir() else []
        if steps:
            check_checkpoint_base(steps[-1], model_path, config.model.lora_rank, digest)
    elif config.resume != "none":
        check_checkpoint_base(Path(config.resume), model_path, config.model.lora_rank, digest)
    return digest


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
    folder = Path(config.resume)
    other = Checkpointer(folder.parent, max_to_keep=10**6)
    state, meta = other.restore(int(folder.name), target)
    other.close()
    return int(folder.name), state, meta
