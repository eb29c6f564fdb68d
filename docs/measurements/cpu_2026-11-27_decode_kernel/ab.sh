#!/bin/bash
# interleaved before/after rollout on the CPU: $1 = label, rest = rollout.py args
label=$1; shift
for round in 1 2; do
  for side in before after; do
    if [[ $side == before ]]; then dir=/tmp/before; else dir=/work/main; fi
    out=$(cd $dir && JAX_PLATFORMS=cpu PYTHONPATH=$dir timeout 900 /work/main/.venv/bin/python bench/rollout.py "$@" 2>&1)
    echo "$label round $round $side: $(echo "$out" | grep -E '^\| ours' | tr '\n' ' ')"
  done
done
