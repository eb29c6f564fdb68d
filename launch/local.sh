#!/usr/bin/env bash
# Start N JAX processes on this machine, each with its own fake CPU devices, joined by
# jax.distributed over localhost (gloo collectives): a multi-host run in miniature, for testing.
#
#   launch/local.sh N [--devices D] [--port PORT] [--module MODULE] [--logs DIR] [--own-dirs] -- [ARGS...]
#
#   N         processes (process ids 0 .. N-1)
#   D         fake CPU devices per process (default 1): --xla_force_host_platform_device_count
#   PORT      coordinator port on localhost (default: a free port)
#   MODULE    python module to run (default arlopti_jax.train)
#   DIR       per-process logs DIR/process_<i>.log (default: a new temporary folder)
#   --own-dirs  each process runs as if on a host of its own: in DIR/process_<i>/ as its working
#             directory, with its own TMPDIR and ARLOPTI_STAGING there (no shared disk but what
#             the flags name: a bucket, or absolute paths)
#   ARGS      the module's flags, the same for every process (e.g. --config.run_dir=runs/x)
#
# Process 0's output goes to this terminal as well as to its log. When one process fails,
# the others are stopped; the exit status is the first failure's (0 when all succeed).
# PYTHON (default: python3) selects the interpreter.
set -euo pipefail

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 2; }

[[ $# -ge 1 && $1 =~ ^[0-9]+$ && $1 -ge 1 ]] || usage
num=$1
shift
devices=1
port=""
module="arlopti_jax.train"
logs=""
own_dirs=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --devices) devices=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --module) module=$2; shift 2 ;;
    --logs) logs=$2; shift 2 ;;
    --own-dirs) own_dirs=1; shift ;;
    --) shift; break ;;
    *) usage ;;
  esac
done
python=${PYTHON:-python3}
if [[ -z $port ]]; then
  port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])')
fi
if [[ -z $logs ]]; then
  logs=$(mktemp -d -t arlopti_local.XXXXXX)
fi
mkdir -p "$logs"
echo "launch/local.sh: $num processes x $devices CPU devices, coordinator localhost:$port, logs in $logs" >&2

pids=()
declare -A process_of  # pid -> process id
cleanup() {
  for pid in "${pids[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
}
trap cleanup EXIT
trap 'cleanup; exit 143' TERM INT

for ((i = 0; i < num; i++)); do
  log="$logs/process_$i.log"
  (
    if [[ $own_dirs -eq 1 ]]; then
      mkdir -p "$logs/process_$i/tmp" "$logs/process_$i/staging"
      cd "$logs/process_$i"
      export TMPDIR="$logs/process_$i/tmp" ARLOPTI_STAGING="$logs/process_$i/staging"
    fi
    export JAX_PLATFORMS=cpu
    export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$devices"
    args=("$@" "--config.distributed.coordinator=localhost:$port"
          "--config.distributed.num_processes=$num" "--config.distributed.process_id=$i")
    if [[ $i -eq 0 ]]; then
      exec "$python" -m "$module" "${args[@]}" > >(tee "$log") 2>&1
    else
      exec "$python" -m "$module" "${args[@]}" > "$log" 2>&1
    fi
  ) &
  pids+=("$!")
  process_of[$!]=$i
done

# Poll rather than `wait -n`: processes that end together are reaped by bash before `wait -n PID...`
# looks for them ("no such job"); `wait PID` still returns a reaped process's saved status.
status=0
running=("${pids[@]}")
while [[ ${#running[@]} -gt 0 ]]; do
  left=()
  for pid in "${running[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      left+=("$pid")
      continue
    fi
    set +e
    wait "$pid"
    code=$?
    set -e
    if [[ $code -ne 0 && $status -eq 0 ]]; then
      status=$code
      echo "launch/local.sh: process ${process_of[$pid]} (pid $pid) exited with status $code; stopping the others (logs in $logs)" >&2
      cleanup
    fi
  done
  running=("${left[@]}")
  if [[ ${#running[@]} -gt 0 ]]; then sleep 0.2; fi
done
trap - EXIT
exit "$status"
