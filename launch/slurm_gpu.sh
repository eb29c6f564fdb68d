#!/usr/bin/env bash
#SBATCH --job-name=arlopti
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=TERM@120
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
#
# Multi-node GPU training under SLURM: every task runs the same arlopti_jax command; a job that
# SLURM stops before it finishes is requeued and resumes from its last checkpoint.
#
#   sbatch launch/slurm_gpu.sh [TRAIN ARGS...]
#   sbatch --nodes=4 launch/slurm_gpu.sh --config=configs/kk.py:7b,grpo_ar_lopti \
#       --config.model.path=/shared/models/Qwen2.5-7B-Instruct-1M --config.run_dir=/shared/runs/kk7b
#
# Tasks: one process per node driving its 8 GPUs (--ntasks-per-node=1, the default), or one per
# GPU: sbatch --ntasks-per-node=8 --gpus-per-task=1 launch/slurm_gpu.sh ... Whole nodes
# (--exclusive): each task gets the node's CPUs divided by its tasks (SLURM_CPUS_ON_NODE / tasks
# per node, or sbatch --cpus-per-task=N), passed to srun, which since SLURM 22.05 does not take
# sbatch's --cpus-per-task. Tokenizing and the reward workers run on those CPUs.
#
# Stop and requeue (docs/guides/multi_host.md, "SLURM"): 120 s before the time limit
# (--signal=TERM@120) SLURM sends SIGTERM to every task; the trainer saves a checkpoint within
# its grace period (--config.train.grace_s, default 30 s) and exits with status 75 ("stopped,
# resume me"); then this script requeues the job (scontrol requeue; same job id, output appended),
# and the next start resumes from that checkpoint (resume=auto). 120 = grace_s + 90 s for the
# processes to leave and the requeue; a longer grace_s needs a longer --signal on the sbatch
# command line. A finished run (0) or a failed one (anything else) is not requeued. SLURM's
# preemption (PreemptMode=REQUEUE with a GraceTime) signals the tasks the same way. A stop must go
# to the tasks, not to this script or srun (no "B:" in --signal, no scancel --full or --batch):
# srun turns a SIGTERM it receives into a SIGKILL of its tasks. --time must be well above the
# --signal lead (a job signalled at its start is stopped at every start). SLURM holds a requeued
# job back for about 2 minutes before it may start again (its EligibleTime).
#
# Each task joins the others through JAX's own SLURM detection (jax.distributed.initialize): the
# process count and id from SLURM_NTASKS / SLURM_PROCID, the coordinator on the step's first node, on
# port JAX_COORDINATOR_PORT (default: JAX's, from the job id). The GPUs a task drives are
# arlopti_jax's choice (runtime/distributed.py): all its node's with one task per node, its share of
# them with several. run_dir, the model folder and the data must be on a filesystem every node sees,
# or in a bucket (gs://...).
#
# Environment: PYTHON (default python3, e.g. a venv with `pip install -e ".[cuda]"`),
# ARLOPTI_MODULE (default arlopti_jax.train; arlopti_jax.eval evaluates the same way),
# XLA_CLIENT_MEM_FRACTION (default 0.95: the share of each GPU's memory JAX
# preallocates; configs/layouts/ count on it). On CPU devices (tests): sbatch --gpus-per-node=0.
set -euo pipefail

: "${SLURM_JOB_ID:?run this script with sbatch (or inside an salloc allocation)}"
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
python=${PYTHON:-python3}
module=${ARLOPTI_MODULE:-arlopti_jax.train}
stopped=75  # the trainer's "stopped, resume me" (EX_TEMPFAIL)

per_node() {  # one of SLURM's per-node lists, one value per node: "4(x2),2" -> "4 4 2"
  local part i out=()
  local -a parts
  IFS=, read -ra parts <<< "$1"
  for part in "${parts[@]}"; do
    if [[ $part =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
      for ((i = 0; i < BASH_REMATCH[2]; i++)); do out+=("${BASH_REMATCH[1]}"); done
    else
      out+=("$part")
    fi
  done
  echo "${out[@]}"
}

# CPUs per task: sbatch's --cpus-per-task when given, else the fewest any node has per task (srun takes
# one count for every task; "4(x2),2" tasks on three 32-CPU nodes: 8)
if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
  cpus_per_task=$SLURM_CPUS_PER_TASK
else
  read -ra tasks <<< "$(per_node "${SLURM_TASKS_PER_NODE:-1}")"
  read -ra cpus <<< "$(per_node "${SLURM_JOB_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-1}}")"
  cpus_per_task=
  for i in "${!tasks[@]}"; do
    here=$(( ${cpus[i]:-${cpus[-1]}} / tasks[i] ))
    if [[ -z $cpus_per_task ]] || (( here < cpus_per_task )); then
      cpus_per_task=$here
    fi
  done
fi
if (( cpus_per_task < 1 )); then
  cpus_per_task=1
fi
if [[ -z ${XLA_PYTHON_CLIENT_MEM_FRACTION:-} ]]; then  # JAX refuses both names at once
  export XLA_CLIENT_MEM_FRACTION=${XLA_CLIENT_MEM_FRACTION:-0.95}
fi

echo "slurm_gpu.sh: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}), ${SLURM_NNODES:-?} nodes," \
  "${SLURM_NTASKS:-?} tasks x $cpus_per_task CPUs, coordinator on $head_node" \
  "(port ${JAX_COORDINATOR_PORT:-from the job id})" >&2

# --kill-on-bad-exit: a task that fails takes the others down with it (they would wait for it at the
# next collective). A stopping trainer ignores further stop signals once its checkpoint is saved, so
# the SIGTERM this sends to the tasks still leaving after the first exits with 75 leaves their 75 as is.
status=0
srun --kill-on-bad-exit=1 --cpus-per-task="$cpus_per_task" \
  "$python" -m "$module" "$@" || status=$?

if [[ $status -eq $stopped ]]; then
  echo "slurm_gpu.sh: the run stopped with a checkpoint (status $stopped); requeueing job $SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
echo "slurm_gpu.sh: srun exited with status $status" >&2
exit "$status"
