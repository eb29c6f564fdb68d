"""How long the stop signal's checkpoint takes: the train state of a Qwen2.5 size (float32
parameters and AdamW's two moments, as the trainer saves them), saved with the trainer's
``Checkpointer`` and waited for, as ``train.grace_s`` must allow; and the checkpoint's bytes at
each size from the state's shapes (exact, nothing allocated), full weights and LoRA.

    python bench/checkpoint_save.py --size 1.5b --dir /tmp/ckpt      # allocate, save, time (CPU: ~18 GB)
    python bench/checkpoint_save.py --sizes-only                      # bytes at 0.5B-7B, no allocation
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time

import arlopti_jax  # noqa: F401  (before JAX: the compile-only plugins left out where their devices are absent)
import jax
import jax.numpy as jnp
import numpy as np


def state_for(size: str, lora_rank: int = 0):
    """(ModelConfig, abstract checkpointed state) of a Qwen2.5 size on this machine's devices."""
    from arlopti_jax.aot.shapes import qwen25
    from arlopti_jax.config import base_config
    from arlopti_jax.models import ModelConfig
    from arlopti_jax.rl import resume, run_setup

    config = base_config()
    config.model.lora_rank = lora_rank
    cfg = ModelConfig.from_hf_dict(qwen25(size), **run_setup.model_settings(config))
    mesh = run_setup.make_mesh(config)
    abstract = run_setup.abstract_state(cfg, run_setup.make_optimizer(config, None), mesh)
    return cfg, resume.saved_state(cfg, abstract)


def nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1.5b", help="a Qwen2.5 size: 0.5b, 1.5b, 3b, 7b")
    parser.add_argument("--dir", default="/tmp/arlopti_ckpt_bench", help="where to save (removed after)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sizes-only", action="store_true", help="print the checkpoint bytes per size and stop")
    args = parser.parse_args(argv)

    print(f"{'size':>5} {'full weights GiB':>17} {'of it params':>13} {'LoRA r=16 GiB':>14}")
    for size in ("0.5b", "1.5b", "3b", "7b"):
        _, full = state_for(size)
        _, adapters = state_for(size, lora_rank=16)
        print(f"{size:>5} {nbytes(full) / 2**30:17.2f} {nbytes(full['params']) / 2**30:13.2f} "
              f"{nbytes(adapters) / 2**30:14.3f}")
    if args.sizes_only:
        return 0

    from arlopti_jax.store.checkpoint import Checkpointer

    _, abstract = state_for(args.size)
    key = jax.random.key(0)
    state = jax.tree.map(lambda a: jax.device_put(jax.random.normal(key, a.shape, jnp.float32).astype(a.dtype)
                                                  if jnp.issubdtype(a.dtype, jnp.floating) else jnp.zeros(a.shape,
                                                                                                          a.dtype),
                                                  a.sharding), abstract)
    jax.block_until_ready(state)
    size = nbytes(state)
    print(f"saving {args.size}: {size / 2**30:.2f} GiB on {jax.device_count()} device(s), to {args.dir}")
    for i in range(args.repeats):
        shutil.rmtree(args.dir, ignore_errors=True)
        ckpt = Checkpointer(args.dir, max_to_keep=1)
        began = time.monotonic()
        ckpt.save(i + 1, state, {"step": i + 1})
        blocked = time.monotonic() - began  # the trainer's step waits this long (device -> host copies)
        ckpt.wait()
        total = time.monotonic() - began
        ckpt.close()
        print(f"save {i + 1}: {total:.1f} s in all ({size / total / 2**30:.2f} GiB/s), of it {blocked:.1f} s "
              "before the step could go on")
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
