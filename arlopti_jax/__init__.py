"""arlopti_jax: RL from verifiable rewards in JAX, with Advantage Reweighting and Lopti.

Importing the package, or any module of it, sets nothing: no environment variable, no ``jax.config``
value, no file descriptor. The commands (``python -m arlopti_jax.X``) choose their own process's
settings and say each in their start-up line (``runtime/process.py``).
"""

__version__ = "0.1.0"
