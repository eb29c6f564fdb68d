"""Reward functions for tests, importable by subprocesses (``reward.fn=reward_fixtures:NAME``
with this folder on PYTHONPATH)."""


def length_reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """Varies with the response, so advantages are not all zero: the tiny test start point's
    K&K answers are all wrong, which would make every reward -3."""
    return float(len(solution_str) % 7) - 3.0
