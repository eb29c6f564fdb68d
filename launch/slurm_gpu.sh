#!/usr/bin/env bash
#SBATCH --job-name=arlopti
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
#
# Multi-node GPU training under SLURM: every task runs the same arlopti_jax command.
#
#   sbatch launch/slurm_gpu.sh [TRAIN ARGS...]
#   sbatch --nodes=4 launch/slurm_gpu.sh --config=configs/kk.py:7b,grpo_ar_lopti \
#       --config.model.path=/shared/models/Qwen2.5-7B-Instruct-1M --config.run_dir=/shared/runs/kk7b
#
# Default: one process per node driving all of its GPUs (--ntasks-per-node=1). For one process
# per GPU: sbatch --ntasks-per-node=8 --gpus-per-task=1 launch/slurm_gpu.sh ...
# arlopti_jax reads the process count and id from SLURM_NTASKS / SLURM_PROCID; the coordinator is
# the allocation's first node, on port ARLOPTI_COORDINATOR_PORT (default: derived from the job id).
# run_dir, the model folder and the data must be on a filesystem every node sees (checkpoints are
# written by all processes into the same folder).
#
# Environment: PYTHON (default python3, e.g. a venv with `pip install -e . "jax[cuda12]"`),
# ARLOPTI_MODULE (default arlopti_jax.train; arlopti_jax.eval evaluates the same way).
set -euo pipefail

: "${SLURM_JOB_ID:?run this script with sbatch (or inside an salloc allocation)}"
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=${ARLOPTI_COORDINATOR_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
python=${PYTHON:-python3}
module=${ARLOPTI_MODULE:-arlopti_jax.train}

echo "slurm_gpu.sh: job $SLURM_JOB_ID, ${SLURM_NNODES:-?} nodes, ${SLURM_NTASKS:-?} tasks, coordinator $head_node:$port" >&2
srun --kill-on-bad-exit=1 "$python" -m "$module" --config.distributed.coordinator="$head_node:$port" "$@"
