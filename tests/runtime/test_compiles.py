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


def test_compile_all_compiles_each_listed_program_once_and_the_calls_after_compile_nothing():
    """Two schedules, one program listed by both, one reading another's outputs: each program
    compiles once, from the outputs' shardings its input was compiled to, and the same calls on
    arrays (a committed one, an uncommitted host value) then run without compiling."""
    import numpy as np
    import pytest

    from arlopti_jax.runtime import sharding as shd

    log = compiles.watch()
    rows = shd.batch_sharding(shd.make_mesh({"fsdp": 8}), 2)

    def widen_rows(x, scale):
        return jnp.concatenate([x, x * scale], axis=1)

    widen = jax.jit(widen_rows)
    x = jax.device_put(np.arange(16, dtype=np.float32).reshape(8, 2), rows)
    scale = np.float32(3)  # a host value: no sharding of its own, as the sampler's settings
    spec_x, spec_scale = compiles.abstract((x, scale))
    assert spec_x.sharding == rows and spec_scale.sharding is None
    first = compiles.Program("first", widen, (spec_x, spec_scale), {})
    again = compiles.Program("again", widen, (compiles.Output("first"), spec_scale), {})
    mark = log.programs
    a, b = compiles.compile_all([first, again], [compiles.Program("same", widen, (spec_x, spec_scale), {})],
                                threads=2)
    assert a["again"].shape == (8, 8) and b["same"].shape == a["first"].shape == (8, 4)
    shapes = sorted(compiles._split(r.shapes)[0] for r in log.since(mark) if r.name == "jit(widen_rows)")
    assert shapes == ["float32[8,2]", "float32[8,4]"]  # "same" is "first": compiled once
    mark = log.programs
    out = widen(widen(x, scale), scale)
    assert not log.since(mark)
    np.testing.assert_array_equal(np.asarray(out)[:, 6:], np.asarray(x) * 9)
    with pytest.raises(ValueError, match="'missing'"):
        compiles.compile_all([compiles.Program("reads", widen, (compiles.Output("missing"), spec_scale), {})])
