#!/bin/bash
# Interleaved before/after rollout on the CPU: each process times bench/rollout.py's rounds after a
# warm-up and prints their median. $1 = label, the rest = rollout.py's arguments.
# BEFORE: a tree of the old package and bench (git archive REV arlopti_jax bench | tar -x -C DIR);
# AFTER: this checkout; ORDER="after before" runs each pair the other way round.
label=$1; shift
before=${BEFORE:-/tmp/before}; after=${AFTER:-$(git rev-parse --show-toplevel)}
for round in 1 2; do
  for side in ${ORDER:-before after}; do
    if [[ $side == before ]]; then dir=$before; else dir=$after; fi
    out=$(cd "$dir" && JAX_PLATFORMS=cpu PYTHONPATH=$dir timeout 900 python bench/rollout.py "$@" 2>&1)
    echo "$label round $round $side: $(echo "$out" | grep -E '^\| ours' | tr '\n' ' ')"
  done
done
