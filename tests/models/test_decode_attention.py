"""The fused decode kernel (``models/decode_attention.py``), run here in Pallas' interpret mode,
against the plain-jnp reference and against the decoder's own XLA attention; and where the decoder
uses it."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlopti_jax.models import ModelConfig, decode, init_params
from arlopti_jax.models import decode_attention as da
from arlopti_jax.models.rope import apply_rope
from arlopti_jax.runtime import sharding as shd


def _inputs(rng, rows, heads, kv, slots, h, dtype=jnp.float32):
    r = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    g = heads // kv
    return dict(qkv=r(rows, kv, g + 2, h), bias=r(kv, g + 2, h), positions=jnp.asarray(rng.integers(0, 900, rows)),
                inv_freq=1.0 / (1e4 ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)), k_cache=r(rows, kv, slots, h),
                v_cache=r(rows, kv, slots, h))


# (rows, heads, kv heads, slots, head_dim, block_k, splits): one split and several, a block that does not
# divide the slots, G from 1 to 14 (a kv head's query heads, key and value filling the 16-row block), the 1.5B
# model's grouping (6 per kv head)
SHAPES = [(3, 12, 2, 200, 32, 64, 0), (2, 8, 8, 96, 16, 16, 3), (4, 9, 3, 130, 32, 32, 1), (2, 28, 2, 64, 16, 16, 5)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_kernel_equals_the_reference(shape):
    """Outputs within float32 rounding of ``reference`` for random starts (a row whose run is its own
    token alone, a row from slot 0) and this step's slot inside the cache; the new key and value land
    in slot ``pos`` and no other slot changes. Slots after ``pos`` hold huge values: read, they would
    swamp the output."""
    rows, heads, kv, slots, h, block_k, splits = shape
    rng = np.random.default_rng(sum(shape))
    x = _inputs(rng, rows, heads, kv, slots, h)
    pos = slots - 11
    x["k_cache"] = x["k_cache"].at[:, :, pos + 1:].set(1e30)
    x["v_cache"] = x["v_cache"].at[:, :, pos + 1:].set(1e30)
    start = np.asarray(rng.integers(0, pos, rows), np.int32)
    start[0], start[-1] = pos, 0  # only its own token; every slot up to pos
    args = (x["qkv"], x["bias"], x["positions"], x["inv_freq"], x["k_cache"], x["v_cache"], jnp.asarray(start), pos)
    scale = 1.0 / math.sqrt(h)
    want = da.reference(*args, scale=scale)
    before = np.asarray(x["k_cache"]), np.asarray(x["v_cache"])
    got = da.decode_attention(*args, scale=scale, block_k=block_k, splits=splits, interpret=True)  # caches donated
    np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=2e-5)
    for new, old, ref in zip(got[1:], before, want[1:]):
        np.testing.assert_allclose(new[:, :, pos], ref[:, :, pos], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.delete(np.asarray(new), pos, axis=2), np.delete(np.asarray(old), pos, axis=2))


def test_the_kernel_equals_the_decoders_xla_attention_in_bfloat16():
    """In bfloat16 (the GPU's decode dtype) the kernel gives what the decoder's XLA path gives (bias,
    ``apply_rope``, ``cached_attention`` written then read over the row's live run), to bfloat16
    rounding: its probabilities are unnormalised when cast, and its splits are combined in float32."""
    rows, heads, kv, slots, h = 4, 12, 2, 160, 32
    rng = np.random.default_rng(7)
    x = _inputs(rng, rows, heads, kv, slots, h, jnp.bfloat16)
    pos, g = 150, heads // kv
    start = jnp.asarray(rng.integers(0, 100, rows), jnp.int32)
    scale = 1.0 / math.sqrt(h)
    qkv = x["qkv"] + x["bias"]
    q = apply_rope(qkv[:, None, :, :g].reshape(rows, 1, heads, h), x["positions"][:, None], x["inv_freq"])
    k = apply_rope(qkv[:, None, :, g], x["positions"][:, None], x["inv_freq"])
    live = (jnp.arange(slots)[None, :] >= start[:, None]) & (jnp.arange(slots)[None, :] <= pos)
    out, cache = decode.cached_attention(q, k, qkv[:, None, :, g + 1], live[:, None, None, :], scale,
                                          {"k": (x["k_cache"],), "v": (x["v_cache"],)}, 0, pos)
    got = da.decode_attention(x["qkv"], x["bias"], x["positions"], x["inv_freq"], x["k_cache"], x["v_cache"], start,
                              pos, scale=scale, splits=3, block_k=32, interpret=True)
    f32 = lambda a: np.asarray(a, np.float32)
    err = np.linalg.norm(f32(got[0]) - f32(out[:, 0])) / np.linalg.norm(f32(out[:, 0]))
    assert err < 1e-2, err
    np.testing.assert_allclose(f32(got[1][:, :, pos]), f32(cache["k"][0][:, :, pos]), atol=0.05)
    np.testing.assert_array_equal(f32(got[2][:, :, pos]), f32(cache["v"][0][:, :, pos]))


def test_which_heads_the_compiled_kernel_takes():
    assert da.supported(6, 128) is None and da.supported(1, 32) is None and da.supported(14, 64) is None
    assert "15 query heads per kv head (the kernel takes 1 to 14)" in da.supported(15, 128)  # k and v: 17 rows
    for h in (16, 80, 96, 127):  # half a head must be a power of two >= 16
        assert f"head_dim {h}" in da.supported(4, h)
    x = _inputs(np.random.default_rng(0), 1, 4, 1, 32, 80)
    with pytest.raises(ValueError, match="head_dim 80 .*model.decode_attention=xla"):
        da.decode_attention(x["qkv"], x["bias"], x["positions"], x["inv_freq"], x["k_cache"], x["v_cache"],
                            jnp.zeros(1, jnp.int32), 31, scale=0.1)


def test_auto_picks_the_kernel_on_a_gpu_for_the_heads_it_takes(monkeypatch):
    qwen = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=12, num_kv_heads=2,
                       head_dim=128)
    assert not decode.decode_kernel(qwen)  # the CPU: XLA's attention
    assert decode.decode_kernel(qwen.replace(decode_attention="pallas"))
    monkeypatch.setattr(shd, "platform", lambda: "gpu")
    assert decode.decode_kernel(qwen)
    assert not decode.decode_kernel(qwen.replace(decode_attention="xla"))
    assert not decode.decode_kernel(qwen.replace(head_dim=80))  # the kernel does not take it: XLA's
    with pytest.raises(ValueError, match="decode_attention='flash'"):
        qwen.replace(decode_attention="flash")


def test_the_fused_qkv_layout_gives_the_same_model():
    """``fuse_qkv``'s weights (the sampler's on a GPU) give the decoder's outputs, on a prefill of
    several tokens and on a decode step over a buffer per layer (both XLA's attention)."""
    cfg = ModelConfig(vocab_size=50, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=6, num_kv_heads=2,
                      head_dim=16)
    tokens = jnp.asarray([[3, 4, 5, 6], [7, 8, 9, 10]])
    positions = jnp.broadcast_to(jnp.arange(4), (2, 4))
    params = init_params(cfg, jax.random.key(0), shd.make_mesh({"fsdp": 1}, devices=jax.devices()[:1]))
    params = jax.tree.map(lambda w: w + 0.05 * jax.random.normal(jax.random.key(1), w.shape), params)  # biases too
    layers = lambda p, fuse: tuple({**layer, "attn": decode.fuse_qkv(cfg, layer["attn"]) if fuse else layer["attn"]}
                                   for layer in (jax.tree.map(lambda w: w[i], p["layers"]) for i in range(2)))

    @functools.partial(jax.jit, static_argnums=1)  # one program each way, not hundreds of eager ones
    def run(params, fuse):
        from arlopti_jax.rollout import programs

        p = {**params, "layers": layers(params, fuse)}
        cache = {name: tuple(jnp.zeros((2, 2, 6, 16)) for _ in range(2)) for name in "kv"}
        hidden, cache = programs._forward(cfg, p, tokens, positions, jnp.ones((2, 6), jnp.int32), cache, 0, True)
        step, _ = programs._forward(cfg, p, tokens[:, :1], positions[:, :1] + 4, jnp.ones((2, 6), jnp.int32), cache,
                                    4, True)
        return hidden, step

    for a, b in zip(run(params, False), run(params, True)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
