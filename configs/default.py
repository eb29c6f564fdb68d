"""The embedded default, numerics per backend (the same config `python -m arlopti_jax.train` uses with no flags)."""

from arlopti_jax.embedded.default import get_config  # noqa: F401
