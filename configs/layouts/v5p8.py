"""The paper's K&K runs laid out on a TPU v5p-8: 4 chips of 95 GiB, one host (docs/reference/memory.md).

    launch/tpu_pod.sh --name rl-v5p --zone us-east5-a --type v5p-8 -- \
        --config=configs/layouts/v5p8.py:7b,grpo_ar_lopti --config.model.path=... --config.run_dir=...

The argument is configs/kk.py's MODEL,VARIANT. fsdp=4 with per-layer remat fits both models,
float32 master weights: compiled for a v5p-8 (python -m arlopti_jax.aot, docs/measurements/aot/), the step's
peak is 52.7 GiB per chip for 3B (2026-12-07; 58.5 at rollout.max_staleness=1, with two copies of
the policy) and 87.1 GiB for 7B (2026-11-28), both at the sampler's compaction from 128 to 64 rows
at 4,544 slots, with the sampler's weights whole on each chip for 3B (bench/memory_plan.py's
estimate: 32 and 60 GiB); data=2 x fsdp=2 does not fit 7B. micro_batch = 4: one sequence per chip
per micro-batch.
"""

from pathlib import Path

from arlopti_jax.config import apply_layout, load_config_file

KK = Path(__file__).resolve().parents[1] / "kk.py"
LAYOUTS = {"3b": dict(data=1, fsdp=4, tensor=1), "7b": dict(data=1, fsdp=4, tensor=1)}


def get_config(arg: str = "7b,grpo_ar_lopti"):
    return apply_layout(load_config_file(KK, arg), **LAYOUTS[arg.split(",")[0]])
