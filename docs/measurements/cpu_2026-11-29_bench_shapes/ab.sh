#!/bin/bash
# bench/realistic.py's CPU default workload timed with the bench before this change (OLD: its copy of
# bench/realistic.py at 7b7b2fc, beside bench/common.py) and after, alternating by process; the
# package is this checkout's in both. Usage: OLD=/tmp/oldbench bash ab.sh PAIRS
cd "$(dirname "$0")/../../.." || exit 1
for i in $(seq "${1:-3}"); do
  for side in old new; do
    script=bench/realistic.py; [ "$side" = old ] && script=$OLD/realistic.py
    echo "== pair $i: $side"
    PYTHONPATH=$PWD .venv/bin/python "$script" --before none --skip-tiny --rounds 1 --steps 2 2>/dev/null \
      | grep -E "^\| (rollout|ref_logprobs|update|step) |MFU"
  done
done
