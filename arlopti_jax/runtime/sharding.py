"""Device mesh, logical axis rules, and the shardings of parameters and batches.

The mesh has three axes:
  data    pure data parallelism (parameters replicated),
  fsdp    data parallelism with parameters and optimizer state sharded (ZeRO-3 style),
  tensor  tensor (Megatron-style) parallelism over heads / mlp / vocab.

Every parameter and constrained activation names its dimensions logically (``embed``,
``mlp``, ``heads``, ...); ``DEFAULT_RULES`` maps those names to mesh axes. Changing the
parallel layout is a change of ``mesh_shape`` or of the rules, never of model code.

A job over several TPU slices (multislice: ICI inside a slice, the data-center network, DCN,
between them) lays each slice out as ``mesh_shape`` says and repeats it over the slices along
``data`` (``dcn_data`` of them) and then ``fsdp`` (the rest), as MaxText's dcn_*_parallelism
does. With the data axis over every slice (the default) the batch crosses DCN, and the weights'
gathers and tensor parallelism stay inside a slice.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import math
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    # parameters
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("lora_rank", None),  # LoRA adapters: their other axis follows the weight's
    # activations
    ("act_batch", BATCH_AXES),
    ("act_length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    # KV cache
    ("cache_batch", BATCH_AXES),
    ("cache_length", None),
)


PARAM_AXES = ("layers", "vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "norm", "lora_rank")


def weights_off_batch_axes(rules=DEFAULT_RULES) -> tuple:
    """``rules`` with no weight axis on the batch axes (``BATCH_AXES``): weights whole along
    them (split over "tensor" still), activations and the cache as before. The sampler's own
    weights, where they fit (``Sampler``): each device then decodes its rows without gathering
    a weight at every step."""
    def off(axes):
        kept = tuple(a for a in (axes if isinstance(axes, tuple) else (axes,)) if a not in BATCH_AXES and a)
        return kept[0] if len(kept) == 1 else (kept or None)

    return tuple((name, off(axes) if name in PARAM_AXES else axes) for name, axes in rules)


def resolve_mesh_shape(shape: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Fill in the one ``-1`` axis so the product equals ``num_devices`` (``dcn_data`` aside)."""
    shape = {a: s for a, s in shape.items() if a != "dcn_data"}
    unknown = [a for a in shape if a not in MESH_AXES]
    if unknown:
        raise ValueError(f"mesh_shape has unknown axes {unknown}: allowed {list(MESH_AXES)}")
    sizes = {a: int(shape.get(a, 1)) for a in MESH_AXES}
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"mesh_shape: at most one axis may be -1, got {free}")
    bad = [a for a, s in sizes.items() if s == 0 or s < -1]
    if bad:
        raise ValueError(f"mesh_shape: axis sizes must be positive or -1, got {dict(sizes)}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if num_devices % known:
            raise ValueError(f"mesh_shape={dict(shape)}: {num_devices} devices are not divisible by {known}")
        sizes[free[0]] = num_devices // known
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(f"mesh_shape={dict(sizes)} needs {math.prod(sizes.values())} devices, have {num_devices}")
    return sizes


def slice_count(devices: Sequence[jax.Device]) -> int:
    """The TPU slices (ICI-connected groups of chips) ``devices`` span: their distinct
    ``slice_index``; 1 where devices carry none (CPUs) and on GPUs, whose ``slice_index`` names a
    host's NVLink domain: there the mesh fields lay out the whole job, as they always have."""
    if not devices or devices[0].platform == "gpu":
        return 1
    return len({getattr(d, "slice_index", 0) for d in devices})


def resolve_layout(shape: Mapping[str, int], num_devices: int, slices: int = 1) -> tuple[dict, dict]:
    """(one slice's axis sizes, the slices' axis sizes) of ``shape`` on ``num_devices`` over
    ``slices``: ``shape``'s data, fsdp and tensor lay out one slice's devices (-1 filled in there);
    ``shape["dcn_data"]`` slices (-1, the default: all of them) repeat it along data, the rest of
    the slices along fsdp. ValueError for a layout the devices cannot hold."""
    dcn_data = int(shape.get("dcn_data", -1))
    if num_devices % slices:
        raise ValueError(f"{num_devices} devices do not split evenly over {slices} slices")
    try:
        ici = resolve_mesh_shape(shape, num_devices // slices)
    except ValueError as err:
        if slices == 1:
            raise
        raise ValueError(f"{err} (mesh.data, fsdp and tensor lay out one of the {slices} slices)") from None
    data = slices if dcn_data == -1 else dcn_data
    if data < 1 or slices % data:
        raise ValueError(f"dcn_data={dcn_data} must divide the job's slice count, {slices}"
                         f"{' (its devices are one slice)' if slices == 1 else ''}; -1 = every slice")
    return ici, {"data": data, "fsdp": slices // data, "tensor": 1}


def mesh_sizes(shape: Mapping[str, int], num_devices: int, slices: int = 1) -> dict[str, int]:
    """The whole mesh's axis sizes (``resolve_layout``'s two layouts multiplied)."""
    ici, dcn = resolve_layout(shape, num_devices, slices)
    return {a: ici[a] * dcn[a] for a in MESH_AXES}


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    slices = slice_count(devices)
    ici, dcn = resolve_layout(shape, len(devices), slices)
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)  # GSPMD propagation, not explicit sharding types
    if slices > 1:
        return Mesh(hybrid_devices(devices, ici, dcn), MESH_AXES, axis_types=auto)
    dims = tuple(ici[a] for a in MESH_AXES)
    if devices[0].platform == "gpu":  # jax.make_mesh's order (by id), without its refusal of several hosts
        return Mesh(mesh_utils.create_device_mesh(dims, devices), MESH_AXES, axis_types=auto)
    whole = devices == list(jax.devices())
    if whole or devices[0].platform != "cpu":  # topology-aware order (TPU rings)
        try:
            return jax.make_mesh(dims, MESH_AXES, axis_types=auto, devices=devices)
        except (AssertionError, ValueError):  # a part of a TPU slice that is no physical box (split meshes)
            if whole:
                raise
    return Mesh(np.asarray(devices).reshape(dims), MESH_AXES, axis_types=auto)


def hybrid_devices(devices: Sequence[jax.Device], ici: Mapping[str, int], dcn: Mapping[str, int]) -> np.ndarray:
    """The device grid of a multislice mesh: each slice laid out as ``jax.make_mesh`` lays out one
    (its ICI rings), the slices in ``slice_index`` order as blocks along data, then fsdp."""
    per_slice = collections.Counter(d.slice_index for d in devices)
    if len(set(per_slice.values())) > 1:
        raise ValueError(f"the slices hold different device counts {dict(sorted(per_slice.items()))}: a "
                         "multislice mesh repeats one slice's layout")
    split = devices[0].device_kind in ("TPU v5 lite", "TPU v5e")  # as jax.make_mesh allows on v5e
    return mesh_utils.create_hybrid_device_mesh([ici[a] for a in MESH_AXES], [dcn[a] for a in MESH_AXES],
                                                devices, allow_split_physical_axes=split)


_PLATFORM = contextvars.ContextVar("arlopti_platform", default=None)


@contextlib.contextmanager
def activate(mesh: Mesh, rules=DEFAULT_RULES):
    """Mesh and logical rules for tracing: activation constraints take effect inside, and
    ``platform()`` is the mesh's (a compile-only TPU or GPU mesh on a CPU host included)."""
    token = _PLATFORM.set(mesh.devices.flat[0].platform)
    try:
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            yield
    finally:
        _PLATFORM.reset(token)


def platform() -> str:
    """The platform programs are traced for ("cpu", "gpu", "tpu"): the active mesh's devices'
    under ``activate``, else JAX's default backend. Code that picks a kernel or layout per
    backend asks this, so ``aot`` compiles for an H100 or a TPU what would run there."""
    return _PLATFORM.get() or jax.default_backend()


def logical_to_shardings(logical_specs, mesh: Mesh, rules=DEFAULT_RULES, shapes=None):
    """Map a tree of logical PartitionSpecs to NamedShardings on ``mesh``.

    With ``shapes`` (a matching tree of arrays or ShapeDtypeStructs), a dimension that its
    mesh axes do not divide (kv_heads=2 over tensor=4, an odd vocabulary) is replicated
    instead, so any layout runs; the rest of the tensor stays sharded.
    """
    shardings = nn.logical_to_mesh_sharding(logical_specs, mesh, rules)
    if shapes is None:
        return shardings
    return jax.tree_util.tree_map(lambda sh, x: _fit(sh, x.shape), shardings, shapes)


def _fit(sharding: NamedSharding, shape) -> NamedSharding:
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    for i, axes in enumerate(spec):
        names = axes if isinstance(axes, tuple) else (axes,) if axes else ()
        if shape[i] % math.prod(sharding.mesh.shape[a] for a in names):
            spec[i] = None
    return NamedSharding(sharding.mesh, P(*spec))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Leading (batch) dimension over data x fsdp; the rest replicated."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_divisor(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def put(x: np.ndarray, sharding: NamedSharding, global_rows: int | None = None) -> jax.Array:
    """A host array -> a global array in ``sharding``. With ``sharding`` on one process's devices, or
    ``global_rows`` None (every process holds ``x`` whole), ``x`` is the whole array; otherwise ``x``
    is this process's rows of a ``global_rows``-row array."""
    if global_rows is None or len({d.process_index for d in sharding.device_set}) == 1:
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    return jax.make_array_from_process_local_data(sharding, x, (global_rows,) + x.shape[1:])


def describe(tree) -> dict[str, str]:
    """Flat {path: sharding spec} of a tree of arrays, for logs and tests."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(k): str(getattr(v.sharding, "spec", v.sharding)) for k, v in flat}


def whole_on_own_mesh(t):  # the program's name in the compile log
    return t


def whole_program(leaves: list) -> tuple[list[int], Any]:
    """The program ``transfer`` runs first with several processes, for a list of arrays (or abstract
    arrays: ``aot``): (the positions of the leaves it takes, those not whole on their mesh already: a
    key or a scalar is; the jitted program, which makes the list of those whole, replicated over each
    one's own mesh)."""
    split = [i for i, x in enumerate(leaves) if not x.sharding.is_fully_replicated]
    return split, jax.jit(whole_on_own_mesh, out_shardings=[replicated(leaves[i].sharding.mesh) for i in split])


def transfer(tree, shardings):
    """A copy of ``tree``'s arrays in ``shardings`` (a matching tree of NamedShardings, on other devices
    than the arrays': the sampler's mesh). One process: ``jax.device_put``. Several: JAX moves arrays
    across processes only between equal device sets (or over the TFRT TPU runtime's transfers), so each
    array is first made whole on its own mesh (one program, the weights gathered over its devices) and
    each process then copies its own devices' parts from a device of its own: ``run_setup.split_devices``
    gives every process devices of both meshes. The sources are never donated or changed."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    leaves, treedef = jax.tree.flatten(tree)
    split, gather = whole_program(leaves)
    if split:
        for i, x in zip(split, gather([leaves[i] for i in split])):
            leaves[i] = x
    whole = jax.tree.unflatten(treedef, leaves)

    def local(x, sharding):
        source = x.addressable_shards[0].data
        parts = []
        for device, index in sharding.addressable_devices_indices_map(x.shape).items():
            full = all(i == slice(None) or (i.start in (None, 0) and i.stop in (None, n) and i.step in (None, 1))
                       for i, n in zip(index, x.shape))
            parts.append(jax.device_put(source if full else source[index], device))
        return jax.make_array_from_single_device_arrays(x.shape, sharding, parts)

    return jax.tree.map(local, whole, shardings)
