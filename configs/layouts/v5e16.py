"""The paper's K&K runs laid out on a TPU v5e-16 slice: 16 chips of 16 GiB on 4 hosts (docs/reference/memory.md).

    launch/tpu_pod.sh --name rl-v5e --zone us-west4-a --type v5litepod-16 --bucket BUCKET -- \
        --config=configs/layouts/v5e16.py:3b,grpo_ar_lopti --config.model.path=/mnt/BUCKET/... \
        --config.run_dir=gs://BUCKET/runs/kk3b

The argument is configs/kk.py's MODEL,VARIANT. 3B: fsdp=16 with remat, float32 master weights;
compiled for a v5e-16 (python -m arlopti_jax.aot, docs/measurements/aot/) the step peaks at 11.6 GiB per chip
(the sampler's compaction from 32 to 16 rows at 4,544 slots; bench/memory_plan.py estimated 8.9).
7B does not fit with float32 master weights on any layout (bench/memory_plan.py). With bfloat16
weights and AdamW state (param_dtype=bfloat16: less precise updates at lr 1e-6, where bf16
rounding can swallow small steps; prefer v5p or GPUs for 7B) and fsdp=8 x tensor=2, the
compiler found that the length-aware sampler's growths and compactions do not fit either: each
holds two KV caches, and one full cache is 7.8 GiB per chip (compaction from 64 to 32 rows at
4,544 slots: 17.3 GiB of the 15.2 usable; the estimate said 11.5). So 7B here decodes in one
phase at the full length without compaction (rollout.phase_tokens = max_response_length,
rollout.min_rows = the 64 rows per chip): peak 11.9 GiB per chip, compiled, at the cost of
every decode step attending over all 4,544 slots and all rows until the last one finishes.
tensor=2 stays inside a host (4 chips each), as multi-process runs require. micro_batch = data x
fsdp: one sequence per chip per micro-batch.
"""

from pathlib import Path

from arlopti_jax.config import apply_layout, load_config_file

KK = Path(__file__).resolve().parents[1] / "kk.py"
LAYOUTS = {"3b": dict(data=1, fsdp=16, tensor=1, param_dtype="float32"),
           "7b": dict(data=1, fsdp=8, tensor=2, param_dtype="bfloat16")}


def get_config(arg: str = "3b,grpo_ar_lopti"):
    model = arg.split(",")[0]
    c = apply_layout(load_config_file(KK, arg), **LAYOUTS[model])
    if model == "7b":  # one decode phase, no compaction: two caches of 7B do not fit a chip
        c.rollout.phase_tokens = c.rollout.max_response_length
        c.rollout.min_rows = c.train.batch_prompts * c.rollout.n // (c.mesh.data * c.mesh.fsdp)
    return c
