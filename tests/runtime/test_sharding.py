"""Mesh layouts on 8 fake CPU devices give the unsharded logits and really split the parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from arlopti_jax.runtime import sharding as shd
from arlopti_jax.models import load_pretrained, logits, token_logprobs
from hf_fixtures import padded_batch, write_hf_model

LAYOUTS = [{"fsdp": 8}, {"fsdp": 4, "tensor": 2}, {"data": 2, "fsdp": 4}, {"data": 2, "fsdp": 2, "tensor": 2}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("shard") / "ckpt", kind="qwen2", tied=False)


@pytest.fixture(scope="module")
def reference(folder):
    ids, mask = padded_batch(batch=8, length=16)
    mesh1 = shd.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    cfg, params = load_pretrained(folder, mesh=mesh1)
    return ids, mask, np.asarray(logits(cfg, params, jnp.asarray(ids), jnp.asarray(mask)))


def test_mesh_and_batch_sharding_place_each_row_block_on_its_devices():
    """make_mesh uses every device once, with -1 filled in; batch_sharding gives the device at
    mesh position (d, f, t) row block d x fsdp + f of the batch, the same block on every
    tensor position."""
    mesh = shd.make_mesh({"data": 2, "fsdp": -1, "tensor": 2})
    assert mesh.axis_names == shd.MESH_AXES and mesh.devices.shape == (2, 2, 2)
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())
    x = np.arange(8 * 3).reshape(8, 3)
    on_device = {s.device: np.asarray(s.data) for s in jax.device_put(x, shd.batch_sharding(mesh)).addressable_shards}
    for (d, f, _), device in np.ndenumerate(mesh.devices):
        block = d * mesh.shape["fsdp"] + f
        np.testing.assert_array_equal(on_device[device], x[2 * block: 2 * block + 2])
    # a given device list is laid out in its order
    devices = jax.devices()[::-1][:4]
    assert list(shd.make_mesh({"fsdp": 2, "tensor": -1}, devices=devices).devices.flat) == devices


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "x".join(f"{k}{v}" for k, v in l.items()))
def test_layout_matches_unsharded_and_splits_params(folder, reference, layout):
    ids, mask, want = reference
    mesh = shd.make_mesh(layout)
    cfg, params = load_pretrained(folder, mesh=mesh)
    fsdp, tensor = mesh.shape["fsdp"], mesh.shape["tensor"]

    # Parameters are split as the rule table says.
    q = params["layers"]["attn"]["q_kernel"]  # [L, D, N, H] = (layers, embed, heads, head_dim)
    assert q.sharding.spec == P(None, "fsdp", "tensor", None)
    shard = q.addressable_shards[0].data.shape
    assert shard == (q.shape[0], q.shape[1] // fsdp, q.shape[2] // tensor, q.shape[3])
    up = params["layers"]["mlp"]["up_kernel"]
    assert up.addressable_shards[0].data.size == up.size // (fsdp * tensor)
    # vocab 97 is indivisible: the embedding falls back to replicating that dim (tensor), keeping fsdp
    emb = params["embedding"]
    assert emb.sharding.spec == P(None if tensor > 1 else "tensor", "fsdp")
    assert emb.addressable_shards[0].data.size == emb.size // fsdp

    batch = shd.batch_sharding(mesh)
    ids_s, mask_s = jax.device_put(jnp.asarray(ids), batch), jax.device_put(jnp.asarray(mask), batch)
    with shd.activate(mesh):
        got = jax.jit(logits, static_argnums=0)(cfg, params, ids_s, mask_s)
        lp, _ = jax.jit(token_logprobs, static_argnums=0)(cfg, params, ids_s, mask_s)
    valid = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(got)[valid], want[valid], atol=1e-5)
    # the per-token outputs stay split over the batch axes
    assert lp.addressable_shards[0].data.shape[0] == ids.shape[0] // shd.batch_divisor(mesh)


def test_mesh_shape_errors():
    with pytest.raises(ValueError, match="unknown axes \\['model'\\]"):
        shd.resolve_mesh_shape({"model": 2}, 8)
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        shd.resolve_mesh_shape({"data": -1, "fsdp": -1}, 8)
    with pytest.raises(ValueError, match="not divisible by 3"):
        shd.resolve_mesh_shape({"data": 3, "fsdp": -1}, 8)
    with pytest.raises(ValueError, match="needs 4 devices, have 8"):
        shd.resolve_mesh_shape({"data": 2, "fsdp": 2}, 8)
    assert shd.resolve_mesh_shape({"tensor": 2, "fsdp": -1}, 8) == {"data": 1, "fsdp": 4, "tensor": 2}


def test_put_places_a_host_array_whole_in_its_sharding():
    """``shd.put``, the one host -> global array placement (sampler and train step): with one
    process the array is whole, with or without ``global_rows``."""
    mesh = shd.make_mesh({"fsdp": 8})
    x = np.arange(16 * 3, dtype=np.int32).reshape(16, 3)
    for sharding in (shd.batch_sharding(mesh), shd.replicated(mesh)):
        for rows in (None, 16, 0):
            y = shd.put(x, sharding, rows)
            assert y.sharding == sharding and np.array_equal(np.asarray(y), x)
    assert len(shd.put(x, shd.batch_sharding(mesh)).addressable_shards) == 8
