#!/usr/bin/env bash
# Train on a Cloud TPU VM (one host, e.g. v5p-8, or a pod slice, e.g. v5litepod-16 with 4 hosts):
# the TPU VM created when it is missing and recreated when it is not READY (a PREEMPTED Spot VM
# cannot be restarted), this checkout installed on every worker (launch/tpu_worker.sh: uv,
# Python 3.11, JAX 0.10.2 with libtpu), the bucket mounted read-only for the model and data, and
# the same command started detached on every worker, any earlier run stopped first. JAX finds the
# other workers itself (--config.distributed.coordinator=auto).
#
#   launch/tpu_pod.sh --name NAME --zone ZONE [--type TYPE] [--version RUNTIME] [--project PROJECT]
#                     [--spot] [--bucket BUCKET] [--run RUN] [--skip-install] [--dry-run]
#                     [--assume-state STATE] -- [TRAIN ARGS...]
#   launch/tpu_pod.sh --name NAME --zone ZONE [--project PROJECT] --status | --stop | --logs [--worker I]
#
#   NAME      the TPU VM
#   TYPE      accelerator type for creation: v5p-8, v5litepod-16, v4-32, v6e-8, ...
#   RUNTIME   TPU software version for creation (default v2-alpha-tpuv5 for v5p,
#             v2-alpha-tpuv5-lite for v5e / v5litepod, v2-alpha-tpuv6e for v6e, tpu-ubuntu2204-base otherwise)
#   --spot    create a Spot VM (preemptible; relaunching the same command after a preemption
#             recreates it and the run resumes from its last checkpoint)
#   BUCKET    mounted with gcsfuse, read-only, at /mnt/BUCKET on every worker, for model.path and the
#             data files; give run_dir (and compile_cache_dir) as gs://BUCKET/... paths
#   RUN       the run's name for the workers' logs, ~/arlopti_logs/RUN/worker_<i>.log (default: the
#             last part of --config.run_dir, else "run")
#   --skip-install  keep the code and virtual environment already on the workers
#   --dry-run       print every gcloud command, one per line, and run none; the TPU's state is then
#                   taken from --assume-state: NEW (no such TPU), READY, PREEMPTED or any other state
#   --status  the TPU's state and each worker's run; --stop: SIGTERM every worker's run (it saves
#             and exits 75) and wait; --logs: follow worker I's log (default 0)
#
# Example (3B, 16 v5e chips on 4 hosts; docs/guides/multi_host.md stages the model and data):
#   launch/tpu_pod.sh --name rl-v5e --zone us-west4-a --type v5litepod-16 --spot --bucket my-bucket -- \
#       --config=configs/layouts/v5e16.py:3b,grpo_ar_lopti \
#       --config.model.path=/mnt/my-bucket/models/Qwen2.5-3B-Instruct \
#       --config.data.train_files=/mnt/my-bucket/data/kk/3ppl/train.parquet,/mnt/my-bucket/data/kk/4ppl/train.parquet \
#       --config.data.test_files=/mnt/my-bucket/data/kk/3ppl/test.parquet \
#       --config.run_dir=gs://my-bucket/runs/kk3b --config.compile_cache_dir=gs://my-bucket/jax_cache
set -euo pipefail

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 2; }
fail() { echo "tpu_pod.sh: error: $*" >&2; exit 2; }

name="" zone="" type="" version="" project="" spot=0 bucket="" run="" install=1 dry=0 assume=""
verb=launch worker=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --name) name=$2; shift 2 ;;
    --zone) zone=$2; shift 2 ;;
    --type) type=$2; shift 2 ;;
    --version) version=$2; shift 2 ;;
    --project) project=$2; shift 2 ;;
    --spot) spot=1; shift ;;
    --bucket) bucket=${2#gs://}; shift 2 ;;
    --run) run=$2; shift 2 ;;
    --skip-install) install=0; shift ;;
    --dry-run) dry=1; shift ;;
    --assume-state) assume=$2; shift 2 ;;
    --status) verb=status; shift ;;
    --stop) verb=stop; shift ;;
    --logs) verb=logs; shift ;;
    --worker) worker=$2; shift 2 ;;
    --) shift; break ;;
    *) usage ;;
  esac
done
[[ -n $name && -n $zone ]] || usage
if [[ $dry -eq 1 && -z $assume ]]; then
  fail "--dry-run takes the TPU's state from --assume-state NEW|READY|PREEMPTED|<state>"
fi
if [[ $dry -eq 0 && -n $assume ]]; then
  fail "--assume-state is for --dry-run only"
fi
if [[ -z $version ]]; then
  case $type in
    v5p*) version="v2-alpha-tpuv5" ;;
    v5e* | v5lite*) version="v2-alpha-tpuv5-lite" ;;
    v6e*) version="v2-alpha-tpuv6e" ;;
    *) version="tpu-ubuntu2204-base" ;;
  esac
fi
if [[ -z $run ]]; then
  for arg in "$@"; do
    if [[ $arg == --config.run_dir=* ]]; then
      run=${arg#--config.run_dir=}
      run=${run%/}
      run=${run##*/}
    fi
  done
  run=${run:-run}
fi

tpu=(gcloud compute tpus tpu-vm)
where=(--zone "$zone")
if [[ -n $project ]]; then
  where+=(--project "$project")
fi
# shellcheck disable=SC2088  # the tilde is for the worker's shell to expand
worker_script='~/arlopti_jax/launch/tpu_worker.sh'

# a word for a shell command line: as it is when plain, else in single quotes
quote() {
  if [[ $1 =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# every gcloud command goes through here: printed (--dry-run) or run
gc() {
  if [[ $dry -eq 1 ]]; then
    local words=() arg
    for arg in "$@"; do
      words+=("$(quote "$arg")")
    done
    echo "${words[*]}"
  else
    "$@"
  fi
}
on_workers() {  # on_workers WORKERS COMMAND
  gc "${tpu[@]}" ssh "$name" "${where[@]}" --worker="$1" --command="$2"
}

# The TPU's state: READY, PREEMPTED, CREATING, ... or NEW when there is no such TPU.
tpu_state() {
  local out
  if [[ $dry -eq 1 ]]; then
    gc "${tpu[@]}" describe "$name" "${where[@]}" --format='value(state)'
    state=$assume
    return
  fi
  if out=$("${tpu[@]}" describe "$name" "${where[@]}" --format='value(state)' 2>&1); then
    state=$out
  elif [[ $out == *NOT_FOUND* || $out == *"not found"* ]]; then
    state=NEW
  else
    echo "$out" >&2
    fail "could not read the state of TPU $name"
  fi
}

case $verb in
  status)
    tpu_state
    echo "tpu_pod.sh: TPU $name is $state" >&2
    if [[ $state == READY ]]; then
      on_workers all "bash $worker_script status"
    fi
    exit 0 ;;
  stop) on_workers all "bash $worker_script stop"; exit 0 ;;
  logs) on_workers "$worker" "bash $worker_script logs"; exit 0 ;;
esac

# 1. the TPU VM: reuse it when READY, else (re)create it
tpu_state
if [[ $state != READY ]]; then
  [[ -n $type ]] || fail "TPU $name is $state; give --type to create it"
  if [[ $state != NEW ]]; then
    echo "tpu_pod.sh: TPU $name is $state: deleting it to create it again" >&2
    gc "${tpu[@]}" delete "$name" "${where[@]}" --quiet
    install=1
  fi
  create=("${tpu[@]}" create "$name" "${where[@]}" --accelerator-type="$type" --version="$version")
  kind=""
  if [[ $spot -eq 1 ]]; then
    create+=(--spot)
    kind=", Spot"
  fi
  echo "tpu_pod.sh: creating $type TPU VM $name ($version$kind)" >&2
  gc "${create[@]}"
  install=1  # a new VM has nothing on it
else
  echo "tpu_pod.sh: reusing TPU VM $name (READY)" >&2
fi

# 2. this checkout on every worker, staged beside the old one, then installed by the new worker
# script (which first stops any run still using the old code)
if [[ $install -eq 1 ]]; then
  repo=$(cd "$(dirname "$0")/.." && pwd)
  if [[ $dry -eq 1 ]]; then
    tarball="${TMPDIR:-/tmp}/arlopti_jax.XXXXXX.tgz"  # made by mktemp when not a dry run
  else
    tarball=$(mktemp "${TMPDIR:-/tmp}/arlopti_jax.XXXXXX.tgz")
    trap 'rm -f "$tarball"' EXIT
    (cd "$repo" && git ls-files -z --cached --others --exclude-standard | tar --null -czf "$tarball" -T -)
  fi
  gc "${tpu[@]}" scp "$tarball" "$name:arlopti_jax.tgz" "${where[@]}" --worker=all
  on_workers all 'rm -rf ~/arlopti_jax.new && mkdir ~/arlopti_jax.new && tar xzf ~/arlopti_jax.tgz -C ~/arlopti_jax.new && bash ~/arlopti_jax.new/launch/tpu_worker.sh install ~/arlopti_jax.new'
fi

# 3. the bucket, read-only, for the model and the data
if [[ -n $bucket ]]; then
  on_workers all "bash $worker_script mount $bucket"
fi

# 4. the same command on every worker, detached; a dropped connection leaves it running
start="bash $worker_script start $(quote "$run")"
for arg in "$@"; do
  start+=" $(quote "$arg")"
done
on_workers all "$start"
if [[ $dry -eq 0 ]]; then
  echo "tpu_pod.sh: started run $run on every worker of $name. Follow worker 0:" >&2
  echo "  $0 --name $name --zone $zone${project:+ --project $project} --logs" >&2
fi
