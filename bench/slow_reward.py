"""A reward with host time to hide: ``reward.fn=slow_reward:slow_score`` (this folder on PYTHONPATH)
waits 12 ms per response (a sleep: no CPU), as a verifier behind a network call would, then scores
as the built-in router does. ``bench/overlap.py`` uses it for the CPU overlap target."""

import time

from arlopti_jax.tasks import compute_score

DELAY_S = 0.012


def slow_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(DELAY_S)
    return compute_score(data_source, solution_str, ground_truth, extra_info)
