"""Crash injection at the places a run writes, so that tests can prove every crash resumes exactly.

    ARLOPTI_FAULT=SITE:N[@P]     die the N-th time this process passes SITE (only process P of a
                                 multi-process run, when @P is given)

Dying is ``SIGKILL`` to this process: no ``finally``, no flush, no atexit, as a power cut or the
kernel's out-of-memory killer would stop it. With ``ARLOPTI_FAULT_SIGNAL=NAME`` (``SIGTERM``, say)
the armed pass sends that signal to this process instead and carries on, its write whole: a
preemption notice that lands at a known point of a step. A site that writes text (``write``) first writes the
first half of it and flushes, so the file is left with a half-written last line or record. Without
the variable every call here is a dictionary look-up and returns.

The sites, each where the code that owns the file writes it:

    metrics               a metrics.jsonl record (metrics.MetricsWriter)
    eval                  an eval.jsonl record (evaluation.append_jsonl)
    generations           an evaluation's responses (evaluation.write_generations)
    checkpoint_write      right after a checkpoint save starts: its step folder is cut mid-write
    checkpoint_commit     the step folder written, before its commit (the rename)
    checkpoint_committed  just after the commit
    results               the sweep's results.json (sweep.Sweep.save)
    worker_records        a --jobs worker's records file (sweep.Sweep.save)
    start_point           the start point built, before its folder is renamed into place
    converter             the GGUF converter's folder, weights written, the rest not
    package_file          a package's GGUF file being unpacked into the download cache
    exit                  a stopped or finished trainer about to leave (train.main); with the
                          signal set, it stands for the second SIGTERM ``srun --kill-on-bad-exit`` sends
    episode               the host about to answer a batch of tool episodes' ended turns, the episodes
                          in flight in the sampler (episode_host.EpisodeBatch.answer)

``tests/runtime/test_faults.py`` kills a run at each site and checks that the resumed run's records
equal the uninterrupted run's.
"""

from __future__ import annotations

import os
import signal
from typing import IO

ENV = "ARLOPTI_FAULT"
SIGNAL_ENV = "ARLOPTI_FAULT_SIGNAL"
SITES = ("metrics", "eval", "generations", "checkpoint_write", "checkpoint_commit", "checkpoint_committed",
         "results", "worker_records", "start_point", "converter", "package_file", "exit", "episode")
_passes: dict[str, int] = {}


def _armed(site: str) -> bool:
    """Whether this pass of ``site`` is the one ARLOPTI_FAULT names (counting every pass)."""
    spec = os.environ.get(ENV)
    if not spec:
        return False
    if site not in SITES:  # a typo in the code would silently never fire
        raise ValueError(f"faults: unknown site {site!r}")
    target, _, rest = spec.partition(":")
    count, _, process = rest.partition("@")
    if target not in SITES or not count.isdigit() or (process and not process.isdigit()):
        raise ValueError(f"{ENV}={spec!r}: expected SITE:N or SITE:N@PROCESS with SITE one of {', '.join(SITES)}")
    if target != site:
        return False
    if process:
        import jax

        if jax.process_index() != int(process):
            return False
    _passes[site] = _passes.get(site, 0) + 1
    return _passes[site] == int(count)


def die() -> None:
    """SIGKILL to this process; with ARLOPTI_FAULT_SIGNAL, that signal instead (and the caller carries on)."""
    name = os.environ.get(SIGNAL_ENV)
    os.kill(os.getpid(), getattr(signal, name) if name else signal.SIGKILL)


def point(site: str) -> None:
    """Die here if ARLOPTI_FAULT names this pass of ``site``."""
    if _armed(site):
        die()


def write(file: IO[str], text: str, site: str) -> None:
    """``file.write(text)``; or, on the armed pass of ``site``, half of it, flushed, then die."""
    if _armed(site):
        if os.environ.get(SIGNAL_ENV):  # a signal, not a crash: the write whole, then the signal
            file.write(text)
            die()
            return
        file.write(text[: len(text) // 2])
        file.flush()
        die()
    file.write(text)
