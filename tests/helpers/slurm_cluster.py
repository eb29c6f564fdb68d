"""A one-node SLURM cluster on localhost for the launcher tests: Debian's ``slurm-wlm`` daemons
(slurmctld, slurmd) and a private ``munged``, every file of theirs in one temporary folder, on
free ports, so the machine's own /etc/slurm and /etc/munge are neither read nor changed.

``start_cluster(folder)`` returns a ``Cluster`` whose ``env`` points the client commands
(sbatch, squeue, scontrol, scancel) at it; ``stop()`` ends the daemons it started (by pid).
``missing()`` says why the cluster cannot start here (commands not installed, not root), or
None. The node has no GPUs: jobs ask for none (``--gpus-per-node=0``). Jobs in the default
partition ``local`` are preempted by any job of partition ``urgent`` (PreemptMode=REQUEUE, a
30 s GraceTime: SIGTERM to the job's tasks, SIGKILL 30 s later)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "srun", "sinfo")


def missing() -> str | None:
    """Why a cluster cannot start on this machine, or None."""
    absent = [c for c in DAEMONS + CLIENTS if _exe(c) is None]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} missing: apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs (run the slow suite as root, as .ci/run does in CI)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _exe(name: str) -> str:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


@dataclass
class Cluster:
    folder: Path
    env: dict
    pids: dict = field(default_factory=dict)

    def run(self, *cmd: str, check: bool = True, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
        """A client command (sbatch, scontrol...) against this cluster; ``env`` replaces ``self.env``."""
        proc = subprocess.run(list(cmd), env=env or self.env, cwd=cwd, capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stdout}{proc.stderr}"
                                 f"\n{self.logs()}")
        return proc

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, Restarts, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}"
                         for p in sorted(self.folder.glob("*.log")))

    def stop(self) -> None:
        for name in reversed(list(self.pids)):
            try:
                os.kill(self.pids[name], signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(100):
                try:
                    os.kill(self.pids[name], 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                os.kill(self.pids[name], signal.SIGKILL)


LOCAL_PARTITION = ("PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP PriorityTier=1 "
                   "PreemptMode=REQUEUE GraceTime=30")


def _config(folder: Path, cpus: int) -> str:
    f = folder
    return f"""\
ClusterName=arlopti
SlurmctldHost=localhost
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={f}/munge.socket
CredType=cred/munge
StateSaveLocation={f}/state
SlurmdSpoolDir={f}/spool
SlurmctldPidFile={f}/slurmctld.pid
SlurmdPidFile={f}/slurmd.pid
SlurmctldLogFile={f}/slurmctld.log
SlurmdLogFile={f}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
JobRequeue=1
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
KillWait=10
SchedulerParameters=sched_interval=2
MinJobAge=600
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{LOCAL_PARTITION}
PartitionName=urgent Nodes=localhost MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""


def start_cluster(folder: Path, cpus: int = 2, timeout: float = 60) -> Cluster:
    """munged, slurmctld and slurmd on localhost, their state and logs in ``folder``; returns when
    the node is idle (raises with the daemons' logs otherwise)."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)  # munged refuses a key or socket folder that others can write
    for sub in ("state", "spool"):
        (folder / sub).mkdir(exist_ok=True)
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = folder / "slurm.conf"
    conf.write_text(_config(folder, cpus))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for var in [v for v in env if v.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and v != "SLURM_CONF"]:
        del env[var]  # a test run inside a SLURM job must not hand its own job's settings on
    cluster = Cluster(folder, env)
    try:
        subprocess.run([_exe("munged"), f"--socket={folder}/munge.socket", f"--key-file={key}",
                        f"--pid-file={folder}/munged.pid", f"--log-file={folder}/munged.log",
                        f"--seed-file={folder}/munged.seed", "--force"], check=True, env=env, timeout=30,
                       capture_output=True)
        cluster.pids["munged"] = int((folder / "munged.pid").read_text())
        # -i: clear the saved state (none is wanted from an earlier start in the same folder)
        for daemon, args in (("slurmctld", ["-i"]), ("slurmd", ["-N", "localhost"])):
            subprocess.run([_exe(daemon), *args], check=True, env=env, timeout=30, capture_output=True)
            pid_file = folder / f"{daemon}.pid"
            start = time.time()
            while not pid_file.exists() or not pid_file.read_text().strip():
                if time.time() - start > timeout:
                    raise AssertionError(f"{daemon} did not start\n{cluster.logs()}")
                time.sleep(0.2)
            cluster.pids[daemon] = int(pid_file.read_text())
        start = time.time()
        while True:
            state = cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip()
            if state.startswith("idle"):
                return cluster
            if time.time() - start > timeout:
                raise AssertionError(f"the node is {state!r}, not idle, after {timeout:.0f} s\n{cluster.logs()}")
            time.sleep(0.5)
    except BaseException:
        cluster.stop()
        raise
