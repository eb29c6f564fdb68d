"""The paper's K&K runs laid out on 8 GPUs of 80 GB (H100 / A100-80GB), one node (docs/reference/memory.md).

    python -m arlopti_jax.train --config=configs/layouts/gpu8x80.py:7b,grpo_ar_lopti \
        --config.model.path=/models/Qwen2.5-7B-Instruct-1M --config.run_dir=runs/kk7b

The argument is configs/kk.py's MODEL,VARIANT. Both models fit with fsdp=8 and per-layer remat
(bench/memory_plan.py: peak 16 GiB per GPU for 3B, 31 GiB for 7B, float32 master weights); fsdp
alone avoids tensor-parallel activation traffic. micro_batch = 8: one sequence per GPU per
micro-batch. Set XLA_CLIENT_MEM_FRACTION=0.95 (XLA preallocates 75% by default; launch/slurm_gpu.sh
sets it). For N such nodes under SLURM (launch/slurm_gpu.sh), add --config.mesh.data=N --config.train.micro_batch=8N
(or keep data=1 and let fsdp span all 8N GPUs: --config.mesh.fsdp=-1 --config.train.micro_batch=8N).
"""

from pathlib import Path

from arlopti_jax.config import apply_layout, load_config_file

KK = Path(__file__).resolve().parents[1] / "kk.py"
LAYOUTS = {"3b": dict(data=1, fsdp=8, tensor=1), "7b": dict(data=1, fsdp=8, tensor=1)}


def get_config(arg: str = "7b,grpo_ar_lopti"):
    c = apply_layout(load_config_file(KK, arg), **LAYOUTS[arg.split(",")[0]])
    # the sampler's bfloat16 copy of the weights whole on each GPU, so no decode step gathers them ("auto" does so
    # for 3B; 7B's copy, 15.2 GB, is over its eighth of an H100, but compiled the step peaks at 52.4 GiB of 79)
    c.rollout.whole_weights = "on"
    return c
