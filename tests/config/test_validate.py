"""Fields that another field overrides are not held to their own rules."""

import pytest

from arlopti_jax.config import ConfigError, base_config, validate


def test_micro_batch_is_checked_only_where_it_sizes_the_micro_batch():
    c = base_config()
    c.train.batch_prompts, c.rollout.n, c.train.mini_batch = 8, 4, 16
    c.train.micro_batch = 3  # divides neither the mini-batch nor the mesh's 8 devices
    with pytest.raises(ConfigError, match="config.train.micro_batch=3 is invalid: must divide train.mini_batch"):
        validate(c, num_devices=8)
    c.train.micro_batch = 4  # divides the mini-batch, not data x fsdp = 8
    with pytest.raises(ConfigError, match="must be divisible by the mesh's data x fsdp = 8"):
        validate(c, num_devices=8)
    c.train.max_tokens_per_micro_batch = 8192  # the token budget sizes it now: micro_batch is unused
    for rows in (3, 4):
        c.train.micro_batch = rows
        validate(c, num_devices=8)
