#!/usr/bin/env bash
# Train on a Cloud TPU VM (one host, e.g. v5p-8, or a pod slice, e.g. v5e-16 with 4 hosts):
# create the TPU VM unless it exists, copy this checkout to every worker, install it there, and
# run the same command on all workers at once. JAX finds the other workers itself
# (--config.distributed.coordinator=auto).
#
#   launch/tpu_pod.sh --name NAME --zone ZONE --type TYPE [--version RUNTIME] [--project PROJECT]
#                     [--spot] [--bucket BUCKET] [--skip-install] -- [TRAIN ARGS...]
#
#   NAME      the TPU VM (reused when it exists; created with TYPE and RUNTIME otherwise)
#   TYPE      accelerator type: v5p-8, v5litepod-16, v4-32, ...
#   RUNTIME   TPU software version for creation (default v2-alpha-tpuv5 for v5p,
#             v2-alpha-tpuv5-lite for v5e / v5litepod, tpu-ubuntu2204-base otherwise)
#   BUCKET    a GCS bucket to mount with gcsfuse at /mnt/BUCKET on every worker: a multi-host
#             run_dir (checkpoints), the model folder and the data must be visible to all workers
#   --skip-install  reuse the code and virtual environment already on the workers
#
# Example (3B, 16 v5e chips on 4 hosts; see docs/reference/memory.md for the layout):
#   launch/tpu_pod.sh --name rl-v5e --zone us-west4-a --type v5litepod-16 --bucket my-bucket -- \
#       --config=configs/layouts/v5e16.py:3b,grpo_ar_lopti \
#       --config.model.path=/mnt/my-bucket/models/Qwen2.5-3B-Instruct \
#       --config.data.train_files=/mnt/my-bucket/data/kk/3ppl/train.parquet \
#       --config.data.test_files=/mnt/my-bucket/data/kk/3ppl/test.parquet \
#       --config.run_dir=/mnt/my-bucket/runs/kk3b
set -euo pipefail

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 2; }

name="" zone="" type="" version="" project="" spot=0 bucket="" install=1
while [[ $# -gt 0 ]]; do
  case $1 in
    --name) name=$2; shift 2 ;;
    --zone) zone=$2; shift 2 ;;
    --type) type=$2; shift 2 ;;
    --version) version=$2; shift 2 ;;
    --project) project=$2; shift 2 ;;
    --spot) spot=1; shift ;;
    --bucket) bucket=$2; shift 2 ;;
    --skip-install) install=0; shift ;;
    --) shift; break ;;
    *) usage ;;
  esac
done
[[ -n $name && -n $zone ]] || usage
if [[ -z $version ]]; then
  case $type in
    v5p*) version=v2-alpha-tpuv5 ;;
    v5e* | v5lite*) version=v2-alpha-tpuv5-lite ;;
    *) version=tpu-ubuntu2204-base ;;
  esac
fi

gcloud_tpu=(gcloud compute tpus tpu-vm)
where=(--zone "$zone")
if [[ -n $project ]]; then
  where+=(--project "$project")
fi

# 1. the TPU VM
if "${gcloud_tpu[@]}" describe "$name" "${where[@]}" > /dev/null 2>&1; then
  echo "tpu_pod.sh: reusing TPU VM $name" >&2
else
  [[ -n $type ]] || { echo "tpu_pod.sh: $name does not exist; give --type to create it" >&2; exit 2; }
  create=("${gcloud_tpu[@]}" create "$name" "${where[@]}" --accelerator-type "$type" --version "$version")
  if [[ $spot -eq 1 ]]; then
    create+=(--spot)
  fi
  echo "tpu_pod.sh: creating $type TPU VM $name ($version)" >&2
  "${create[@]}"
fi

on_all_workers() {
  "${gcloud_tpu[@]}" ssh "$name" "${where[@]}" --worker=all --command="$1"
}

# 2. code and environment on every worker
if [[ $install -eq 1 ]]; then
  repo=$(cd "$(dirname "$0")/.." && pwd)
  tarball=$(mktemp -t arlopti_jax.XXXXXX.tgz)
  trap 'rm -f "$tarball"' EXIT
  (cd "$repo" && git ls-files -z --cached --others --exclude-standard | tar --null -czf "$tarball" -T -)
  "${gcloud_tpu[@]}" scp "$tarball" "$name:arlopti_jax.tgz" "${where[@]}" --worker=all
  on_all_workers 'set -e
    rm -rf ~/arlopti_jax && mkdir -p ~/arlopti_jax && tar xzf ~/arlopti_jax.tgz -C ~/arlopti_jax
    python3 -m venv ~/arlopti_venv
    ~/arlopti_venv/bin/pip install -q --upgrade pip
    ~/arlopti_venv/bin/pip install -q -e ~/arlopti_jax "jax[tpu]"'
fi
if [[ -n $bucket ]]; then
  on_all_workers "set -e
    if ! command -v gcsfuse > /dev/null; then
      echo 'deb https://packages.cloud.google.com/apt gcsfuse-\$(lsb_release -c -s) main' |
        sudo tee /etc/apt/sources.list.d/gcsfuse.list > /dev/null
      curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo apt-key add - > /dev/null
      sudo apt-get update -q && sudo apt-get install -y -q gcsfuse
    fi
    sudo mkdir -p /mnt/$bucket && sudo chown \"\$USER\" /mnt/$bucket
    mountpoint -q /mnt/$bucket || gcsfuse --implicit-dirs $bucket /mnt/$bucket"
fi

# 3. the same command on every worker
train_args=$(printf '%q ' "$@")
echo "tpu_pod.sh: running arlopti_jax.train on every worker of $name" >&2
on_all_workers "cd ~/arlopti_jax && ~/arlopti_venv/bin/python -m arlopti_jax.train \
--config.distributed.coordinator=auto $train_args"
