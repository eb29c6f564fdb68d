"""Multislice meshes: each TPU slice laid out as mesh.data x fsdp x tensor and repeated over the
slices along data (mesh.dcn_data of them), then fsdp. CPU devices carry no ``slice_index``, so these
use stand-in devices that do, against a construction by index; tests/aot/test_aot.py checks
libtpu's compile-only two-slice topology."""

import dataclasses

import jax
import numpy as np
import pytest

from arlopti_jax.runtime import distributed as dist
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.config import ConfigError, validate
from run_fixtures import make_config


@dataclasses.dataclass(frozen=True)
class SliceDevice:
    """What a mesh reads of a TPU device of a multislice job."""

    id: int
    slice_index: int
    process_index: int = 0
    platform: str = "cpu"  # no topology handler: a slice's devices are laid out in the order given
    device_kind: str = "stand-in"


def shuffled_slices(slices: int, per_slice: int, seed: int) -> list[SliceDevice]:
    """``slices`` x ``per_slice`` devices, ids and list order shuffled (slices interleaved)."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(slices * per_slice)
    devices = [SliceDevice(int(ids[i]), i // per_slice) for i in range(slices * per_slice)]
    return [devices[i] for i in rng.permutation(len(devices))]


CASES = [  # (slices, devices per slice, mesh fields, whole mesh's data, fsdp, tensor)
    (2, 8, {"fsdp": 4, "tensor": 2}, (2, 4, 2)),
    (4, 4, {"data": 2, "fsdp": 2, "dcn_data": 2}, (4, 4, 1)),
    (2, 4, {"fsdp": -1, "dcn_data": 1}, (1, 8, 1)),
    (3, 2, {"data": -1, "dcn_data": 3}, (6, 1, 1)),
]


@pytest.mark.parametrize("slices,per_slice,shape,want", CASES, ids=lambda c: str(c).replace(" ", ""))
def test_each_slice_is_one_block_of_the_data_then_fsdp_axis(slices, per_slice, shape, want):
    devices = shuffled_slices(slices, per_slice, seed=slices * 10 + per_slice)
    mesh = shd.make_mesh(shape, devices=devices)
    assert mesh.axis_names == shd.MESH_AXES and mesh.devices.shape == want
    assert shd.mesh_sizes(shape, len(devices), slices) == dict(zip(shd.MESH_AXES, want))
    # by index: the slices in slice_index order along data (dcn_data of them) then fsdp; inside a
    # slice, its devices in the order given, laid out as one slice's data x fsdp x tensor
    members = {s: [d for d in devices if d.slice_index == s] for s in range(slices)}
    dcn_data = slices if shape.get("dcn_data", -1) == -1 else shape["dcn_data"]
    dcn_fsdp = slices // dcn_data
    data, fsdp, tensor = want[0] // dcn_data, want[1] // dcn_fsdp, want[2]
    for (d, f, t), device in np.ndenumerate(mesh.devices):
        s = (d // data) * dcn_fsdp + f // fsdp
        assert device == members[s][((d % data) * fsdp + f % fsdp) * tensor + t], (d, f, t)
    if dcn_fsdp == 1:  # the batch crosses the slices: slice s holds rows block s, whole
        rows = shd.batch_divisor(mesh)
        held = {s: set() for s in range(slices)}
        for device, index in shd.batch_sharding(mesh, 1).devices_indices_map((rows,)).items():
            held[device.slice_index].update(range(*index[0].indices(rows)))
        per = rows // slices
        assert held == {s: set(range(s * per, (s + 1) * per)) for s in range(slices)}


def test_one_slice_builds_the_mesh_it_built_before():
    """Without slices dcn_data is 1 (or -1): the same mesh as a shape without it, JAX's own."""
    for shape in ({"fsdp": 8}, {"data": 2, "fsdp": -1, "tensor": 2}):
        want = jax.make_mesh(tuple(shd.resolve_mesh_shape(shape, 8).values()), shd.MESH_AXES,
                             devices=jax.devices()).devices
        for dcn in ({}, {"dcn_data": 1}, {"dcn_data": -1}):
            got = shd.make_mesh({**shape, **dcn}).devices
            assert got.shape == want.shape and list(got.flat) == list(want.flat)
    assert shd.slice_count(jax.devices()) == 1


@pytest.mark.parametrize("devices,shape,message", [
    (shuffled_slices(2, 8, 0), {"fsdp": -1, "dcn_data": 3}, "dcn_data=3 must divide the job's slice count, 2; "),
    (shuffled_slices(1, 8, 0), {"fsdp": -1, "dcn_data": 2}, "slice count, 1 (its devices are one slice)"),
    (shuffled_slices(2, 8, 0), {"fsdp": 16}, "needs 16 devices, have 8 (mesh.data, fsdp and tensor lay out one of "
                                             "the 2 slices)"),
    ([SliceDevice(i, int(i >= 3)) for i in range(8)], {"fsdp": -1}, "different device counts {0: 3, 1: 5}"),
])
def test_a_layout_the_slices_cannot_hold_is_one_line(devices, shape, message):
    with pytest.raises(ValueError) as err:
        shd.make_mesh(shape, devices=devices)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_config_is_checked_against_the_slices():
    """train and aot validate the config for the job's slices: the batch is split over the whole
    data axis, dcn_data must divide the slice count, and is -1 or a count."""
    c = make_config({"mesh.fsdp": 16, "train.micro_batch": 16, "train.mini_batch": 32})
    validate(c, 16, "tpu")  # one slice: as before
    with pytest.raises(ConfigError, match=r"train.micro_batch=16 is invalid: must be divisible by the mesh's "
                                          r"data x fsdp = 32"):
        validate(c, 32, "tpu", num_slices=2)  # data=2 over the slices
    c.train.micro_batch = 32
    validate(c, 32, "tpu", num_slices=2)
    c.mesh.dcn_data = 3
    with pytest.raises(ConfigError, match=r"config.mesh=.* is invalid: dcn_data=3 must divide the job's slice "
                                          r"count, 2"):
        validate(c, 32, "tpu", num_slices=2)
    c.mesh.dcn_data = 0
    with pytest.raises(ConfigError, match=r"mesh.dcn_data=0 is invalid: must be -1 \(every slice\)"):
        validate(c)


def test_processes_get_whole_rows_without_leaving_their_slice():
    """Two slices of two processes, whose devices alternate in a slice: the mesh is reordered
    process-major inside each slice's positions, so every process holds one block of rows and
    every slice keeps its block of the data axis."""
    devices = [SliceDevice(i, i // 4, process_index=(i // 4) * 2 + i % 2) for i in range(8)]
    mesh = shd.make_mesh({"fsdp": 4}, devices=devices)
    assert not dist._rows_contiguous(mesh)
    fixed = dist.process_contiguous(mesh)
    ids = np.vectorize(lambda d: d.id)(fixed.devices)
    assert ids.reshape(2, 4).tolist() == [[0, 2, 1, 3], [4, 6, 5, 7]]
    assert dist._rows_contiguous(fixed)


def test_gpu_hosts_are_not_slices_and_keep_the_whole_job_layout():
    """A GPU's slice_index names its host (NVLink domain): two 4-GPU hosts are one job laid out by
    the mesh fields whole, in JAX's GPU order (by id), which jax.make_mesh itself refuses."""
    gpus = [SliceDevice(i, i // 4, process_index=i // 4, platform="gpu") for i in (5, 0, 7, 2, 1, 6, 3, 4)]
    assert shd.slice_count(gpus) == 1
    mesh = shd.make_mesh({"data": 2, "fsdp": -1}, devices=gpus)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert [d.id for d in mesh.devices.flat] == list(range(8))
    assert dist.process_contiguous(mesh) is mesh  # host h holds rows block h
    with pytest.raises(ValueError, match="does not support multi-slice"):
        jax.make_mesh((2, 4, 1), shd.MESH_AXES, devices=gpus)
