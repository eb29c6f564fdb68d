"""Reward functions for tests, importable by subprocesses (``reward.fn=reward_fixtures:NAME``
with this folder on PYTHONPATH)."""


def length_reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """Varies with the response, so advantages are not all zero: the tiny test start point's
    K&K answers are all wrong, which would make every reward -3."""
    return float(len(solution_str) % 7) - 3.0


def half_constant_reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """``length_reward`` for odd-index prompts; 0 for every response to an even-index prompt, so
    their groups have zero advantage (dynamic sampling drops them)."""
    return 0.0 if extra_info["index"] % 2 == 0 else length_reward(data_source, solution_str, ground_truth)

