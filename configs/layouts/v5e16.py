"""The paper's K&K runs laid out on a TPU v5e-16 slice: 16 chips of 16 GiB on 4 hosts (docs/memory.md).

    launch/tpu_pod.sh --name rl-v5e --zone us-west4-a --type v5litepod-16 --bucket BUCKET -- \
        --config=configs/layouts/v5e16.py:3b,grpo_ar_lopti --config.model.path=/mnt/BUCKET/... \
        --config.run_dir=/mnt/BUCKET/runs/kk3b

The argument is configs/kk.py's MODEL,VARIANT. 3B: fsdp=16 with remat (peak 8.9 GiB per chip).
7B does not fit with float32 master weights on any layout (bench/memory_plan.py); with bfloat16
weights and AdamW state (param_dtype=bfloat16: less precise updates at lr 1e-6, where bf16
rounding can swallow small steps; prefer v5p or GPUs for 7B) fsdp=8 x tensor=2 fits (peak
11.5 GiB). tensor=2 stays inside a host (4 chips each), as multi-process runs require.
micro_batch = data x fsdp: one sequence per chip per micro-batch.
"""

from pathlib import Path

from arlopti_jax.config import apply_layout, load_config_file

KK = Path(__file__).resolve().parents[1] / "kk.py"
LAYOUTS = {"3b": dict(data=1, fsdp=16, tensor=1, param_dtype="float32"),
           "7b": dict(data=1, fsdp=8, tensor=2, param_dtype="bfloat16")}


def get_config(arg: str = "3b,grpo_ar_lopti"):
    return apply_layout(load_config_file(KK, arg), **LAYOUTS[arg.split(",")[0]])
