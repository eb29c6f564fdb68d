"""A stand-in for ``arlopti_jax.train`` that keeps only its stop contract, for testing launchers
without JAX: ``python -m stop_standin --config.run_dir=DIR --config.train.max_steps=N``
(other ``--config.*`` flags are accepted and ignored) takes one "step" every
``--config.standin.step_s`` seconds (default 0.5), appending ``{"step": s, "process": p}``
to DIR/steps_<p>.jsonl; SIGTERM or SIGINT makes it record the last finished step in
DIR/checkpoint_<p> and exit 75 ("stopped, resume me"); a start resumes after that step; after
the last step it exits 0. ``--config.standin.fail_at=S`` exits 1 at step S instead (a failure,
which a launcher must not requeue); ``--config.standin.ignore_stop=1`` records nothing and keeps
stepping on SIGTERM (a trainer stuck in a collective), so only SIGKILL ends it. p is SLURM_PROCID (0
outside SLURM)."""

import json
import os
import signal
import sys
import time
from pathlib import Path

STOPPED = 75


def main(argv: list[str]) -> int:
    flags = dict(a[len("--config."):].split("=", 1) for a in argv if a.startswith("--config.") and "=" in a)
    run_dir = Path(flags["run_dir"])
    max_steps = int(flags.get("train.max_steps", 4))
    step_s = float(flags.get("standin.step_s", 0.5))
    fail_at = int(flags.get("standin.fail_at", -1))
    linger_s = float(flags.get("standin.linger_s", 0))
    ignore_stop = flags.get("standin.ignore_stop", "0") == "1"
    process = int(os.environ.get("SLURM_PROCID", "0"))
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = run_dir / f"checkpoint_{process}"
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.append(signum))
    step = int(checkpoint.read_text()) if checkpoint.exists() else 0
    print(f"stop_standin: process {process} starts after step {step}, "
          f"SLURM_CPUS_PER_TASK={os.environ.get('SLURM_CPUS_PER_TASK')}", flush=True)
    with open(run_dir / f"steps_{process}.jsonl", "a") as records:
        while step < max_steps:
            if stop and not ignore_stop:
                checkpoint.write_text(str(step))
                print(f"stop_standin: process {process} stopped after step {step}", flush=True)
                if process > 0:
                    time.sleep(linger_s)
                return STOPPED
            time.sleep(step_s)
            step += 1
            if step == fail_at:
                print(f"stop_standin: process {process} fails at step {step}", flush=True)
                return 1
            records.write(json.dumps({"step": step, "process": process}) + "\n")
            records.flush()
    print(f"stop_standin: process {process} finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
