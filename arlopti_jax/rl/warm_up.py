"""The run's warm-up: every program its rollouts and evaluations can reach, compiled before step 1.

The sampler compiles a program per shape it meets, and the length-aware schedule meets them as the
responses end: a row bucket or a phase first reached at step 40 would compile there, inside that
step's rollout time, and an evaluation first run at step 20 (``train.eval_before=False``, or a
resumed run) would compile its own programs there. ``compile_rollouts`` compiles the whole set
instead, before the first step: the training rollout's ``Sampler.schedule`` (every row bucket and
phase the schedule can visit; ``algo.filter_groups``'s further rounds draw batches of the same
shapes) and the evaluation's (``Evaluator.schedules``: greedy, and sampled at
``train.eval_temperature``, which share the training rollout's programs wherever their shapes
agree), each program once, in parallel threads, from the persistent compilation cache where it is
there (``compiles.compile_all``). The packed log-prob and update passes compile whole with the
first batch (``algos.PackedPrograms``), so after the first step nothing compiles: ``train`` logs any
program compiled later as a warning, and its summary counts them.
"""

from __future__ import annotations

import logging
import time

from arlopti_jax.rl.episode_host import rollout_programs
from arlopti_jax.runtime import compiles
from arlopti_jax.runtime import sharding as shd

log = logging.getLogger("arlopti_jax.train")


def compile_rollouts(run, evaluator, params, key, rollout_params=None, rollout_key=None,
                     with_rollouts: bool = True) -> int:
    """Compile the sampler's programs of ``run``'s rollouts and of ``evaluator``'s evaluations for
    ``params`` (the trainer's arrays: their shapes and shardings) and ``key`` (a key made as the
    steps' and the evaluations' are, ``fold_in`` of the run's key: its sharding is theirs). With the
    sampler's own mesh (``run.rollout_sampler``), its rollouts' for ``rollout_params`` and
    ``rollout_key``, the sampler's copies there. With sampler hosts of their own (rl/hosts.py) a
    trainer host compiles no rollouts (``with_rollouts=False``) and a sampler host no evaluations
    (``evaluator`` None). Returns how many programs were compiled or loaded from the persistent cache
    (none when this process has compiled them already)."""
    c = run.config
    params = compiles.abstract(params) if params is not None else None
    sampling = run.sampling()
    rollouts = run.rollout_sampler
    own = rollouts is not run.sampler
    rollout = [] if not with_rollouts else rollout_programs(c, rollouts).schedule(  # with env.name, the episodes'
        compiles.abstract(rollout_params) if own else params, c.train.batch_prompts, sampling.prompt_width,
        c.rollout.n, sampling, key=compiles.abstract(rollout_key if own else key))
    schedules = ([] if own else [rollout]) + (evaluator.schedules(params, key) if evaluator is not None else [])
    compile_log = compiles.watch()
    mark, started = compile_log.programs, time.perf_counter()
    if own:
        compiles.compile_all(rollout, context=lambda: shd.activate(rollouts.mesh, rollouts.rules))
    compiles.compile_all(*schedules, context=lambda: shd.activate(run.sampler.mesh, run.sampler.rules))
    count = compile_log.programs - mark
    log.info("warm-up: %d sampler programs compiled or loaded (%d listed by the rollouts and evaluations%s) in "
             "%.1f s", count, len(rollout) * own + sum(map(len, schedules)),
             ", the rollouts' on the sampler's own mesh" if own else "", time.perf_counter() - started)
    return count
