"""Length-aware decoding (phases with a growing KV cache, finished rows compacted away on each
device) gives the dense sampler's tokens and log-probs, greedy and sampled, on one device, on
8-device meshes and on 2 processes; forced EOS lengths (``stop_at``) give rollouts that look like
real ones."""


import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import length_aware_fixtures as fx
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.models import init_params, load_pretrained
from arlopti_jax.models import token_logprobs as _token_logprobs
from arlopti_jax.rollout import Sampler, SamplingConfig
from arlopti_jax.rollout.programs import row_fields
from hf_fixtures import write_hf_model
from reference_sampler import reference_generate
from two_processes import launch_two, logs_of

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42, 43]]
N, R, EOS = 4, 16, (2,)
# forced response lengths of the 16 rows: early, mid-phase, at phase ends (4, 8), at R, and never
STOPS = np.array([3, 1, 99, 6, 2, 8, 4, 99, 5, 12, 2, 16, 7, 3, 10, 1])
PHASES = dict(phase_tokens=4, min_rows=1)  # phases of 4, 8, 16 response slots; compact down to 1 row
token_logprobs = jax.jit(_token_logprobs, static_argnums=0, static_argnames="temperature")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("length_aware") / "ckpt", kind="qwen2", tied=True)


@pytest.fixture(scope="module")
def policy(folder):
    mesh = shd.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    cfg, params = load_pretrained(folder, mesh=mesh)
    return cfg, params, Sampler(cfg, mesh)


def _config(length_aware: bool, **kw) -> SamplingConfig:
    return SamplingConfig(**{"max_response_len": R, "eos_ids": EOS, "length_aware": length_aware, **PHASES, **kw})


def _assert_same(got, want):
    np.testing.assert_array_equal(got.response_ids, want.response_ids)
    np.testing.assert_array_equal(got.response_mask, want.response_mask)
    np.testing.assert_array_equal(got.truncated, want.truncated)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


@pytest.mark.parametrize("kw", [dict(greedy=True), dict(temperature=0.8), dict(temperature=1.2, top_p=0.9)],
                         ids=["greedy", "sampled", "top_p"])
def test_length_aware_equals_dense(policy, kw):
    cfg, params, sampler = policy
    key = jax.random.key(11)
    dense = sampler.generate(params, PROMPTS, N, key, _config(False, **kw), stop_at=STOPS)
    batch = sampler.pad_prompts(PROMPTS, _config(True, **kw))
    done = sampler.decode(params, sampler.start(params, batch, N, key, _config(True, **kw), STOPS), key,
                          _config(True, **kw))
    got = sampler.generate(params, PROMPTS, N, key, _config(True, **kw), stop_at=STOPS)
    _assert_same(got, dense)
    assert got.decode_steps == dense.decode_steps == R
    # the schedule really compacted and grew: rows per device fell, cache slots rose by phase
    rows, slots = [r for r, _, _ in done.loops], [s for _, s, _ in done.loops]
    p = batch.ids.shape[1]
    assert rows[0] == len(PROMPTS) * N and rows[-1] < rows[0] and rows == sorted(rows, reverse=True)
    assert slots[0] == p + 4 and slots[-1] == p + R and set(slots) == {p + 4, p + 8, p + 16}
    # the forced lengths hold on both paths (a sampled EOS may end a row sooner)
    assert np.all(got.lengths <= np.minimum(STOPS, R)) and (got.lengths == np.minimum(STOPS, R)).mean() > 0.5
    # cost accounting: the dense loop runs every row for R steps over the whole cache; the
    # length-aware loops run fewer row steps, never fewer than the tokens they produced
    rows = len(PROMPTS) * N
    assert dense.decode_row_steps == rows * R and dense.decode_attended_keys == rows * R * (p + R)
    assert got.lengths.sum() <= got.decode_row_steps < dense.decode_row_steps
    assert got.decode_attended_keys < dense.decode_attended_keys


def test_forced_lengths_look_like_real_responses(policy):
    cfg, params, sampler = policy
    key, sampling = jax.random.key(3), _config(True, temperature=0.9)
    free = sampler.generate(params, PROMPTS, N, key, sampling)  # no forcing: sampled EOS only
    roll = sampler.generate(params, PROMPTS, N, key, sampling, stop_at=STOPS)
    want = np.minimum(free.lengths, STOPS)  # per-row noise: the draws before a forced EOS are the same
    np.testing.assert_array_equal(roll.lengths, want)
    forced = STOPS <= free.lengths
    assert forced.sum() >= 8 and (~forced).any()
    rows = np.arange(len(want))
    assert np.all(roll.response_ids[rows, want - 1][forced] == EOS[0])  # the EOS is kept, in the mask
    np.testing.assert_array_equal(roll.response_mask, (np.arange(R)[None] < want[:, None]).astype(np.int32))
    np.testing.assert_array_equal(roll.truncated, (want == R) & ~np.isin(roll.response_ids[rows, R - 1], EOS))
    assert not roll.truncated[forced].any()
    live = roll.response_mask.astype(bool)
    np.testing.assert_array_equal(roll.response_ids[live & (np.arange(R)[None] < want[:, None] - 1)],
                                  free.response_ids[live & (np.arange(R)[None] < want[:, None] - 1)])
    # the recorded log-probs (the forced EOS's included) are the model's, from a teacher-forced pass
    batch = roll.train_batch()
    lp, _ = token_logprobs(cfg, params, jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"]),
                           temperature=0.9)
    resp = batch["response_mask"].astype(bool)
    np.testing.assert_allclose(batch["old_logprobs"][resp], np.asarray(lp)[resp], atol=1e-4)


@pytest.mark.parametrize("layout", [{"fsdp": 4, "tensor": 2}, {"data": 2, "fsdp": 4}],
                         ids=lambda l: "x".join(f"{k}{v}" for k, v in l.items()))
def test_length_aware_on_8_devices_equals_dense_on_one(folder, policy, layout):
    kw = dict(temperature=0.8, top_k=20)
    want = policy[2].generate(policy[1], PROMPTS, N, jax.random.key(8), _config(False, **kw), stop_at=STOPS)
    mesh = shd.make_mesh(layout)
    cfg, params = load_pretrained(folder, mesh=mesh)
    sampler = Sampler(cfg, mesh)
    sampling = _config(True, **kw)
    batch = sampler.pad_prompts(PROMPTS, sampling)
    done = sampler.decode(params, sampler.start(params, batch, N, jax.random.key(8), sampling, STOPS),
                          jax.random.key(8), sampling)
    assert (done.loops[0][0] == batch.ids.shape[0] * N // shd.batch_divisor(mesh)  # per device
            and done.loops[-1][0] < done.loops[0][0])
    got = sampler.generate(params, PROMPTS, N, jax.random.key(8), sampling, stop_at=STOPS)
    _assert_same(got, want)


@pytest.mark.parametrize("kw", [dict(greedy=True), dict(temperature=0.8)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("layout", [{}, {"data": 2, "fsdp": 4}], ids=["1device", "data2xfsdp4"])
def test_equals_a_cache_free_reference_with_straight_line_layers(folder, policy, kw, layout):
    """Length-aware decoding (the decoder's loop over layers, the cache compacted and grown as
    one array pair) draws the tokens and log-probs of ``reference_generate`` (the whole
    sequence through straight-line layers at every position, no cache), greedy and seeded,
    on one device and on 8."""
    cfg, params, _ = policy
    sampling = _config(True, **kw)
    tokens, logprobs, mask = reference_generate(cfg, params, PROMPTS, N, jax.random.key(12), sampling, STOPS)
    mesh = shd.make_mesh(layout) if layout else policy[2].mesh
    if layout:
        cfg, params = load_pretrained(folder, mesh=mesh)
    roll = Sampler(cfg, mesh).generate(params, PROMPTS, N, jax.random.key(12), sampling, stop_at=STOPS)
    assert len(roll.decode_loops) > 3  # compacted and grew
    np.testing.assert_array_equal(roll.response_ids, tokens)
    np.testing.assert_array_equal(roll.response_mask, mask)
    np.testing.assert_allclose(roll.logprobs, logprobs, atol=1e-4)


def test_compaction_stays_on_each_device(folder):
    """Compacting, growing and saving rows moves no data between devices: no collective in the
    compiled compact (which also scatters the previous rows into the outputs), grow and final
    scatter."""
    mesh = shd.make_mesh({"data": 2, "fsdp": 4})
    cfg, params = load_pretrained(folder, mesh=mesh)
    sampler, sampling = Sampler(cfg, mesh), _config(True)
    state = sampler.start(params, sampler.pad_prompts(PROMPTS, sampling), N, jax.random.key(0), sampling, STOPS)
    out = {name: getattr(state, name) for name in ("tokens", "logprobs", "mask", "finished")}
    with shd.activate(mesh):
        texts = [sampler._compact.lower(state, out, rows=1).compile().as_text(),
                 sampler._grow.lower(state, slots=state.kv_mask.shape[1] + 4).compile().as_text(),
                 sampler._scatter.lower(out, row_fields(state)).compile().as_text()]
    for text in texts:
        assert not [op for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce") if op in text]


def test_compiled_programs_stay_within_the_buckets(policy):
    cfg, params, _ = policy
    sampler = Sampler(cfg, policy[2].mesh)
    sampling = _config(True, min_rows=4)
    rng = np.random.default_rng(0)
    for seed in range(3):
        stops = rng.integers(1, R + 4, size=len(PROMPTS) * N)
        sampler.generate(params, PROMPTS, N, jax.random.key(seed), sampling, stop_at=stops)
    # rows per device in {16, 8, 4} x cache slots in {P+4, P+8, P+16}, at most
    assert sampler._decode._cache_size() <= 3 * 3
    assert sampler._prefill._cache_size() == 1


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu_layout"])
def test_the_schedule_compiled_ahead_is_what_every_generate_runs(policy, gpu, monkeypatch):
    """``Sampler.schedule`` compiled by ``compiles.compile_all`` on one device (where a layout the
    compiler leaves unnamed comes back under several names), with the GPU's per-layer cache too: then
    generates whose responses end early, late, or never, through every compaction and growth they
    meet, compile nothing."""
    from arlopti_jax.rollout import programs
    from arlopti_jax.runtime import compiles

    if gpu:
        monkeypatch.setattr(programs, "per_layer_cache", lambda platform=None: True)
    cfg, params, _ = policy
    sampler = Sampler(cfg, policy[2].mesh)
    sampling = _config(True, temperature=0.9, phase_tokens=8, min_rows=4)  # 16, 8, 4 rows; 8 and 16 slots
    keys = [jax.random.key(seed) for seed in range(3)]
    rng = np.random.default_rng(1)
    stops = [STOPS, np.full(len(STOPS), 99), rng.integers(1, 10, size=len(STOPS))]
    schedule = sampler.schedule(compiles.abstract(params), len(PROMPTS), max(map(len, PROMPTS)), N, sampling,
                                key=compiles.abstract(keys[0]))
    assert sum(p.name.startswith("decode") for p in schedule) == 3 * 2
    log = compiles.watch()
    compiles.compile_all(schedule, context=lambda: shd.activate(sampler.mesh, sampler.rules))
    mark = log.programs
    loops = set()
    for key, stop_at in zip(keys, stops):
        loops.update(sampler.generate(params, PROMPTS, N, key, sampling, stop_at=stop_at).decode_loops)
    assert not log.since(mark), [(r.name, r.shapes[:160]) for r in log.since(mark)]
    assert {rows for rows, _, _ in loops} == {16, 8, 4} and len({slots for _, slots, _ in loops}) == 2


def test_phase_ends_and_invalid_stop_at(policy):
    ends = lambda r, **kw: SamplingConfig(max_response_len=r, **kw).phase_ends()
    assert ends(4096) == (1024, 2048, 4096) and ends(1000) == (256, 512, 1000)  # R / 4, doubling
    assert ends(4097) == (2048, 4097)  # no last phase that would grow the cache by one slot
    assert ends(1000, phase_tokens=512) == (512, 1000) and ends(100, phase_tokens=512) == (100,)
    assert ends(4096, length_aware=False) == (4096,)
    cfg, params, sampler = policy
    gen = lambda stops, **kw: sampler.generate(params, PROMPTS, N, jax.random.key(0), _config(True, **kw),
                                               stop_at=stops)
    with pytest.raises(ValueError, match=r"stop_at must be integers of shape \(16,\)"):
        gen(STOPS[:5])
    with pytest.raises(ValueError, match=r"stop_at\[1\]=0 must be >= 1"):
        gen(np.where(np.arange(16) == 1, 0, STOPS))
    with pytest.raises(ValueError, match="SamplingConfig.eos_ids is empty"):
        gen(STOPS, eos_ids=())
    with pytest.raises(ValueError, match="SamplingConfig.phase_tokens"):
        SamplingConfig(max_response_len=4, phase_tokens=-1)


@pytest.mark.slow  # two processes: minutes on 2 cores; CI runs the slow tests
@pytest.mark.xdist_group("two_processes")  # never beside another two-process test: 4 processes on 2 cores
def test_two_processes_equal_one(tmp_path):
    """2 processes x 4 devices (launch/local.sh): each samples its share of the prompts; the
    length-aware and dense samplers agree there, and the rows equal one process's 8 devices."""
    proc = launch_two([f"--out={tmp_path}"], tmp_path / "logs", 300, module="multiprocess_sampler")
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{logs_of(tmp_path / 'logs')}"
    parts = [np.load(tmp_path / f"process_{i}.npz") for i in (0, 1)]

    mesh = shd.make_mesh({"fsdp": 8})
    params = init_params(fx.MODEL, jax.random.key(0), mesh)
    want = Sampler(fx.MODEL, mesh).generate(params, fx.prompts(), fx.N, jax.random.key(5), fx.sampling(False),
                                            stop_at=fx.stops())
    assert [int(p["start"]) for p in parts] == [0, 4]
    np.testing.assert_array_equal(np.concatenate([p["response_ids"] for p in parts]), want.response_ids)
    np.testing.assert_array_equal(np.concatenate([p["lengths"] for p in parts]), want.lengths)
    np.testing.assert_allclose(np.concatenate([p["logprobs"] for p in parts]), want.logprobs, atol=1e-5)


def _forced_gpu(folder, policy, layout, monkeypatch):
    """A sampler's setting forced to the GPU's layout on the CPU (``programs.per_layer_cache``: the
    weights and KV cache a buffer per layer, the layers straight-line), on one device or the mesh
    ``layout``. Returns (mesh, config, weights, check): ``check(sampler)`` draws with it and asserts
    the tokens and log-probs of the layer loop over stacked arrays, through every phase and
    compaction, and returns the draw."""
    from arlopti_jax.rollout import programs

    kw = dict(temperature=0.8, top_k=20)
    want = policy[2].generate(policy[1], PROMPTS, N, jax.random.key(5), _config(True, **kw), stop_at=STOPS)
    mesh = shd.make_mesh(layout) if layout else policy[2].mesh
    cfg, params = load_pretrained(folder, mesh=mesh) if layout else policy[:2]
    monkeypatch.setattr(programs, "per_layer_cache", lambda platform=None: True)

    def check(sampler):
        got = sampler.generate(params, PROMPTS, N, jax.random.key(5), _config(True, **kw), stop_at=STOPS)
        assert len(got.decode_loops) > 3  # compacted and grew
        _assert_same(got, want)
        return got

    return mesh, cfg, params, check


@pytest.mark.slow  # default-suite budget (10 minutes on 2 cores): CI runs it in the slow pass
@pytest.mark.parametrize("layout", [{}, {"data": 2, "fsdp": 4}], ids=["1device", "data2xfsdp4"])
def test_the_gpu_layout_equals_the_loop(folder, policy, layout, monkeypatch):
    """On a GPU the sampler's weights and KV cache are a buffer per layer and every layer runs
    straight-line. Forced here on the CPU, it draws the tokens and log-probs of the layer loop."""
    mesh, cfg, params, check = _forced_gpu(folder, policy, layout, monkeypatch)
    sampler = Sampler(cfg, mesh)
    layers = sampler.sampling_params(params)["layers"]
    assert isinstance(layers, tuple) and len(layers) == cfg.num_layers
    check(sampler)


@pytest.mark.slow  # default-suite budget (10 minutes on 2 cores): CI runs it in the slow pass
@pytest.mark.parametrize("layout", [{}, {"data": 2, "fsdp": 2, "tensor": 2}], ids=["1device", "data2xfsdp2xtensor2"])
def test_the_gpu_decode_kernel_equals_the_loop(folder, policy, layout, monkeypatch):
    """On a GPU each decode step's attention is one Pallas kernel per layer
    (``models/decode_attention.py``: it writes the step's key and value into the layer's buffer and
    attends over each row's live slots only), per device under the mesh. Forced here on the CPU
    (Pallas' interpret mode), it draws the tokens and log-probs of the layer loop, with rows and kv
    heads split over devices."""
    from arlopti_jax.models import decode_attention as da

    mesh, cfg, params, check = _forced_gpu(folder, policy, layout, monkeypatch)
    traced, kernel = [], da.decode_attention
    monkeypatch.setattr(da, "decode_attention", lambda *a, **k: traced.append(a[4].shape) or kernel(*a, **k))
    got = check(Sampler(cfg.replace(decode_attention="pallas"), mesh))
    # the kernel ran in every layer of every decode program, on one device's share of rows and kv heads
    devices = (mesh.shape["data"] * mesh.shape["fsdp"], mesh.shape["tensor"])
    assert len(traced) == cfg.num_layers * len({loop[:2] for loop in got.decode_loops}) > 0
    assert {shape[1] for shape in traced} == {cfg.num_kv_heads // devices[1]}


@pytest.mark.slow  # default-suite budget (10 minutes on 2 cores): CI runs it in the slow pass
@pytest.mark.parametrize("layout", [{}, {"data": 8}], ids=["1device", "data8"])
def test_the_gpu_fused_products_equal_the_loop(folder, policy, layout, monkeypatch):
    """``model.decode_matmul=pallas``: each decode step's layer is 6 kernels, its four products
    with the RMS norms, the residual adds and silu x up fused in (``models/decode_matmul.py``), on
    each device's rows. Forced here on the CPU (Pallas' interpret mode), it draws the tokens and
    log-probs of the layer loop."""
    from arlopti_jax.models import decode_matmul as dm

    mesh, cfg, params, check = _forced_gpu(folder, policy, layout, monkeypatch)
    traced, kernel = [], dm.fused_matmul
    monkeypatch.setattr(dm, "fused_matmul", lambda x, w, **k: traced.append((x.shape, sorted(k))) or kernel(x, w, **k))
    got = check(Sampler(cfg.replace(decode_attention="pallas", decode_matmul="pallas"), mesh))
    # four products in every layer of every decode program (not the prefill), on one device's rows
    programs_run = len({loop[:2] for loop in got.decode_loops})
    assert len(traced) == 4 * cfg.num_layers * programs_run > 0
    fused = [[name for name in k if name not in ("counters", "eps", "interpret")] for _, k in traced[:4]]
    assert fused == [["norm"], ["residual"], ["norm", "up"], ["residual"]]
    rows = {loop[0] for loop in got.decode_loops}
    assert {x[0] * (8 if layout else 1) for x, _ in traced} == rows


def test_whole_sampler_weights_draw_the_same_and_gather_nothing_per_step(folder, policy):
    """``whole_weights="on"`` on a data x fsdp mesh: the sampler's copy of the weights is whole along
    fsdp (``shd.weights_off_batch_axes``), so its decode loop runs with no all-gather, where the
    trainer's fsdp-split weights need one per weight at every step; the tokens and log-probs are
    those of one device, through every phase and compaction."""
    kw = dict(temperature=0.8, top_k=20)
    want = policy[2].generate(policy[1], PROMPTS, N, jax.random.key(5), _config(True, **kw), stop_at=STOPS)
    mesh = shd.make_mesh({"data": 2, "fsdp": 4})
    cfg, params = load_pretrained(folder, mesh=mesh)
    split, whole = Sampler(cfg, mesh, whole_weights="off"), Sampler(cfg, mesh, whole_weights="on")
    assert not split.whole_weights and whole.whole_weights
    copy = whole.sampling_params(params)
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(copy))
    assert not all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(split.sampling_params(params)))
    got = whole.generate(params, PROMPTS, N, jax.random.key(5), _config(True, **kw), stop_at=STOPS)
    assert len(got.decode_loops) > 3  # compacted and grew
    _assert_same(got, want)

    def decode_text(sampler):
        sampling = _config(False, **kw)
        batch = sampler.pad_prompts(PROMPTS, sampling)
        state = sampler.start(params, batch, N, jax.random.key(5), sampling, STOPS)
        temperature, top_p, eos, greedy = sampler._traced_settings(sampling)
        with shd.activate(sampler.mesh, sampler.rules):
            return sampler._decode.lower(sampler.sampling_params(params), state, jax.random.key(5), temperature,
                                         top_p, eos, np.int32(0), kernel=sampling.kernel_key,
                                         greedy=greedy).compile().as_text()

    # all-gathers of a weight (a stacked leaf or one layer's slice of it); XLA:CPU also gathers the
    # rows' logits for the draw either way, under a name that changes between jax releases
    weights = {shape for leaf in jax.tree.leaves(params) for shape in (leaf.shape, leaf.shape[1:])}

    def gathers(text):
        found = re.findall(r"= \w+\[([\d,]*)\]\{[\d,]*\} all-gather\(", text)
        return [shape for shape in (tuple(int(d) for d in dims.split(",") if d) for dims in found) if shape in weights]

    assert len(gathers(decode_text(split))) >= cfg.num_layers and gathers(decode_text(whole)) == []


def test_whole_weights_auto_follows_the_platform_the_split_and_the_memory():
    """"auto": whole weights where an fsdp axis splits them on a GPU or TPU and the copy takes at
    most an eighth of a device's memory (3B in bfloat16: 6.2 GB; 7B: 15.2 GB); never on a CPU or
    where no batch axis splits them."""
    from arlopti_jax.aot import shapes, targets
    from arlopti_jax.models import ModelConfig
    from arlopti_jax.rollout.sampler import _whole_weights

    size = lambda name: ModelConfig.from_hf_dict(shapes.qwen25(name), dtype="bfloat16")
    gpus = list(targets.devices(targets.get("h100x8")))
    h100 = targets.get("h100x8").hbm_bytes
    on = lambda cfg, mesh, memory, setting="auto": _whole_weights(cfg, mesh, shd.DEFAULT_RULES, setting, memory)
    fsdp8 = shd.make_mesh({"fsdp": 8}, devices=gpus)
    assert on(size("3b"), fsdp8, h100) and not on(size("7b"), fsdp8, h100)  # 7% and 18% of an H100
    assert not on(size("3b"), fsdp8, 16 * 2**30)  # a v5e chip
    assert not on(size("3b"), shd.make_mesh({"fsdp": 1, "tensor": 8}, devices=gpus), h100)  # no fsdp split
    assert not on(size("3b"), shd.make_mesh({"fsdp": 8}), h100)  # the CPU
    assert on(size("7b"), fsdp8, h100, "on") and not on(size("3b"), fsdp8, h100, "off")
    with pytest.raises(ValueError, match=r"whole_weights='yes': allowed \['auto', 'on', 'off'\]"):
        on(size("3b"), fsdp8, h100, "yes")
    whole = dict(shd.weights_off_batch_axes(shd.DEFAULT_RULES))
    assert whole["embed"] is None and whole["mlp"] == "tensor" and whole["act_batch"] == shd.BATCH_AXES


@pytest.mark.slow  # default-suite budget (10 minutes on 2 cores): CI runs it in the slow pass
def test_the_tpu_attention_equals_the_cpu_one(policy, monkeypatch):
    """On a TPU the sampler's attention reads the stacked cache before writing the call's own
    keys (``decode.read_before_write``: the cache's slots and the call's keys scored apart, one
    softmax over both). Forced here on the CPU, it draws the tokens and log-probs of the
    write-then-read attention the CPU runs, through every phase and compaction."""
    from arlopti_jax.models import decode

    kw = dict(temperature=0.8, top_k=20)
    want = policy[2].generate(policy[1], PROMPTS, N, jax.random.key(5), _config(True, **kw), stop_at=STOPS)
    monkeypatch.setattr(decode, "read_before_write", lambda: True)
    sampler = Sampler(policy[0], policy[2].mesh)  # programs traced anew
    got = sampler.generate(policy[1], PROMPTS, N, jax.random.key(5), _config(True, **kw), stop_at=STOPS)
    assert len(got.decode_loops) > 3  # compacted and grew
    _assert_same(got, want)
