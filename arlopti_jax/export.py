"""Export a training checkpoint's policy as a Hugging Face folder, or a LoRA run's adapters as
a PEFT adapter folder.

    python -m arlopti_jax.export --checkpoint runs/kk3b/checkpoints/120 --out exports/kk3b_step120
    python -m arlopti_jax.export --checkpoint runs/lora/checkpoints/16 --out exports/lora16 --adapter

The checkpoint's metadata names the run's config and model folder, so nothing else is
needed: the folder gets config.json, safetensors and the model's tokenizer files, and
loads in transformers (and back into arlopti_jax). A LoRA run's folder holds the merged weights
(W + (alpha / r) B A); with ``--adapter`` the adapters alone are written in PEFT's layout
(``adapter_config.json``, ``adapter_model.safetensors``), for PEFT's ``PeftModel.from_pretrained``
or vLLM's ``LoRARequest`` on the run's base model.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a command: its own process's settings before JAX loads (runtime/process.py)
    from arlopti_jax.runtime import process

    process.prepare()

import argparse
import json
import sys
from pathlib import Path

import jax
import ml_collections

from arlopti_jax.rl import resume, run_setup
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.store.checkpoint import restore_subtree
from arlopti_jax.config.cli import startup_done
from arlopti_jax.models import abstract_params, load_params, lora, param_shardings, save_pretrained
from arlopti_jax.models.hf import save_adapter


EPILOG = """\
It takes no config file and no --config flags: the run's config (model dtype, LoRA settings) is the
one stored in the checkpoint. It reads the parameters alone (not the optimizer state), on the
devices at hand: a checkpoint saved on 8 devices exports on one.

examples:
  python -m arlopti_jax.export --checkpoint runs/default/checkpoints/30 --out exports/default
  python -m arlopti_jax.export --checkpoint runs/kk3b/checkpoints/120 --out exports/kk3b_step120
  python -m arlopti_jax.export --checkpoint runs/lora/checkpoints/16 --out exports/lora16 --adapter
"""


def read_checkpoint(checkpoint: str | Path) -> tuple[Path, ml_collections.ConfigDict, Path]:
    """(step folder, the run's config, its model folder) of a checkpoint step folder; ValueError
    or FileNotFoundError naming what is missing."""
    folder = Path(checkpoint).absolute()
    if not folder.is_dir() or not folder.name.isdigit():
        raise ValueError(f"--checkpoint {checkpoint}: not a checkpoint step folder (…/checkpoints/<step>)")
    meta_file = folder / "meta" / "metadata"
    if not meta_file.is_file():
        raise ValueError(f"{folder}: no meta/metadata: not a complete arlopti_jax checkpoint")
    meta = json.loads(meta_file.read_text())
    model_path = Path(meta["model_path"])
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"{model_path}, the model folder {meta_file} names (architecture and tokenizer), "
                                "has no config.json")
    config = ml_collections.ConfigDict(json.loads(meta["config"]))
    resume.check_checkpoint_base(folder, model_path, int(config.model.get("lora_rank", 0)))
    # its arrays against the model folder's shapes (a folder changed since the run), from metadata alone
    resume.check_checkpoint(config, run_setup.model_config(config, model_path), folder=folder, resuming=False)
    return folder, config, model_path


def export(checkpoint: str | Path, out: str | Path, adapter: bool = False) -> Path:
    return _write(*read_checkpoint(checkpoint), out, adapter)


def _write(folder: Path, config: ml_collections.ConfigDict, model_path: Path, out: str | Path,
           adapter: bool = False) -> Path:
    model_cfg = run_setup.model_config(config, model_path)
    if adapter and not model_cfg.lora_rank:
        raise ValueError(f"--adapter: {folder} is not a LoRA run's checkpoint (its model.lora_rank is 0)")
    # the devices at hand, whatever mesh the run trained on (orbax reshards as it reads)
    mesh = shd.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    params = lora.trainable(model_cfg, abstract_params(model_cfg))[0]  # what the checkpoint holds of them
    shardings = lora.trainable(model_cfg, param_shardings(model_cfg, mesh))[0]
    target = {"params": jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                     params, shardings)}
    params = restore_subtree(folder, target)["params"]  # the parameters alone, not the AdamW moments
    if adapter:
        return save_adapter(model_cfg, params, out, base_model=config.model.path or str(model_path))
    if model_cfg.lora_rank:  # adapter-only: on the base model folder (its hash checked by read_checkpoint)
        params = lora.combine(load_params(model_path, model_cfg.replace(lora_rank=0), mesh), params)
    return save_pretrained(*lora.plain(model_cfg, params), out, tokenizer_dir=model_path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m arlopti_jax.export", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a checkpoint step folder: RUN/checkpoints/STEP")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA run: write its adapters as a PEFT adapter folder instead of the merged model")
    args = parser.parse_args(argv)
    from arlopti_jax.runtime.chips import start_backend

    start_backend()
    try:
        source = read_checkpoint(args.checkpoint)
        if args.adapter and not int(source[1].model.get("lora_rank", 0)):
            raise ValueError(f"--adapter: {args.checkpoint} is not a LoRA run's checkpoint (model.lora_rank is 0)")
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    startup_done("arlopti_jax.export")
    out = _write(*source, args.out, args.adapter)
    print(f"exported {args.checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
