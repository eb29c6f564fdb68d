"""Tasks: K&K puzzles and reward, math reward, reward routing, prompt datasets.

    from arlopti_jax.tasks import compute_score, load_reward_fn, score_batch, score_rewards
    from arlopti_jax.tasks.data import PromptDataset, BatchIterator

Modules: kk_puzzles (logic, solver, generator), kk (rows, parquet, CLI), kk_reward,
math_reward, registry (routing, batched scoring), workers (sandbox processes), data,
hub_data (Hub datasets), arith and calc (arithmetic problems, CLIs); envs (multi-turn
environments: the API, tool-call parsing, the runner, the built-ins) and tools (the calculator).
"""

from arlopti_jax.tasks.registry import Reward, answer_for, compute_score, load_reward_fn, score_batch, score_rewards

__all__ = ["Reward", "answer_for", "compute_score", "load_reward_fn", "score_batch", "score_rewards"]
