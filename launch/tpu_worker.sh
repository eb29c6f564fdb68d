#!/usr/bin/env bash
# The worker side of launch/tpu_pod.sh: run on every worker of a Cloud TPU VM over
# `gcloud compute tpus tpu-vm ssh --worker=...`, from the checkout tpu_pod.sh copied there.
#
#   tpu_worker.sh install DIR      stop any run, unpack checkout DIR over ~/arlopti_jax (outputs kept),
#                                  install it into ~/arlopti_venv: uv, Python 3.11, ".[tpu]" (JAX 0.10.2)
#   tpu_worker.sh mount BUCKET     mount gs://BUCKET read-only (gcsfuse) at /mnt/BUCKET
#   tpu_worker.sh start RUN ARGS   stop any run, then start `python -m arlopti_jax.train ARGS` detached
#                                  (setsid nohup): log ~/arlopti_logs/RUN/worker_<i>.log, pid file beside it
#   tpu_worker.sh stop             SIGTERM the run (the trainer saves and exits 75), SIGKILL after
#                                  ARLOPTI_STOP_WAIT seconds (default 120); wait until the chips are free
#   tpu_worker.sh status           this worker's run: running, or its exit status and what it means
#   tpu_worker.sh logs [LINES]     follow this worker's log
#
# <i> is the worker number (the VM's agent-worker-number metadata, as JAX reads it). A dropped ssh
# connection leaves the run going; a relaunch stops it first, and any arlopti_jax process left by
# an earlier launch, and waits until no process holds /dev/accel* or /dev/vfio/*.
set -euo pipefail
shopt -s nullglob

uv_version=0.13.8
python_version=3.11  # what CI tests; TPU VM images have shipped 3.10, which the package refuses
code=$HOME/arlopti_jax
venv=$HOME/arlopti_venv
logs=$HOME/arlopti_logs
uv=$HOME/.local/bin/uv
stop_wait=${ARLOPTI_STOP_WAIT:-120}

worker() {
  curl -sf --max-time 5 -H 'Metadata-Flavor: Google' \
    http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number ||
    hostname
}
me=$(worker)

say() { echo "tpu_worker.sh: worker $me: $*"; }

# as root: TPU VMs log in a user with passwordless sudo; a machine without sudo (a container running as
# root, CI) runs the command itself
as_root() {
  if [[ $(id -u) -ne 0 ]] && command -v sudo > /dev/null; then
    sudo "$@"
  else
    "$@"
  fi
}

# processes whose command line starts with $1 and holds $2
pids_of() {
  local pid cmd
  for pid in $(pgrep -f -- "$2" || true); do
    cmd=$(tr '\0' ' ' < "/proc/$pid/cmdline" 2> /dev/null) || continue
    if [[ $cmd == "$1"*"$2"* ]]; then
      echo "$pid"
    fi
  done
}
# this venv's trainers (started by this script or by an earlier launcher), no one else's
trainer_pids() { pids_of "$venv/bin/python" " -m arlopti_jax."; }
# the detached processes that wait for them (below, _run)
waiter_pids() { pids_of bash " _run $logs/"; }

chips_held() {
  local devices=(/dev/accel* /dev/vfio/[0-9]*)
  [[ ${#devices[@]} -gt 0 ]] && as_root lsof -t -w "${devices[@]}" 2> /dev/null | grep -q .
}

stop_run() {
  local pids waited=0
  pids=$(trainer_pids)
  if [[ -n $pids ]]; then
    say "stopping $(echo "$pids" | wc -w) arlopti_jax process(es): SIGTERM (save, exit 75), SIGKILL after ${stop_wait} s"
    # shellcheck disable=SC2086  # one pid per word
    kill -TERM $pids 2> /dev/null || true
    while [[ -n $(trainer_pids) && $waited -lt $stop_wait ]]; do
      sleep 1
      waited=$((waited + 1))
    done
    pids=$(trainer_pids)
    if [[ -n $pids ]]; then
      # shellcheck disable=SC2086
      kill -KILL $pids 2> /dev/null || true
    fi
  fi
  while [[ -n $(waiter_pids) ]]; do  # they write the exit status, then leave
    sleep 0.2
  done
  waited=0
  while chips_held; do
    if [[ $waited -ge 60 ]]; then
      say "the TPU chips are still held after 60 s:"
      as_root lsof -w /dev/accel* /dev/vfio/[0-9]* >&2 || true
      exit 1
    fi
    sleep 1
    waited=$((waited + 1))
  done
  if [[ -e /tmp/libtpu_lockfile ]]; then
    as_root rm -f /tmp/libtpu_lockfile  # a killed process leaves it behind
  fi
}

install() {
  local staged=$1
  stop_run
  mkdir -p "$code"
  cp -a "$staged/." "$code/"  # over the old checkout: run outputs inside it (runs/...) stay
  rm -rf "$staged"
  if [[ ! -x $uv ]]; then
    curl -LsSf "https://astral.sh/uv/$uv_version/install.sh" |
      env UV_INSTALL_DIR="$HOME/.local/bin" UV_NO_MODIFY_PATH=1 sh
  fi
  if ! "$venv/bin/python" -c "import sys; assert '%d.%d' % sys.version_info[:2] == '$python_version'" 2> /dev/null; then
    rm -rf "$venv"
    "$uv" venv --python "$python_version" "$venv"  # uv fetches that Python when the image lacks it
  fi
  "$uv" pip install --python "$venv/bin/python" -q -e "${code}[tpu]"
  say "installed: $("$venv/bin/python" -c 'import sys, jax; print("Python", sys.version.split()[0], "JAX", jax.__version__)')"
}

mount_bucket() {
  local bucket=$1 dir=/mnt/$1
  if mountpoint -q "$dir"; then
    if findmnt -no OPTIONS "$dir" | tr ',' '\n' | grep -qx ro; then
      return 0
    fi
    fusermount -u "$dir"  # mounted read-write by an earlier launcher: remount read-only
  fi
  if ! command -v gcsfuse > /dev/null; then
    curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | as_root tee /usr/share/keyrings/cloud.google.asc > /dev/null
    echo "deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-$(lsb_release -cs) main" |
      as_root tee /etc/apt/sources.list.d/gcsfuse.list > /dev/null
    as_root apt-get update -q && as_root apt-get install -y -q gcsfuse
  fi
  as_root mkdir -p "$dir"
  as_root chown "$USER" "$dir"
  # read-only: the model and the data are read through it; checkpoints go to gs:// directly
  gcsfuse -o ro --implicit-dirs "$bucket" "$dir"
  say "gs://$bucket mounted read-only at $dir"
}

start_run() {
  local run=$1 w=$me dir
  shift
  stop_run
  dir=$logs/$run
  mkdir -p "$dir"
  echo "$run" > "$logs/current"
  rm -f "$dir/worker_$w.exit"
  setsid nohup bash "$0" _run "$dir" "$w" "$@" >> "$dir/worker_$w.log" 2>&1 < /dev/null &
  say "started run $run: log $dir/worker_$w.log"
}

# The detached process: the trainer, its pid and then its exit status in files beside the log.
_run() {
  local dir=$1 w=$2 pid status=0 code_
  shift 2
  cd "$code"
  "$venv/bin/python" -m arlopti_jax.train --config.distributed.coordinator=auto "$@" &
  pid=$!
  echo "$pid" > "$dir/worker_$w.pid"
  # the VM's shutdown (a Spot preemption) signals this process too: pass it on, keep waiting
  trap 'kill -TERM "$pid" 2> /dev/null || true' TERM INT
  while true; do
    code_=0
    wait "$pid" || code_=$?
    if [[ $code_ -eq 127 ]]; then  # collected by the previous wait
      break
    fi
    status=$code_
    # > 128: a signal killed the trainer, or a trapped signal cut the wait short. Whether the trainer is
    # still there decides: bash answers a second wait for a dead job with its saved status, not 127,
    # so a trainer killed by SIGKILL (137) kept this loop spinning and `stop` waiting for it forever.
    if [[ $code_ -le 128 ]] || ! kill -0 "$pid" 2> /dev/null; then
      break
    fi
  done
  echo "$status" > "$dir/worker_$w.exit"
  rm -f "$dir/worker_$w.pid"
}

status() {
  local run w=$me dir code_
  if [[ ! -f $logs/current ]]; then
    say "no run started here"
    return 0
  fi
  run=$(< "$logs/current")
  dir=$logs/$run
  if [[ -f $dir/worker_$w.pid ]] && kill -0 "$(< "$dir/worker_$w.pid")" 2> /dev/null; then
    say "run $run is running (pid $(< "$dir/worker_$w.pid"))"
  elif [[ -f $dir/worker_$w.exit ]]; then
    code_=$(< "$dir/worker_$w.exit")
    case $code_ in
      0) say "run $run finished" ;;
      75) say "run $run stopped with a checkpoint (75): launch it again to resume" ;;
      2) say "run $run stopped at start-up (2): see its log" ;;
      *) say "run $run failed with status $code_: see its log" ;;
    esac
  else
    say "run $run is not running and left no exit status (killed, or the VM restarted)"
  fi
  if [[ -f $dir/worker_$w.log ]]; then
    say "log $dir/worker_$w.log ends: $(tail -n 1 "$dir/worker_$w.log")"
  fi
}

follow_log() {
  local run
  run=$(< "$logs/current")
  tail -n "${1:-100}" -F "$logs/$run/worker_$me.log"
}

verb=${1:-}
shift || true
case $verb in
  install) install "$@" ;;
  mount) mount_bucket "$@" ;;
  start) start_run "$@" ;;
  stop) stop_run ;;
  status) status ;;
  logs) follow_log "$@" ;;
  _run) _run "$@" ;;
  *) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 2 ;;
esac
