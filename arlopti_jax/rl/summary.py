"""The end-of-run summary: the training reward's trend, the evaluation before and after against
each test set's chance level, what the run compiled, printed by process 0 and logged as
``summary/*`` scalars."""

from __future__ import annotations

import time

import jax
import numpy as np

from arlopti_jax.rl.evaluation import compare_table, format_table
from arlopti_jax.tasks.kk import guess_accuracy


def chance_levels(test_sets: dict) -> dict[str, float | None]:
    """Per test set, the accuracy of guessing (mean over its rows; None where a row's data
    source does not define one)."""
    out = {}
    for name, data in test_sets.items():
        levels = [guess_accuracy(r["data_source"]) for r in data.rows]
        out[name] = float(np.mean(levels)) if levels and None not in levels else None
    return out


def reward_trend(rewards: list[float]) -> tuple[float, float, float] | None:
    """(first-quarter mean, last-quarter mean, their difference in standard errors of the
    difference) of the per-step training reward; None with fewer than 8 steps."""
    k = len(rewards) // 4
    if k < 2:
        return None
    first, last = np.asarray(rewards[:k]), np.asarray(rewards[-k:])
    se = np.sqrt(first.var(ddof=1) / k + last.var(ddof=1) / k)
    return float(first.mean()), float(last.mean()), float((last.mean() - first.mean()) / se) if se > 0 else 0.0


def summarize(config, history, started, export_dir, preempted, chance: dict | None = None) -> dict:
    minutes = (time.time() - started) / 60
    lines = ["", "=" * 72, f"arlopti_jax: {'stopped (preempted)' if preempted else 'finished'} in {minutes:.1f} min",
             f"run folder: {config.run_dir}   tensorboard --logdir {config.run_dir}"]
    rewards = history["reward"]
    trend = reward_trend(rewards)
    if trend:
        lines.append(f"train reward: first quarter {trend[0]:.3f} -> last quarter {trend[1]:.3f} "
                     f"({trend[2]:+.1f} standard errors, {len(rewards)} steps)")
    elif rewards:
        lines.append(f"train reward: mean {np.mean(rewards):.3f} over {len(rewards)} steps")
    before, after = history["before"], history["after"]
    if before and after:
        lines.append("evaluation before -> after:")
        lines.append(compare_table(before, after, history["eval_settings"], chance))
    elif after:
        lines.append(format_table(after, history["eval_settings"]))
    if "compile" in history:
        programs, seconds, late = history["compile"]
        lines.append(f"compiled: {programs} programs in {seconds:.1f} s, {late} of them after the first step"
                     + (" (each logged as a warning)" if late else ""))
    if export_dir:
        lines.append(f"exported policy: {export_dir}")
    lines.append("=" * 72)
    if jax.process_index() == 0:
        print("\n".join(lines))
    scalars = {"summary/minutes": minutes, "summary/steps": float(len(rewards)), "summary/preempted": float(preempted),
               **{f"summary/{k}": v for k, v in (after or {}).items()}}
    if trend:
        scalars.update(zip(("summary/reward_first_quarter", "summary/reward_last_quarter", "summary/reward_trend_se"),
                           trend))
    if "compile" in history:
        scalars.update(zip(("summary/compiled_programs", "summary/compile_seconds", "summary/late_compiles"),
                           map(float, history["compile"])))
    return {"minutes": minutes, "before": before, "after": after, "rewards": rewards, "preempted": preempted,
            "reward_trend": trend, "chance": chance, "compile": history.get("compile"),
            "text": "\n".join(lines).strip("\n="), "scalars": scalars}
