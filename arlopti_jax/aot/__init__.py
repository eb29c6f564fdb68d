"""Compile-only checks for accelerators this machine does not have: ``python -m arlopti_jax.aot``.

``targets`` names the TPU slices and H100s, ``check`` compiles one RL step's programs for one
(``compiler`` compiles each and reads the compiler's figures; ``copies`` lists the copies of the
policy a step makes for the sampler, and what they keep resident on each mesh), ``hlo`` reads
optimized HLO and XLA:GPU thunk sequences, ``shapes`` gives a model's shape without its weights.
"""
