"""The compile-only check (``python -m arlopti_jax.aot``): one RL step's programs compiled for a TPU
slice and an H100 by their own compilers, the compiler's memory against an independent count, and
the one-line error of a config that cannot fit."""

import os
import subprocess
import sys

import numpy as np
import pytest

from arlopti_jax.aot import targets

pytest.importorskip("jax_plugins.xla_cuda12", reason="the compile-only compilers: pip install -e '.[aot]'")
pytest.importorskip("libtpu", reason="the compile-only compilers: pip install -e '.[aot]'")


@pytest.fixture
def compile_only():
    """For a test that compiles for a target's devices itself: the persistent cache off, as
    ``aot.check`` has it (a compile-only executable cannot be read back from it)."""
    from arlopti_jax.aot import check

    with check.no_persistent_cache():
        yield


def small_config(**overrides):
    """The embedded default's model with short sequences: every kind of program, quickly."""
    from arlopti_jax.embedded.default import get_config

    c = get_config()
    c.data.max_prompt_length, c.rollout.max_response_length, c.rollout.prompt_bucket = 32, 16, 32
    c.train.batch_prompts, c.rollout.n, c.train.mini_batch, c.train.micro_batch = 8, 4, 16, 8
    c.loss.kl_coef = 0.001  # the reference pass too
    for key, value in overrides.items():
        group, field = key.split(".")
        c[group][field] = value
    return c


@pytest.mark.parametrize("name", [n for n in targets.TARGETS])
def test_every_named_target_has_its_chips_on_its_hosts(name):
    """Each target's compile-only devices: as many as the slice has chips (a v4 chip is one
    device over its two cores, as the pod runs it), spread over its hosts (processes) evenly."""
    target = targets.get(name)
    found = targets.devices(target)
    want_chips = {"v5e-1": 1, "v5e-8": 8, "v5e-16": 16, "v5e-256": 256, "v5p-8": 4, "v5p-16": 8, "v5p-32": 16,
                  "v5p-64": 32, "v4-32": 16,
                  "h100": 1, "h100x8": 8}[name]  # v5p and v4 names count TensorCores, two per chip
    assert len(found) == want_chips
    if target.platform == "tpu":
        hosts = {d.process_index for d in found}
        assert len(hosts) == target.hosts and all(
            sum(d.process_index == h for d in found) == want_chips // target.hosts for h in hosts)


@pytest.mark.slow  # default-suite budget (10 minutes on 2 cores): CI runs it in the slow pass
def test_one_rl_step_compiles_for_a_tpu_slice():
    """Every kind of program (the length-aware schedule's, the reference log-prob pass) for v5e-8."""
    from arlopti_jax.aot.check import check

    record = check(small_config(**{"rollout.length_aware": True, "rollout.min_rows": 4, "rollout.phase_tokens": 8,
                                   "train.batch_prompts": 16, "train.mini_batch": 32}), targets.get("v5e-8"))
    names = [p["name"] for p in record["programs"]]
    # the small model's copy is whole along fsdp (rollout.whole_weights auto): made first, and no decode step gathers
    assert names[:3] == ["sampling weights", "prefill", "start"] and any(n.startswith("decode") for n in names)
    assert not any("all-gather" in p["collectives"] for p in record["programs"] if p["name"].startswith("decode"))
    assert any(n.startswith("grow") for n in names) and any(n.startswith("compact") for n in names)
    assert [n.split()[0] for n in names[-4:]] == ["log-probs", "zeros", "accumulate", "apply"]
    assert record["fits"] and record["mesh"]["fsdp"] == 8 and record["processes"] == 1
    for p in record["programs"]:
        assert p["compile_s"] > 0 and p["peak_bytes_per_device"] >= record["resident_bytes_per_device"]
    accumulate = next(p for p in record["programs"] if p["name"].startswith("accumulate"))
    assert accumulate["memory"]["alias"] > 0  # the gradient accumulator is donated
    assert accumulate["flops"] > 0 and accumulate["hlo_bytes"] > 0  # XLA:TPU's cost analysis, and the HLO's
    assert accumulate["collectives"]["all-gather"]["count"] > 0  # fsdp gathers the weights


@pytest.mark.slow  # default-suite budget (10 minutes on 2 cores): CI runs it in the slow pass
def test_one_rl_step_compiles_for_an_h100():
    """The dense sampler and the update for one H100: no cost analysis from XLA:GPU, so bytes come
    from the HLO and launches from the thunk sequence."""
    from arlopti_jax.aot.check import check

    record = check(small_config(**{"loss.kl_coef": 0.0, "model.unroll_layers": False}), targets.get("h100"))
    names = [p["name"].split()[0] for p in record["programs"]]
    # on a GPU the sampler takes its own per-layer copy of the weights first (Sampler.sampling_params)
    assert names == ["sampling", "prefill", "start", "decode", "zeros", "accumulate", "apply"] and record["fits"]
    accumulate = next(p for p in record["programs"] if p["name"].startswith("accumulate"))
    assert accumulate["hlo_bytes"] > 0 and accumulate["flops"] is None and not accumulate["collectives"]
    assert accumulate["hlo_flops"] > 0  # counted from the HLO (Module.flops; its own test below)
    decode = next(p for p in record["programs"] if p["name"].startswith("decode"))
    assert decode["gpu"]["loops"] and decode["gpu"]["loops"][0]["kernels"] + decode["gpu"]["loops"][0][
        "command_buffers"] > 0, decode["gpu"]


# every program of a step: docs/reference/memory.md has Gemma-3-4B's compiled figures. The H100 compile
# took 957 s on the loaded 2-core machine (2026-12-01), past the slow pass's budget: the TPU one stays
# (400 s there); the GPU kernel's sliding window is tested on the CPU (tests/rollout/test_families.py)
@pytest.mark.slow
@pytest.mark.parametrize("target, caps", [("v5e-8", True)], ids=["v5e-8-softcaps"])
def test_a_gemma3_step_compiles_for_a_tpu_slice_and_an_h100(target, caps, tmp_path):
    """Gemma 3's pieces (sliding and global layers picked inside the layer loop, their masks and RoPE;
    q/k norms) through every program of a step, by each target's own compiler, from a tiny folder's
    config.json: on the TPU with both soft-caps, on the H100 without (so its decode steps run the
    Pallas kernel, a sliding layer's window as each row's first slot)."""
    from hf_fixtures import SOFTCAPS, write_hf_model

    from arlopti_jax.aot.check import check

    folder = write_hf_model(tmp_path / "gemma3", kind="gemma3", **(SOFTCAPS if caps else {}))
    record = check(small_config(**{"model.path": str(folder), "rollout.length_aware": True, "rollout.min_rows": 4,
                                   "rollout.phase_tokens": 8}), targets.get(target))
    names = [p["name"] for p in record["programs"]]
    assert record["fits"] and record["model"] == f"{folder}/config.json"
    assert any(n.startswith("decode") for n in names) and any(n.startswith("grow") for n in names)
    assert [n.split()[0] for n in names[-3:]] == ["zeros", "accumulate", "apply"]


def test_compiler_argument_bytes_equal_a_count_of_the_sharded_state():
    """The optimizer step's arguments on 8 H100s (dense layouts: a TPU pads small dimensions to its
    (8, 128) tiles) are the parameters, the AdamW moments and the float32 gradient accumulator:
    4 x 4 bytes per parameter, split 8 ways except the norms and the attention biases (no
    dimension that fsdp shards), plus a few dozen scalars."""
    from arlopti_jax.aot.check import check
    from arlopti_jax.embedded.start_point import SCALES, model_config

    config = small_config(**{"loss.kl_coef": 0.0, "model.unroll_layers": False})
    record = check(config, targets.get("h100x8"), groups=("update",))
    cfg = model_config(SCALES["cpu"], SCALES["cpu"]["vocab_size"])
    replicated = (2 * cfg.num_layers + 1) * cfg.hidden_size + cfg.num_layers * (
        cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_device = (cfg.num_params() - replicated) / 8 + replicated
    apply = next(p for p in record["programs"] if p["name"].startswith("apply"))
    # the parameters, two moments and the gradient accumulator, + scalars: counts, hyperparameters, stats
    assert 0 <= apply["memory"]["argument"] - 16 * per_device < 256, apply["memory"]
    assert apply["memory"]["alias"] >= 12 * per_device  # parameters and moments updated in place
    assert record["resident_bytes_per_device"] - 12 * per_device < 64  # no reference policy


def test_a_lora_step_holds_the_base_once_and_optimizer_state_for_the_adapters_alone():
    """LoRA (rank 4 on q and down) compiled for one H100 without a model folder (the preset's shape
    takes the config's LoRA fields too): the optimizer step's arguments are the adapters, their
    two moments and their gradient accumulator (4 x 4 bytes per adapter weight), and the resident
    state is the base once (it is the reference policy too, KL on) and the adapters with their
    moments, counted here from the shapes."""
    from arlopti_jax.aot.check import check
    from arlopti_jax.embedded.start_point import SCALES, model_config

    config = small_config(**{"model.unroll_layers": False, "model.lora_rank": 4, "model.lora_targets": "q,down"})
    record = check(config, targets.get("h100"), groups=("update",))
    cfg = model_config(SCALES["cpu"], SCALES["cpu"]["vocab_size"])
    q_out = cfg.num_heads * cfg.head_dim
    adapters = cfg.num_layers * 4 * (cfg.hidden_size + q_out + cfg.intermediate_size + cfg.hidden_size)
    apply = next(p for p in record["programs"] if p["name"].startswith("apply"))
    assert 0 <= apply["memory"]["argument"] - 16 * adapters < 256, (apply["memory"], adapters)
    assert 0 <= record["resident_bytes_per_device"] - (4 * cfg.num_params() + 12 * adapters) < 64


@pytest.mark.slow  # default-suite budget (10 minutes on 2 cores): CI runs it in the slow pass
def test_a_config_that_cannot_fit_gets_one_line():
    env = {**os.environ, "XLA_FLAGS": ""}
    args = ["--config.train.batch_prompts=512", "--config.rollout.n=16", "--config.rollout.max_response_length=8192",
            "--config.train.mini_batch=8192", "--config.train.micro_batch=8"]
    proc = subprocess.run([sys.executable, "-m", "arlopti_jax.aot", "--target=v5e-8", *args],
                          capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in proc.stderr.strip().splitlines() if line]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: v5e-8: "), proc.stderr[-3000:]
    assert "GiB" in lines[0] and "rollout" in lines[0] and "max_response_length" in lines[0]


def test_an_unknown_target_or_a_layout_the_slice_cannot_hold_is_one_line():
    env = {**os.environ, "XLA_FLAGS": ""}
    run = lambda *args: subprocess.run([sys.executable, "-m", "arlopti_jax.aot", *args], capture_output=True,
                                       text=True, env=env, timeout=600)
    unknown = run("--target=v9-1")
    assert unknown.returncode == 2 and unknown.stderr.strip().splitlines() == [
        f"error: --target=v9-1: unknown; targets are {', '.join(targets.TARGETS)}, "
        "NxNAME (N TPU slices: multislice), local"]
    # tensor parallelism across v5e-16's hosts (4 chips each): no process holds whole batch rows
    across = run("--target=v5e-16", "--config.mesh.fsdp=2", "--config.mesh.tensor=8", "--config.train.micro_batch=2")
    lines = across.stderr.strip().splitlines()
    assert across.returncode == 2 and len(lines) == 1 and "config.mesh" in lines[0], across.stderr[-2000:]


def test_hlo_bytes_count_slices_and_in_place_updates():
    """The byte model on a hand-written module: a fusion reading one row of a matrix through a
    dynamic slice costs the row; an in-place dynamic-update-slice costs the update."""
    from arlopti_jax.aot import hlo

    text = """HloModule m

%fused_slice (p0: f32[64,256], p1: s32[]) -> f32[1,256] {
  %p0 = f32[64,256]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %ds = f32[1,256]{1,0} dynamic-slice(%p0, %p1, %c), dynamic_slice_sizes={1,256}
}

%fused_update (q0: f32[64,256], q1: f32[1,256], q2: s32[]) -> f32[64,256] {
  %q0 = f32[64,256]{1,0} parameter(0)
  %q1 = f32[1,256]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[64,256]{1,0} dynamic-update-slice(%q0, %q1, %q2, %z)
}

ENTRY %main (a: f32[64,256], i: s32[]) -> f32[64,256] {
  %a = f32[64,256]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %row = f32[1,256]{1,0} fusion(%a, %i), kind=kLoop, calls=%fused_slice
  ROOT %out = f32[64,256]{1,0} fusion(%a, %row, %i), kind=kLoop, calls=%fused_update
}
"""
    module = hlo.Module(text)
    row = 256 * 4
    # slice: reads the row + the index, writes the row; update: reads the row + index, writes the row
    assert module.bytes() == (row + 4 + row) + (row + 4 + row)
    assert hlo.shape_bytes("(bf16[2,3]{1,0}, s32[])") == 2 * 6 + 4
    assert np.isclose(hlo.shape_bytes("pred[10]"), 10)


def test_collective_payloads_are_the_results_of_each_async_form():
    """The async starts' tuples as XLA:TPU and XLA:GPU print them: a collective-permute's (the
    windowed einsum's ring on a v5p-64) ends in two u32 contexts, a combined all-gather's holds its
    operands then its results; each is counted as its results' bytes."""
    from arlopti_jax.aot import hlo

    text = """HloModule m

ENTRY %main (w: bf16[1,112,28,128], a: s32[1,64], b: f32[16,1024], g: f32[1024,128], r: f32[2184]) -> f32[2184] {
  %w = bf16[1,112,28,128]{3,1,0,2:T(8,128)(2,1)} parameter(0)
  %a = s32[1,64]{1,0} parameter(1)
  %b = f32[16,1024]{1,0} parameter(2)
  %g = f32[1024,128]{0,1} parameter(3)
  %r = f32[2184]{0} parameter(4)
  %cp = (bf16[1,112,28,128]{3,1,0,2:T(8,128)(2,1)}, bf16[1,112,28,128]{3,1,0,2:T(8,128)(2,1)}, u32[]{:S(2)}, \
u32[]{:S(2)}) collective-permute-start(%w), channel_id=9, source_target_pairs={{0,1},{1,0}}
  %cpd = bf16[1,112,28,128]{3,1,0,2:T(8,128)(2,1)} collective-permute-done(%cp)
  %ag = ((s32[1,64]{1,0}, f32[16,1024]{1,0}), (s32[8,64]{1,0}, f32[128,1024]{1,0})) all-gather-start(%a, %b), \
dimensions={0}
  %agd = (s32[8,64]{1,0}, f32[128,1024]{1,0}) all-gather-done(%ag)
  %rs = ((f32[1024,128]{0,1}), f32[1024,16]{0,1}) reduce-scatter-start(%g), dimensions={1}
  %rsd = f32[1024,16]{0,1} reduce-scatter-done(%rs)
  %ar = f32[2184]{0} all-reduce-start(%r), to_apply=%add
  ROOT %ard = f32[2184]{0} all-reduce-done(%ar)
}
"""
    found = hlo.Module(text).collectives()
    assert found["collective-permute"] == {"count": 1, "bytes": 112 * 28 * 128 * 2}
    assert found["all-gather"] == {"count": 1, "bytes": 8 * 64 * 4 + 128 * 1024 * 4}
    assert found["reduce-scatter"] == {"count": 1, "bytes": 1024 * 16 * 4}
    assert found["all-reduce"] == {"count": 1, "bytes": 2184 * 4}


def test_collectives_between_slices_are_counted_from_their_megascale_transfers():
    """XLA:TPU lowers a collective between slices to a host-transfer send/recv pair for the
    megascale runtime (as it printed them for two v5e-16 slices): each recv is one DCN collective
    of its kind, its payload the recv's first array; the send, the dones and an ICI all-reduce
    beside them are not DCN's."""
    from arlopti_jax.aot import hlo

    mega = '_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_target="{1,2}x{0:15}"'
    text = f"""HloModule m

ENTRY %main (x: f32[64,8,128], y: f32[1,2,1024]) -> f32[64,8,128] {{
  %x = f32[64,8,128]{{2,1,0}} parameter(0)
  %y = f32[1,2,1024]{{2,1,0}} parameter(1)
  %t = token[] after-all(), frontend_attributes={{MegascaleRendezvousKeyName="all-reduce.1_0"}}
  %s = (f32[64,8,128]{{2,1,0}}, u32[], token[]) send(%x, %t), channel_id=2, is_host_transfer=true, \
frontend_attributes={{{mega},_xla_megascale_transfer_type="ALL_REDUCE"}}
  %r = (f32[64,8,128]{{2,1,0}}, u32[], token[]) recv(%t), channel_id=1, is_host_transfer=true, \
frontend_attributes={{{mega},_xla_megascale_reduce_operation="SUM",_xla_megascale_transfer_type="ALL_REDUCE"}}
  %g = (f32[2,2,1024]{{2,1,0}}, u32[], token[]) recv(%t), channel_id=3, is_host_transfer=true, \
frontend_attributes={{{mega},_xla_megascale_transfer_type="ALL_GATHER"}}
  %sd = token[] send-done(%s), channel_id=2, is_host_transfer=true, frontend_attributes={{{mega}}}
  %rd = (f32[64,8,128]{{2,1,0}}, token[]) recv-done(%r), channel_id=1, is_host_transfer=true
  %v = f32[64,8,128]{{2,1,0}} get-tuple-element(%rd), index=0
  ROOT %ar = f32[64,8,128]{{2,1,0}} all-reduce(%v), replica_groups={{{{0,1}}}}, to_apply=%add
}}
"""
    found = {k: v for k, v in hlo.Module(text).collectives().items() if v["count"]}
    assert found == {"all-reduce": {"count": 1, "bytes": 64 * 8 * 128 * 4},
                     "dcn all-reduce": {"count": 1, "bytes": 64 * 8 * 128 * 4},
                     "dcn all-gather": {"count": 1, "bytes": 2 * 2 * 1024 * 4}}


def test_two_slices_of_a_named_tpu_target_make_one_mesh_over_the_data_axis():
    """``2xv5e-16``: libtpu's compile-only topology of two v5e-16 slices (32 chips on 8 hosts, each
    with its slice_index). Its mesh puts one slice per row of the data axis, each laid out as
    ``jax.make_mesh`` lays out that slice alone, and stays so when made process-contiguous."""
    import jax

    from arlopti_jax.runtime import distributed as dist
    from arlopti_jax.runtime import sharding as shd

    target = targets.get("2xv5e-16")
    assert (target.chips, target.hosts, target.slices, target.topology) == (32, 8, 2, "v5e:4x4")
    found = targets.devices(target)
    assert len(found) == 32 and shd.slice_count(found) == 2
    for s in (0, 1):
        assert len({d.process_index for d in found if d.slice_index == s}) == 4
    for shape in ({"fsdp": 16}, {"fsdp": 8, "tensor": 2}):
        mesh = dist.process_contiguous(shd.make_mesh(shape, devices=found))
        assert dict(mesh.shape) == shd.resolve_mesh_shape(shape, 16) | {"data": 2}
        for s in (0, 1):
            alone = [d for d in found if d.slice_index == s]
            want = dist.process_contiguous(jax.make_mesh((1, *mesh.devices.shape[1:]), shd.MESH_AXES, devices=alone))
            assert list(mesh.devices[s].flat) == list(want.devices.flat)
    with pytest.raises(targets.TargetError, match="h100x8 is a GPU target"):
        targets.get("2xh100x8")
    with pytest.raises(targets.TargetError, match="N must be >= 1"):
        targets.get("0xv5e-8")


def test_an_h100_node_is_laid_out_as_jax_make_mesh_lays_it_out():
    """GPUs keep JAX's own order (by id) for every layout; make_mesh builds it without
    jax.make_mesh, which refuses GPUs of several hosts (tests/runtime/test_multislice.py)."""
    import jax

    from arlopti_jax.runtime import sharding as shd

    gpus = list(targets.devices(targets.get("h100x8")))
    for shape in ({"fsdp": 8}, {"fsdp": 1, "tensor": 8}, {"data": 2, "fsdp": 2, "tensor": 2}):
        want = jax.make_mesh(tuple(shd.resolve_mesh_shape(shape, 8).values()), shd.MESH_AXES, devices=gpus)
        assert list(shd.make_mesh(shape, devices=gpus).devices.flat) == list(want.devices.flat)


@pytest.mark.slow
def test_one_rl_step_compiles_for_two_slices():
    """Every program of the small config's step for two v5e-8 slices (data=2 across them, fsdp=8
    inside each): the gradients cross the data-center network in the update, the weights' gathers
    stay inside a slice."""
    from arlopti_jax.aot.check import check

    record = check(small_config(**{"train.micro_batch": 16}), targets.get("2xv5e-8"))
    assert record["fits"] and record["slices"] == 2 and record["dcn_data"] == 2 and record["processes"] == 2
    assert record["mesh"] == {"data": 2, "fsdp": 8, "tensor": 1}
    programs = {p["name"].split()[0]: p["collectives"] for p in record["programs"]}
    assert programs["accumulate"]["dcn all-reduce"]["count"] > 0
    assert programs["accumulate"]["all-gather"]["count"] > 0 and "dcn all-gather" not in programs["sampling"]


def test_the_tpu_estimate_loses_its_second_per_concat_bitcast():
    """libtpu's estimate of a decode step counts each ConcatBitcast custom call as -1 s: a 2-layer
    step's -3998.1 ms with four of them is 1.9 ms; one that stays negative is unusable."""
    from arlopti_jax.aot import hlo

    call = '  %c{i} = bf16[2,64]{{1,0}} custom-call(%a, %b), custom_call_target="ConcatBitcast"\n'
    text = "".join(call.format(i=i) for i in range(4))
    assert np.isclose(hlo.tpu_estimate(-3.9981, text), 0.0019)
    assert hlo.tpu_estimate(0.0021, "") == 0.0021
    assert hlo.tpu_estimate(-1.5, call.format(i=0)) is None and hlo.tpu_estimate(None, text) is None


@pytest.mark.parametrize("before", [True, False])
def test_no_persistent_cache_turns_it_off_inside_and_back_as_it_was(before):
    import jax

    from arlopti_jax.aot import check

    was = jax.config.jax_enable_compilation_cache
    try:
        jax.config.update("jax_enable_compilation_cache", before)
        with pytest.raises(RuntimeError), check.no_persistent_cache():
            assert jax.config.jax_enable_compilation_cache is False
            raise RuntimeError  # left by an error too
        assert jax.config.jax_enable_compilation_cache is before
    finally:
        jax.config.update("jax_enable_compilation_cache", was)


def test_tpu_cycles_are_summed_by_the_operation_that_made_each_kernel():
    """Three kernels of two source operations (one from a backward pass) and one kernel without
    metadata: cycles summed per op_name prefix, largest first; lines without a cost are skipped."""
    from arlopti_jax.aot import hlo

    kernel = ('  %f{i} = bf16[8]{{0}} fusion(%a), kind=kOutput, calls=%c{i}, metadata={{op_name="{op}"}}, '
              'backend_config={{"window_config":{{"estimated_cycles":"{cycles}"}}}}\n')
    text = (kernel.format(i=0, op="jit(step)/Block/attn/qk/dot_general", cycles=300)
            + kernel.format(i=1, op="jit(step)/Block/attn/qk/dot_general", cycles=200)
            + kernel.format(i=2, op="jit(step)/transpose(jvp(Block))/mlp/up/dot_general", cycles=700)
            + '  %f3 = bf16[8]{0} fusion(%a), backend_config={"window_config":{"estimated_cycles":"9"}}\n'
            + '  %p = bf16[8]{0} parameter(0), metadata={op_name="jit(step)/Block/attn/qk/dot_general"}\n')
    got = hlo.tpu_cycles_by_op(text)
    assert got == {"transpose(jvp(Block))/mlp/up": 700, "Block/attn/qk": 500, "(no op_name)": 9}
    assert list(got) == ["transpose(jvp(Block))/mlp/up", "Block/attn/qk", "(no op_name)"]


def test_a_growth_or_compaction_that_does_not_fit_is_told_to_decode_in_one_phase():
    """Those programs hold two KV caches (7B on a v5e-16 was refused at a compaction): the advice
    names the one-phase settings; a decode step's advice does not."""
    from arlopti_jax.aot.check import advice

    for program in ("grow rows=64 slots=2496", "compact rows=64 slots=4544"):
        text = advice("rollout", False, program)
        assert "two KV caches" in text and "rollout.phase_tokens=rollout.max_response_length" in text
    assert "phase_tokens" not in advice("rollout", False, "decode rows=64 slots=4544")
    assert advice("rollout", True, "grow rows=64 slots=2496").startswith("the resident state dominates")


def test_hlo_flops_of_an_h100_program_equal_the_products_it_computes(compile_only):
    """XLA:GPU compile-only gives no cost analysis; ``Module.flops`` counts the matrix products of
    the optimized HLO. Forward and backward of cuDNN's masked attention and a projection, compiled
    for an H100, against the count by hand: attention 4 B N T S H forward and 10 B N T S H backward
    (scores, output; recomputed scores, dP, dV, dQ, dK), the projection 2 T D F forward and twice
    that backward (dX and dW); and a dot inside a known-trip-count loop counted per trip."""
    import jax
    import jax.numpy as jnp

    from arlopti_jax.aot import hlo

    b, t, n, kv, h, f = 2, 256, 4, 2, 64, 384
    d = n * h
    mesh_device = targets.devices(targets.get("h100"))[0]
    sharding = jax.sharding.SingleDeviceSharding(mesh_device)

    def loss(q, k, v, w, mask):
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")
        return jnp.sum(jnp.square((out.reshape(b * t, d) @ w).astype(jnp.float32)))  # dY varies: dX is a product

    shapes = [(b, t, n, h), (b, t, kv, h), (b, t, kv, h), (d, f)]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in shapes]
    args.append(jax.ShapeDtypeStruct((b, 1, t, t), jnp.bool_, sharding=sharding))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    module = hlo.Module(grad.lower(*args).compile().as_text())
    attention = (4 + 10) * b * n * t * t * h
    projection = 3 * 2 * (b * t) * d * f
    assert module.flops() == pytest.approx(attention + projection, rel=0.01)

    loop = """HloModule m

%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %w = f32[16,16]{1,0} constant({...})
  %y = f32[8,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %r = (s32[], f32[8,16]{1,0}) tuple(%i, %y)
}

%cond (c: (s32[], f32[8,16])) -> pred[] {
  %c = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (a: f32[8,16]) -> (s32[], f32[8,16]) {
  %a = f32[8,16]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}) tuple(%zero, %a)
  ROOT %loop = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"5"}}
}
"""
    assert hlo.Module(loop).flops() == 5 * 2 * 8 * 16 * 16


def test_the_decode_kernel_compiles_for_an_h100_and_updates_the_cache_in_place(compile_only):
    """The Pallas decode kernel at Qwen2.5-1.5B's heads, compiled for an H100 by XLA:GPU (Triton's
    lowering included): one Triton call per layer step, its cache buffers aliased to its outputs (no
    copy of the cache), and the splits combined by XLA. Its traffic (``hlo.Module.bytes``) is the
    cache read once: the aliased outputs are not counted again."""
    import jax
    import jax.numpy as jnp

    from arlopti_jax.aot import hlo
    from arlopti_jax.models import decode_attention as da

    mesh = jax.sharding.Mesh([targets.devices(targets.get("h100"))[0]], ("x",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
    b, kv, g, s, h = 64, 2, 6, 1536, 128
    cache = spec((b, kv, s, h))
    compiled = jax.jit(lambda *a: da.decode_attention(*a, scale=h ** -0.5), donate_argnums=(4, 5)).lower(
        spec((b, kv, g + 2, h)), spec((kv, g + 2, h)), spec((b,), jnp.int32), spec((h // 2,), jnp.float32), cache,
        cache, spec((b,), jnp.int32), spec((), jnp.int32)).compile()
    text = compiled.as_text()
    assert text.count('custom_call_target="__gpu$xla.gpu.triton"') == 1
    assert "output_to_operand_aliasing={{3}: (" in text and " copy(" not in text
    cache_bytes = 2 * b * kv * s * h * 2
    assert cache_bytes < hlo.Module(text).bytes() < 1.05 * cache_bytes


def test_one_layers_kernels_are_read_from_a_straight_line_step():
    """``hlo.kernel_names`` walks a dumped thunk sequence's command buffer in order (fusion numbers
    dropped); ``hlo.layer_kernels`` cuts one layer out of a straight-line step whose first layer
    and tail hold kernels of the step's own, for several layer counts."""
    from arlopti_jax.aot import hlo

    layer = ["fusion_926", "gemm_fusion_dot_197", "decode_attention", "loop_convert_fusion_27",
             "gemm_fusion_dot_198", "loop_add_fusion_27"]
    for layers in (3, 4, 7):
        names = ["loop_select_fusion", "loop_or_fusion_1"] + layer * layers + ["input_reduce_fusion_3", "kCopy"]
        lines = ["001: kWhile        [source | sink]", "  body:", "    000: kCommandBuffer [source | sink] "]
        lines += [f"        {i + 5:03d}: kCustomKernel [prev | next] {n} grid: [1, 1, 1]" for i, n in enumerate(names)]
        names_read = hlo.kernel_names(hlo.while_bodies(hlo.parse_thunks("\n".join(lines)))[0])
        assert len(names_read) == len(names) and names_read[1] == "loop_or_fusion"
        assert names_read[-2:] == ["input_reduce_fusion", "kCopy"]
        assert hlo.layer_kernels(names_read, layers) == ["fusion", "gemm_fusion_dot", "decode_attention",
                                                         "loop_convert_fusion", "gemm_fusion_dot", "loop_add_fusion"]
    assert hlo.layer_kernels(names_read, 2) is None and hlo.layer_kernels(names_read, 5) is None


@pytest.mark.parametrize("products", ["xla", "pallas"])
def test_fused_decode_products_leave_one_xla_product_per_step_on_an_h100(products, compile_only):
    """``model.decode_matmul=pallas`` compiled for an H100 (Qwen2.5-0.5B's shape, 64 rows, a decode
    step's forward pass): each layer's four products are Pallas calls of their own, beside its
    attention, with the norms, residual adds and silu x up inside them; XLA keeps no product but the
    vocabulary's. With XLA's products, each layer has 4 product fusions and 2 Triton norm fusions."""
    import functools

    import jax
    import jax.numpy as jnp

    from arlopti_jax.aot import hlo, shapes
    from arlopti_jax.models import ModelConfig, abstract_params
    from arlopti_jax.rollout import Sampler, programs
    from arlopti_jax.runtime import sharding as shd

    cfg = ModelConfig.from_hf_dict(shapes.qwen25("0.5b"), dtype="bfloat16", param_dtype="bfloat16",
                                   decode_attention="pallas", decode_matmul=products)
    mesh = shd.make_mesh({"fsdp": 1}, devices=list(targets.devices(targets.get("h100")))[:1])
    rep = shd.replicated(mesh)
    spec = lambda shape, dtype, sharding=rep: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    sampler = Sampler(cfg, mesh)
    with shd.activate(mesh):
        lowered = sampler._cast.lower(jax.tree.map(lambda a: spec(a.shape, a.dtype), abstract_params(cfg)))
        params = jax.tree.map(lambda i, sh: spec(i.shape, i.dtype, sh), lowered.out_info,
                              lowered.compile().output_shardings)
        b, slots, layers = 64, 96, cfg.num_layers
        buffers = tuple(spec((b, cfg.num_kv_heads, slots, cfg.head_dim), jnp.bfloat16) for _ in range(layers))
        forward = jax.jit(functools.partial(programs._forward, cfg), donate_argnums=(4,))
        text = forward.lower(params, spec((b, 1), jnp.int32), spec((b, 1), jnp.int32), spec((b, slots), jnp.int32),
                             {"k": buffers, "v": buffers}, spec((), jnp.int32)).compile().as_text()
    pallas_calls = text.count('custom_call_target="__gpu$xla.gpu.triton"')
    gemms, norms = text.count('"kind":"__triton_nested_gemm_fusion"'), text.count('"kind":"__triton"')
    if products == "pallas":
        assert (pallas_calls, gemms) == (5 * layers, 0)  # the vocabulary's product is not in this pass
        assert norms <= 2  # the final norm, and the sum of each row's live slots
    else:
        assert (pallas_calls, gemms) == (layers, 4 * layers)
        assert norms >= 2 * layers
    assert hlo.family("decode_matmul__12") == hlo.family("decode_matmul_1.2") == hlo.family("decode_matmul")


def test_the_sampler_weights_count_in_every_rollout_programs_peak():
    """A ``generate`` holds the sampler's copy of the weights from its first program to its last, so
    ``start`` (which does not take it) peaks at least the copy over the resident state, as
    ``prefill`` and ``decode`` (which do) count it among their arguments. On 8 H100s with fsdp the copy
    is whole by default (``rollout.whole_weights`` auto): the decode step gathers no weight."""
    from arlopti_jax.aot.check import check

    config = small_config(**{"loss.kl_coef": 0.0, "model.unroll_layers": False})
    record = check(config, targets.get("h100x8"), groups=("rollout",))
    programs = {p["name"].split()[0]: p for p in record["programs"]}
    copy = programs["sampling"]["memory"]["output"]
    assert copy > 0
    resident = record["resident_bytes_per_device"]
    start = programs["start"]
    own = start["memory"]["argument"] + start["memory"]["output"] - start["memory"]["alias"] + start["memory"]["temp"]
    # the copy's bytes as its shards count them (the program's output size adds a few hundred bytes of tables)
    assert abs(start["peak_bytes_per_device"] - (resident + own) - copy) < 1024
    assert "all-gather" not in programs["decode"]["collectives"]
    assert programs["sampling"]["collectives"]["all-gather"]["count"] > 0  # gathered once per rollout


def _episode_programs(first: int, buckets: tuple[int, ...], slots: tuple[int, ...]) -> list[str]:
    """The names of a length-aware episode schedule's programs, spelled out from how a batch of episodes
    runs (``rollout/episodes.py``): the copy, the prefill and the start, then per phase (its cache
    ``slots``) and row bucket reached a decode loop and a resume (the observations fed); a compaction
    to the next bucket; in the first phase a scatter of the compacted rows into the whole batch's
    outputs, and a growth into the next phase from every bucket."""
    names = ["sampling weights", "prefill", "episode start"]
    for phase, s in enumerate(slots):
        for i, rows in enumerate(buckets):
            names += [f"episode decode rows={rows} slots={s}", f"episode resume rows={rows} slots={s}"]
            if rows != first and phase == 0:
                names.append(f"episode scatter rows={rows}")
            if i + 1 < len(buckets):
                names.append(f"episode compact rows={rows} slots={s}")
            if phase + 1 < len(slots):
                names.append(f"episode grow rows={rows} slots={s}")
    return names


def test_tool_episodes_compile_every_episode_program_and_count_them_in_the_peak():
    """With ``env.name`` (the calculator, Qwen's ``<tool_call>`` format) the rollout's programs are the
    episodes': on 8 H100s, 8 prompts x 4 samples (4 rows a device, then 2), phases of 8 and 16 slots
    after the 32-token prompt, every one of them is compiled (none of the single-turn sampler's),
    counted, printed in the table, and the mesh's peak is the largest of theirs."""
    from arlopti_jax.aot.__main__ import format_record
    from arlopti_jax.aot.check import check

    config = small_config(**{"loss.kl_coef": 0.0, "model.unroll_layers": False, "rollout.length_aware": True,
                             "rollout.min_rows": 2, "rollout.phase_tokens": 8, "env.name": "calc",
                             "env.turn_tokens": 8, "env.observation_tokens": 4})
    record = check(config, targets.get("h100x8"), groups=("rollout",))
    names = [p["name"] for p in record["programs"]]
    want = _episode_programs(4, (4, 2), (40, 48))
    assert sorted(names) == sorted(want), (names, want)
    assert {n.split()[1] for n in want[3:]} == {"decode", "resume", "compact", "grow", "scatter"}
    table = format_record(record)
    for name in want:
        assert f"rollout {name}"[:40] in table, name
    assert f"{len(want)} programs compiled" in table
    trainer = record["meshes"]["trainer"]
    peak = max(record["programs"], key=lambda p: p["peak_bytes_per_device"])
    assert trainer["peak_bytes_per_device"] == record["peak_bytes_per_device"] == peak["peak_bytes_per_device"]
    assert trainer["peak_program"] == f"rollout {peak['name']}"
    weights = next(p for p in record["programs"] if p["name"] == "sampling weights")["memory"]["output"]
    for p in record["programs"]:  # the sampler's copy of the weights, held through every episode program: beside
        if p["name"].split()[0] == "episode" and not p["name"].startswith("episode decode"):  # those not taking it
            # its shards' bytes (the copy program's output size adds a few hundred bytes of tables)
            assert abs(p["beside"]["the sampler's weights"] - weights) < 1024, p["name"]


def test_on_a_tpu_the_episode_resume_rolls_the_stacked_cache_without_a_copy_of_it():
    """XLA:TPU keeps the stacked cache ([L, N, K, S, H]): the resume rolls it a layer at a time in
    place, so its temporaries stay under 1.6 times the cache (its aliased output) at 8 rows (1.2 and
    1.3 times); the whole stack's gather took 2.8 and 3.3 times it here, 2.0 on the 3B layout of
    ``docs/reference/memory.md`` (where the layer roll takes 0.56)."""
    from arlopti_jax.aot.check import check

    config = small_config(**{"loss.kl_coef": 0.0, "rollout.length_aware": True, "rollout.min_rows": 2,
                             "rollout.phase_tokens": 8, "env.name": "calc", "env.turn_tokens": 8,
                             "env.observation_tokens": 4})
    record = check(config, targets.get("v5p-8"), groups=("rollout",))
    resumes = [p for p in record["programs"] if p["name"].startswith("episode resume rows=8 ")]  # the largest:
    assert len(resumes) == 2  # at 4 and 2 rows a fixed megabyte of tables weighs more than the cache
    for p in resumes:
        assert p["memory"]["temp"] < 1.6 * p["memory"]["alias"], (p["name"], p["memory"])


def test_the_update_beside_tool_episodes_counts_the_first_loops_resume():
    """Colocated at k = 1 the update's programs run beside the sampler's second turn: for tool episodes
    that may be the first loop's resume (the state the first loop's size) when no compaction or growth
    follows it, so the largest second state counts it (``copies.overlap``, on programs made here)."""
    import types

    from arlopti_jax.aot import copies
    from arlopti_jax.aot.compiler import SAMPLER_WEIGHTS

    def program(name, output):
        return types.SimpleNamespace(group="rollout", name=name, memory={"output": output})

    plan = types.SimpleNamespace(own_mesh=False, k=1)
    episodes = [program("sampling weights", 100), program("episode decode rows=4 slots=40", 50),
                program("episode resume rows=4 slots=40", 51), program("episode decode rows=2 slots=40", 30),
                program("episode resume rows=2 slots=40", 31)]
    during_logprobs, during_update = copies.overlap(plan, episodes)
    assert during_logprobs == {SAMPLER_WEIGHTS: 100, copies.FIRST_DECODE: 50}
    assert during_update == {SAMPLER_WEIGHTS: 100, copies.SECOND_DECODE: 51}
    single = [program("sampling weights", 100), program("decode rows=4 slots=40", 50),
              program("decode rows=2 slots=40", 30)]
    assert copies.overlap(plan, single)[1] == {SAMPLER_WEIGHTS: 100, copies.SECOND_DECODE: 30}
    assert copies.overlap(plan, single[:2]) == ({SAMPLER_WEIGHTS: 100, copies.FIRST_DECODE: 50}, {})


def _params_per_device(shards: int) -> float:
    """The embedded model's parameters per device over ``shards`` fsdp devices, counted from its shape:
    every weight split, except the norms and the attention biases (no dimension that fsdp shards)."""
    from arlopti_jax.embedded.start_point import SCALES, model_config

    cfg = model_config(SCALES["cpu"], SCALES["cpu"]["vocab_size"])
    replicated = (2 * cfg.num_layers + 1) * cfg.hidden_size + cfg.num_layers * (
        cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return (cfg.num_params() - replicated) / shards + replicated


def test_colocated_k1_keeps_a_copy_per_version_and_the_sampler_state_beside_the_update():
    """8 H100s colocated at max_staleness 1, float32 weights, no KL: the step copies its version
    (``sampler_copy``) and checks the copy (``fingerprint`` of each side), and 2 copies (k + 1) of the
    float32 weights stay resident beside the parameters and AdamW state: 5 x 4 bytes per parameter
    per device, counted from the model's shape. pi_old is the trainer's pass (the only log-prob pass,
    with the KL off). The sampler takes the first turn: the log-prob passes run beside its copy of the
    weights and its first decode loop's state (4 rows a device, the first phase's slots), the update's
    programs beside its second loop's, the largest it can be (the 4 rows grown to the second phase's
    slots, not 2 rows compacted in the first phase's)."""
    from arlopti_jax.aot import copies
    from arlopti_jax.aot.check import check

    config = small_config(**{"loss.kl_coef": 0.0, "model.unroll_layers": False, "rollout.max_staleness": 1,
                             "model.dtype": "bfloat16", "rollout.length_aware": True, "rollout.min_rows": 2,
                             "rollout.phase_tokens": 8})
    record = check(config, targets.get("h100x8"))
    per_device = _params_per_device(8)
    programs = record["programs"]
    sync = [(p["name"], p["runs"]) for p in programs if p["group"] == "sync"]
    assert sync == [("sampler_copy", ["the version's copy"]), ("fingerprint", ["what the trainer sent"]),
                    ("fingerprint", ["the sampler's copy"])]
    assert [p["runs"] for p in programs if p["group"] == "logprobs"] == [["pi_old"]]
    trainer = record["meshes"]["trainer"]
    assert list(record["meshes"]) == ["trainer"] and record["copies"]["versions"] == 2
    assert 0 <= trainer["resident_bytes_per_device"] - 20 * per_device < 64  # + AdamW's scalars
    assert trainer["resident"]["copies of 2 policy versions"] == 8 * per_device
    copy = next(p for p in programs if p["name"] == "sampler_copy")  # the second copy is its output
    assert copy["resident"] == trainer["resident_bytes_per_device"] - 4 * per_device
    rollout = {p["name"]: p for p in programs if p["group"] == "rollout"}
    first, second = (rollout[f"decode rows=4 slots={32 + end}"]["memory"]["output"] for end in (8, 16))
    assert rollout["decode rows=2 slots=40"]["memory"]["output"] < second
    weights = {"the sampler's weights": rollout["sampling weights"]["memory"]["output"]}
    for p in programs:
        if p["group"] == "logprobs":
            assert p["beside"] == {**weights, copies.FIRST_DECODE: first}, p
        if p["group"] == "update":
            assert p["beside"] == {**weights, copies.SECOND_DECODE: second}, p
        m = p["memory"]
        assert p["peak_bytes_per_device"] == (p["resident"] - p["resident_args"] + sum(p["beside"].values())
                                              + m["argument"] + m["output"] - m["alias"] + m["temp"])
        assert p["peak_bytes_per_device"] >= 20 * per_device + sum(p["beside"].values())
    assert trainer["peak_bytes_per_device"] == max(p["peak_bytes_per_device"] for p in programs)


def test_split_meshes_compile_each_side_with_its_own_resident_state():
    """8 H100s as 4 + 4 (``rollout.devices=4``, k = 1, float32 weights and bfloat16 compute): the weight
    sync casts on the trainer's 4 (``sampler_cast``), checks what it sent there and what arrived on
    the sampler's 4; the rollouts compile there with k + 1 = 2 copies resident, each whole in
    bfloat16 (the sampler's mesh is data=4), counted here from the model's shape. The cast copy's
    transfer is not waited for, so it counts beside the trainer's log-prob (and update) programs."""
    from arlopti_jax.aot import copies
    from arlopti_jax.aot.check import check

    config = small_config(**{"loss.kl_coef": 0.0, "model.unroll_layers": False, "model.dtype": "bfloat16"})
    config.rollout.devices, config.rollout.max_staleness, config.train.micro_batch = 4, 1, 4
    record = check(config, targets.get("h100x8"), groups=("sync", "rollout", "logprobs"))
    trainer, sampler = record["meshes"]["trainer"], record["meshes"]["sampler"]
    assert (trainer["devices"], trainer["mesh"]) == (4, {"data": 1, "fsdp": 4, "tensor": 1})
    assert (sampler["devices"], sampler["mesh"]) == (4, {"data": 4, "fsdp": 1, "tensor": 1})
    whole = 2 * _params_per_device(1)  # bfloat16
    (transfer,) = record["copies"]["transfers"]
    assert transfer["bytes"] == transfer["bytes_per_sampler_device"] == whole
    assert record["copies"]["versions"] == 2 and sampler["resident"] == {"copies of 2 policy versions": 2 * whole}
    programs = record["programs"]
    sync = [(p["mesh"], p["name"]) for p in programs if p["group"] == "sync"]
    assert sync == [("trainer", "sampler_cast"), ("trainer", "fingerprint"), ("sampler", "fingerprint")]
    cast = 2 * _params_per_device(4)
    for p in programs:
        assert p["mesh"] == ("sampler" if p["group"] == "rollout" or p["runs"] == ["the sampler's copy"]
                             else "trainer")
        if p["group"] == "logprobs":
            assert p["beside"] == {copies.IN_FLIGHT: pytest.approx(cast, abs=1024)}, p  # + the output's tables
    start = next(p for p in programs if p["name"].startswith("start"))
    m = start["memory"]
    assert start["peak_bytes_per_device"] == (2 * whole + start["beside"]["the sampler's weights"] + m["argument"]
                                              + m["output"] - m["alias"] + m["temp"])
    for name, mesh in record["meshes"].items():
        assert mesh["peak_bytes_per_device"] == max(p["peak_bytes_per_device"] for p in programs if p["mesh"] == name)


class _Collector:
    """A stand-in for ``rl/collect.Collector``: samples nothing (the copies are what is under test)."""

    def steps(self, params, iterator, key):
        return "batch"
        yield


class _Prompts:
    def state_dict(self):
        return {"epoch": 0}


@pytest.mark.parametrize("devices, k, dtype", [(0, 1, "float32"), (4, 1, "bfloat16"), (4, 0, "float32"),
                                               (0, 2, "bfloat16")],
                         ids=["colocated-k1", "split-k1-cast", "split-k0", "colocated-k2"])
def test_the_copies_aot_lists_are_the_programs_the_sampling_loop_compiles(devices, k, dtype):
    """The sampling loop itself (``rl/pipeline.py``'s ``Pipeline``, a stand-in collector) run for 5
    steps on this machine's 8 devices with the run's parameter shapes: the programs it compiles to copy
    and check each version are those ``aot --target=local`` lists for the config (by name, each as
    often), and the most copies it holds at once are the versions aot counts resident."""
    import collections

    import jax
    import numpy as np

    from arlopti_jax.aot.check import check, prepare
    from arlopti_jax.models import abstract_params, lora, param_shardings
    from arlopti_jax.rl import pipeline
    from arlopti_jax.runtime import compiles
    from arlopti_jax.store.metrics import Timer

    config = small_config(**{"model.unroll_layers": False, "model.dtype": dtype, "rollout.max_staleness": k})
    config.rollout.devices, config.train.micro_batch = devices, 4 if devices else 8
    target = targets.get("local")
    record = check(config, target, groups=("sync",))
    listed = collections.Counter(p["name"] for p in record["programs"])
    layout, (cfg, *_) = prepare(config, target)
    mesh, sampler_mesh = layout.mesh, layout.sampler_mesh
    zeros = lambda shardings: jax.tree.map(lambda a, sh: jax.device_put(np.zeros(a.shape, a.dtype), sh),
                                           abstract_params(cfg), shardings)
    trained, frozen = lora.trainable(cfg, zeros(param_shardings(cfg, mesh)))
    shardings = None if sampler_mesh is None else lora.trainable(cfg, param_shardings(cfg, sampler_mesh))[0]
    loop = pipeline.Pipeline(_Collector(), Timer(), _Prompts(), jax.random.key(0), k, 5, frozen, shardings,
                             pipeline.sync_dtype(cfg) if shardings is not None else None)
    log = compiles.watch()
    names = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(trained)]
    compiled, most = [], 0
    mark = log.programs
    loop.snapshot(0, trained)
    compiled += log.since(mark)
    loop.start(0)
    for step in range(5):
        mark = log.programs
        loop.advance(step, trained)
        compiled += log.since(mark)
        most = max(most, len(loop.snapshots))
        loop.take(step)
        pipeline.run_together(loop.ahead(step))
        loop.verify(step, names)
        loop.release(step + 1)
    assert collections.Counter(r.name[4:-1] for r in compiled) == listed, (compiled, listed)
    assert most == record["copies"]["versions"] == (k + 1 if k or devices else 0)


def test_with_several_processes_the_sync_gathers_each_array_whole_on_a_trainer_device():
    """v5p-64 (8 hosts) as 16 + 16, k = 1, bfloat16 compute: the weight sync casts, then gathers every
    array a trainer chip holds a part of whole onto it (``whole_on_own_mesh``: the weights in bfloat16
    but the norms and biases, which are whole already, counted from the model's shape), then checks
    what it sent; that whole copy and the cast one count beside the trainer's log-prob pass, since
    nothing waits for their transfer."""
    from arlopti_jax.aot import copies
    from arlopti_jax.aot.check import check

    config = small_config(**{"model.unroll_layers": False, "model.dtype": "bfloat16", "rollout.max_staleness": 1})
    config.rollout.devices, config.train.micro_batch = 16, 16
    record = check(config, targets.get("v5p-64"), groups=("sync", "logprobs"))
    assert record["meshes"]["trainer"]["processes"] == record["meshes"]["sampler"]["processes"] == 8
    programs = {(p["mesh"], p["name"]): p for p in record["programs"]}
    assert list(programs) == [("trainer", "sampler_cast"), ("trainer", "whole_on_own_mesh"),
                              ("trainer", "fingerprint"), ("sampler", "fingerprint"), ("trainer", "log-probs 16x64")]
    whole = 2 * 2 * (_params_per_device(1) - _params_per_device(2))  # bfloat16: every parameter but the whole ones
    gathered = programs[("trainer", "whole_on_own_mesh")]["memory"]["output"]
    assert 0 <= gathered - whole < 1024, (gathered, whole)
    cast = programs[("trainer", "sampler_cast")]["memory"]["output"]
    assert programs[("trainer", "log-probs 16x64")]["beside"] == {copies.IN_FLIGHT: cast + gathered}
    assert programs[("trainer", "fingerprint")]["beside"] == {copies.IN_FLIGHT: pytest.approx(gathered, abs=1024)}
    assert record["copies"]["transfers"][0]["from"] == "each array whole on a trainer device"


def test_sampler_hosts_sync_each_shard_to_its_mirror_and_both_sides_keep_the_copies():
    """v5p-32 (4 hosts) with ``rollout.hosts=2``: hosts 0-1 train on 8 chips, 2-3 sample on a mesh that
    mirrors theirs (fsdp=8). The sync casts (its output kept by the trainer: a checkpoint holds the
    versions in flight), checks each side, gathers nothing, and moves each chip's shard to its mirror;
    k + 1 = 2 bfloat16 copies, sharded 8 ways, are resident on each mesh, counted from the model's
    shape."""
    from arlopti_jax.aot.check import check

    config = small_config(**{"model.unroll_layers": False, "model.dtype": "bfloat16", "rollout.max_staleness": 1,
                             "rollout.hosts": 2, "train.micro_batch": 8})
    record = check(config, targets.get("v5p-32"), groups=("sync", "logprobs"))
    trainer, sampler = record["meshes"]["trainer"], record["meshes"]["sampler"]
    assert trainer["mesh"] == sampler["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    assert trainer["processes"] == sampler["processes"] == 2
    assert [(p["mesh"], p["name"]) for p in record["programs"] if p["group"] == "sync"] == [
        ("trainer", "sampler_cast"), ("trainer", "fingerprint"), ("sampler", "fingerprint")]
    shard = 2 * _params_per_device(8)  # bfloat16
    assert trainer["resident"]["copies of 2 policy versions"] == sampler["resident"]["copies of 2 policy versions"]
    assert sampler["resident"]["copies of 2 policy versions"] == pytest.approx(2 * shard, rel=0.01)  # + tile padding
    (transfer,) = record["copies"]["transfers"]
    assert transfer["bytes_per_sampler_device"] == sampler["resident"]["copies of 2 policy versions"] // 2
    assert all(not p["beside"] for p in record["programs"])  # the cast copy is kept: resident, not in flight
