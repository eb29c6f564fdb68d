"""The paper's K&K runs laid out on a TPU v5p-8: 4 chips of 95 GiB, one host (docs/memory.md).

    launch/tpu_pod.sh --name rl-v5p --zone us-east5-a --type v5p-8 -- \
        --config=configs/layouts/v5p8.py:7b,grpo_ar_lopti --config.model.path=... --config.run_dir=...

The argument is configs/kk.py's MODEL,VARIANT. fsdp=4 with per-layer remat fits both models
(bench/memory_plan.py: peak 32 GiB per chip for 3B, 60 GiB for 7B, float32 master weights);
data=2 x fsdp=2 does not fit 7B. micro_batch = 4: one sequence per chip per micro-batch.
"""

import importlib.util
from pathlib import Path

LAYOUTS = {"3b": dict(data=1, fsdp=4, tensor=1), "7b": dict(data=1, fsdp=4, tensor=1)}


def kk_config(arg: str):
    spec = importlib.util.spec_from_file_location("configs_kk", Path(__file__).resolve().parents[1] / "kk.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def get_config(arg: str = "7b,grpo_ar_lopti"):
    c = kk_config(arg)
    layout = LAYOUTS[arg.split(",")[0]]
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = layout["data"], layout["fsdp"], layout["tensor"]
    c.train.micro_batch = layout["data"] * layout["fsdp"]
    c.model.remat = True
    return c
