"""arlopti_jax: RL from verifiable rewards in JAX, with Advantage Reweighting and Lopti."""

__version__ = "0.1.0"
