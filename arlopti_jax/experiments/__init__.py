"""The reproduction sweep, the step-matched protocol and their reports (`python -m arlopti_jax.reproduce`)."""
