"""The programs that make the sampler's copy of a policy version (``rl/pipeline.py``): one definition
each, for the run and for ``aot``, which compiles them for a target before any run.

Each takes a tree of arrays (or of abstract arrays, ``jax.ShapeDtypeStruct``s with their shardings) and
gives the jitted program for trees shaped and sharded like it. The checksums of a copy are
``pipeline.fingerprint_program``'s; the gather before a transfer with several processes is
``sharding.whole_program``'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def copy_program(tree):
    """The colocated snapshot: the trained parameters copied, in their dtype and sharding, by one program
    (an eager copy compiles one per leaf shape), before the update donates them."""
    def sampler_copy(t):  # the program's name in the compile log
        return jax.tree.map(jnp.copy, t)

    return jax.jit(sampler_copy, out_shardings=jax.tree.map(lambda x: x.sharding, tree))


def cast_program(tree, dtype):
    """The weight sync's first program: every floating leaf cast to the sampler's compute ``dtype``, on the
    trainer's devices (``pipeline.sync_dtype``), before the transfer to the sampler's mesh."""
    def sampler_cast(t):  # the program's name in the compile log
        return jax.tree.map(lambda w: w.astype(dtype) if jnp.issubdtype(w.dtype, jnp.floating) else w, t)

    return jax.jit(sampler_cast, out_shardings=jax.tree.map(lambda x: x.sharding, tree))
