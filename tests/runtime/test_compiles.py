"""runtime.compiles: every program counted from JAX's own events, and after the warm-up a warning
that names the program and the argument shapes that were new."""

import concurrent.futures
import logging

import jax
import jax.numpy as jnp

from arlopti_jax.runtime import compiles


def test_programs_are_counted_and_a_late_one_is_named_with_its_new_shapes(caplog):
    log = compiles.watch()
    assert compiles.watch() is log  # one per process
    log.warm(False)  # as after any run this process made before

    def scale_rows(x, y):
        return x * 2 + y

    f = jax.jit(scale_rows)
    x, y, wide = jnp.ones(3), jnp.ones(()), jnp.ones((4, 2))  # their own small programs compile here
    mark = log.programs
    f(x, y)
    f(x + 1, y)  # the same shapes: no new program of f
    assert [r.name for r in log.since(mark)].count("jit(scale_rows)") == 1
    record = next(r for r in log.since(mark) if r.name == "jit(scale_rows)")
    assert "float32[3]" in record.shapes and record.seconds > 0
    caplog.clear()
    log.warm()
    try:
        with caplog.at_level(logging.WARNING, logger="arlopti_jax.runtime.compiles"):
            f(wide, y)
        lines = [r.getMessage() for r in caplog.records if "scale_rows" in r.getMessage()]
        assert len(lines) == 1 and "argument 0: float32[3] -> float32[4,2]" in lines[0], lines
        assert "argument 1" not in lines[0]  # unchanged arguments are not listed
    finally:
        log.warm(False)  # other tests of this process compile freely


def test_programs_compiled_on_threads_keep_their_own_shapes():
    log = compiles.watch()

    def pad_rows(x):
        return jnp.concatenate([x, x])

    jitted = jax.jit(pad_rows)
    lowered = []
    for n in (5, 6, 7, 8):
        low = jitted.lower(jax.ShapeDtypeStruct((n,), jnp.float32))
        lowered.append((low, log.lowered("jit(pad_rows)")))
    mark = log.programs

    def compile_one(item):
        low, shapes = item
        with log.compiling(shapes):
            return low.compile()

    # compiled in the reverse of their lowering order, on another thread: each record keeps its own
    # lowering's shapes (taking them in lowering order would name 8 as 5)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        list(pool.map(compile_one, lowered[::-1]))
    got = [compiles._split(r.shapes)[0] for r in log.since(mark) if r.name == "jit(pad_rows)"]
    assert got == [f"float32[{n}]" for n in (8, 7, 6, 5)]
