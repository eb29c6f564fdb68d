"""The sampler: parity with transformers' greedy generate, log-probs equal to a teacher-forced
pass, EOS / truncation bookkeeping, top-k / top-p support, determinism, early exit, and
sharded generation on 8 fake devices equal to unsharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from arlopti_jax.runtime import sharding as shd
from arlopti_jax.models import load_pretrained, param_shardings
from arlopti_jax.models import logits as _logits
from arlopti_jax.models import token_logprobs as _token_logprobs
from arlopti_jax.models import ModelConfig
from arlopti_jax.rollout import Sampler, SamplingConfig, bucket
from arlopti_jax.rollout.sampler import batch_rows, eos_width
from hf_fixtures import VOCAB, write_hf_model
from reference_sampler import reference_generate

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42, 43]]
R = 12
N = 2  # samples per prompt: one value keeps the number of compiled programs small
logits = jax.jit(_logits, static_argnums=0)
token_logprobs = jax.jit(_token_logprobs, static_argnums=0, static_argnames="temperature")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("rollout") / "ckpt", kind="qwen2", tied=False)


@pytest.fixture(scope="module")
def policy(folder):
    mesh = shd.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    cfg, params = load_pretrained(folder, mesh=mesh)
    return cfg, params, Sampler(cfg, mesh)


def _gen(policy, n=N, seed=0, prompts=PROMPTS, **kw):
    cfg, params, sampler = policy
    return sampler.generate(params, prompts, n, jax.random.key(seed), SamplingConfig(**{"max_response_len": R, **kw}))


def _pick_eos(tokens, keep_row):
    """Two EOS ids: ones that rows other than ``keep_row`` reach after position 0 (``keep_row``
    never does), topped up with an id no row produces."""
    banned, picks = set(tokens[keep_row].tolist()), []
    for row in range(len(tokens)):
        fresh = [int(t) for t in tokens[row, 1:] if row != keep_row and t not in banned and t not in picks]
        picks += fresh[:1]
    assert picks, tokens
    unused = sorted(set(range(3, VOCAB)) - set(tokens.ravel().tolist()))
    return tuple(picks[:2]) if len(picks) >= 2 else (picks[0], unused[0])


def _first_eos(tokens, eos_ids):
    hits = np.isin(tokens, eos_ids)
    return np.where(hits.any(1), hits.argmax(1), -1)


def test_greedy_matches_transformers_generate(folder, policy):
    import torch
    import transformers

    free = _gen(policy, greedy=True).response_ids[::N]  # one row per prompt (greedy rows agree)
    eos = _pick_eos(free, keep_row=2)  # some rows stop early, row 2 runs to R
    ours = _gen(policy, greedy=True, eos_ids=eos)
    ids_ours, lengths, truncated = ours.response_ids[::N], ours.lengths[::N], ours.truncated[::N]

    width = max(map(len, PROMPTS))
    ids = np.zeros((len(PROMPTS), width), np.int64)
    mask = np.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                             max_new_tokens=R, pad_token_id=0, eos_token_id=list(eos)).numpy()[:, width:]
    gen = out.shape[1]
    np.testing.assert_array_equal(ids_ours[:, :gen], out)
    assert np.all(ids_ours[:, gen:] == 0)
    stops = _first_eos(out, eos)
    assert (stops >= 0).any() and (stops < 0).any()  # both ways of ending are exercised
    np.testing.assert_array_equal(lengths, np.where(stops >= 0, stops + 1, R))
    np.testing.assert_array_equal(truncated, stops < 0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_teacher_forced_pass(policy, temperature):
    cfg, params, _ = policy
    roll = _gen(policy, seed=1, temperature=temperature, eos_ids=(2, 7))
    batch = roll.train_batch()
    lp, _ = token_logprobs(cfg, params, jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"]),
                           temperature=temperature)
    resp = batch["response_mask"].astype(bool)
    np.testing.assert_allclose(batch["old_logprobs"][resp], np.asarray(lp)[resp], atol=1e-4)
    assert np.all(batch["old_logprobs"][~resp] == 0)
    p = roll.prompt_ids.shape[1]
    assert batch["input_ids"].shape == (len(PROMPTS) * N, p + R)
    assert np.all(batch["response_mask"][:, :p] == 0)
    np.testing.assert_array_equal(batch["attention_mask"][:, :p], roll.prompt_mask)


def test_eos_padding_lengths_and_truncation(policy):
    free = _gen(policy, seed=2)
    assert free.truncated.all() and np.all(free.lengths == R) and np.all(free.response_mask == 1)
    eos = _pick_eos(free.response_ids, keep_row=5)
    roll = _gen(policy, seed=2, eos_ids=eos, pad_id=0)
    stops = _first_eos(free.response_ids, eos)
    assert (stops >= 0).any() and (stops < 0).any()
    want_len = np.where(stops >= 0, stops + 1, R)
    np.testing.assert_array_equal(roll.lengths, want_len)
    np.testing.assert_array_equal(roll.truncated, stops < 0)
    cols = np.arange(R)[None, :]
    live = cols < want_len[:, None]
    np.testing.assert_array_equal(roll.response_mask, live.astype(np.int32))
    # same key: identical up to and including the EOS, pad and zero log-prob after it
    np.testing.assert_array_equal(roll.response_ids[live], free.response_ids[live])
    np.testing.assert_allclose(roll.logprobs[live], free.logprobs[live], atol=1e-6)
    assert np.all(roll.response_ids[~live] == 0) and np.all(roll.logprobs[~live] == 0)
    assert roll.responses()[0] == free.response_ids[0, : want_len[0]].tolist()
    np.testing.assert_array_equal(roll.group_ids, np.repeat(np.arange(len(PROMPTS)), N))


def test_decode_loop_exits_early_when_all_finished(policy):
    free = _gen(policy, greedy=True)
    assert free.decode_steps == R
    eos = tuple(sorted(set(free.response_ids[:, 1].tolist())))  # every row hits one by position 1
    roll = _gen(policy, greedy=True, eos_ids=eos)
    assert roll.decode_steps <= 2 < R
    assert np.all(roll.lengths <= 2) and not roll.truncated.any()
    assert roll.response_ids.shape == (len(PROMPTS) * N, R)


def test_seed_determinism_and_independent_group_samples(policy):
    a, b, c = _gen(policy, seed=3), _gen(policy, seed=3), _gen(policy, seed=4)
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert (a.response_ids != c.response_ids).any()
    # the group shares one prefill, yet its samples draw their first token independently
    firsts = a.response_ids[:, 0].reshape(len(PROMPTS), N)
    assert any(len(set(row)) > 1 for row in firsts.tolist())
    # greedy samples of one group are identical
    g = _gen(policy, greedy=True).response_ids.reshape(len(PROMPTS), N, R)
    assert np.all(g == g[:, :1])


def _full_logprobs(policy, roll, temperature=1.0):
    """log_softmax(logits / T) predicting each response token: [N, R, V]."""
    cfg, params, _ = policy
    batch = roll.train_batch()
    lg = np.asarray(logits(cfg, params, jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])))
    p = roll.prompt_ids.shape[1]
    return np.asarray(jax.nn.log_softmax(lg[:, p - 1: p - 1 + R] / temperature, axis=-1))


@pytest.mark.slow  # default-suite budget (10 minutes on 2 cores): CI runs it in the slow pass
def test_top_k_and_top_p_restrict_the_support(policy):
    greedy = _gen(policy, greedy=True)
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):
        roll = _gen(policy, seed=5, **kw)
        np.testing.assert_array_equal(roll.response_ids, greedy.response_ids)
        np.testing.assert_allclose(roll.logprobs, greedy.logprobs, atol=1e-6)

    k = 4
    roll = _gen(policy, seed=6, top_k=k)
    full = _full_logprobs(policy, roll)
    picked = np.take_along_axis(full, roll.response_ids[..., None], -1)[..., 0]
    rank = (full > picked[..., None]).sum(-1)
    assert rank.max() < k and (rank > 0).any()  # inside the top k, and not just greedy
    np.testing.assert_allclose(roll.logprobs, picked, atol=1e-4)  # full-distribution log-probs

    roll = _gen(policy, seed=7, top_p=0.3, temperature=0.8)
    full = _full_logprobs(policy, roll, temperature=0.8)
    picked = np.take_along_axis(full, roll.response_ids[..., None], -1)[..., 0]
    probs = np.exp(full)
    mass_before = np.where(full > picked[..., None], probs, 0).sum(-1)  # more likely tokens' mass
    assert mass_before.max() < 0.3 + 1e-5 and (mass_before > 0).any()


@pytest.mark.parametrize("layout", [{"fsdp": 4, "tensor": 2}, {"data": 2, "fsdp": 4}],
                         ids=lambda l: "x".join(f"{k}{v}" for k, v in l.items()))
def test_sharded_generation_equals_unsharded(folder, policy, layout):
    sampling = SamplingConfig(max_response_len=R, temperature=0.8, top_k=20, eos_ids=(2, 7))
    want = policy[2].generate(policy[1], PROMPTS, 2, jax.random.key(8), sampling)

    mesh = shd.make_mesh(layout)
    cfg, params = load_pretrained(folder, mesh=mesh)
    sampler = Sampler(cfg, mesh)
    got = sampler.generate(params, PROMPTS, 2, jax.random.key(8), sampling)
    np.testing.assert_array_equal(got.response_ids, want.response_ids)
    np.testing.assert_array_equal(got.response_mask, want.response_mask)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)

    # the KV cache: batch over data x fsdp, kv heads over tensor
    batch = sampler.pad_prompts(PROMPTS, sampling)
    state = sampler.start(params, batch, 2, jax.random.key(8), sampling)
    k = state.cache["k"]
    assert k.sharding.is_equivalent_to(sampler.cache_sharding, k.ndim)
    assert sampler.cache_sharding.spec == P(None, ("data", "fsdp"), "tensor", None, None)
    layers, rows, heads, slots, dim = k.shape
    assert k.addressable_shards[0].data.shape == (layers, rows // shd.batch_divisor(mesh),
                                                  heads // mesh.shape["tensor"], slots, dim)
    assert state.tokens.addressable_shards[0].data.shape[0] == rows // shd.batch_divisor(mesh)

    # the sampler reads the trainer's params in their own shardings (no gather, no copy)
    with shd.activate(mesh):
        ids = jax.device_put(batch.ids, shd.batch_sharding(mesh))
        compiled = sampler._prefill.lower(params, ids, ids).compile()
    want_sh = param_shardings(cfg, mesh)
    got_sh = compiled.input_shardings[0][0]
    jax.tree_util.tree_map(lambda g, w, x: None if g.is_equivalent_to(w, x.ndim) else pytest.fail(f"{g} != {w}"),
                           got_sh, want_sh, params)
    q = params["layers"]["attn"]["q_kernel"]
    assert q.addressable_shards[0].data.size == q.size // (mesh.shape["fsdp"] * mesh.shape["tensor"])


@pytest.mark.parametrize("kw", [dict(greedy=True), dict(temperature=0.8, top_k=20)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("layout", [{}, {"fsdp": 4, "tensor": 2}], ids=["1device", "fsdp4xtensor2"])
def test_equals_a_cache_free_reference_with_straight_line_layers(folder, policy, kw, layout):
    """The sampler (the decoder's loop over layers, a KV cache, one while loop) draws the tokens
    and log-probs of ``reference_generate`` (the whole sequence through straight-line layers
    at every position, no cache), greedy and seeded, on one device and on 8."""
    cfg, params, _ = policy
    sampling = SamplingConfig(max_response_len=R, eos_ids=(2, 7), length_aware=False, **kw)
    stops = np.array([3, 99, 5, 12, 1, 7, 99, 2])  # forced EOS lengths (99: none)
    tokens, logprobs, mask = reference_generate(cfg, params, PROMPTS, N, jax.random.key(9), sampling, stops)
    mesh = shd.make_mesh(layout) if layout else policy[2].mesh
    if layout:
        cfg, params = load_pretrained(folder, mesh=mesh)
    roll = Sampler(cfg, mesh).generate(params, PROMPTS, N, jax.random.key(9), sampling, stop_at=stops)
    np.testing.assert_array_equal(roll.response_ids, tokens)
    np.testing.assert_array_equal(roll.response_mask, mask)
    np.testing.assert_allclose(roll.logprobs, logprobs, atol=1e-4)
    assert roll.lengths.min() < R and roll.lengths.max() == R  # rows ended early, and not


def test_buckets_bound_the_compiled_shapes(policy):
    cfg, params, _ = policy
    sampler = Sampler(cfg, policy[2].mesh)
    sampling = SamplingConfig(max_response_len=4, prompt_bucket=16, batch_bucket=4, length_aware=False)  # one phase
    for prompts in ([[5] * 9, [6] * 2], [[7] * 16, [8], [9, 9]], [[4] * 12] * 4):
        roll = sampler.generate(params, prompts, 2, jax.random.key(0), sampling)
        assert roll.response_ids.shape == (2 * len(prompts), 4)  # batch padding rows dropped
        assert roll.prompt_ids.shape[1] == bucket(max(map(len, prompts)), 16)
    # prompt rows 2, 3 -> 4, 4 at width 16 -> two programs, not one per call
    assert bucket(3, 16) == 4 and bucket(9, 16) == 16 and bucket(100, 64) == 128 and bucket(130, 64) == 192
    assert sampler._decode._cache_size() == 2
    batch = sampler.pad_prompts([[7] * 3] * 5, sampling)
    assert batch.ids.shape == (8, 4) and batch.mask[5:].sum() == 3  # pad rows hold one token


@pytest.mark.parametrize("kw", [dict(greedy=True), dict(temperature=0.9, top_k=20)], ids=["greedy", "sampled"])
def test_a_run_wide_prompt_width_samples_what_each_batch_width_samples(policy, kw):
    # the same prompts left-padded to 16 slots (their own bucket) or to 64 (a run's longest prompt):
    # the same tokens and log-probs, the padding being masked and the positions counted from the prompt
    own, wide = _gen(policy, seed=5, **kw), _gen(policy, seed=5, prompt_width=40, **kw)
    assert own.prompt_ids.shape[1] == bucket(max(map(len, PROMPTS)), 64) < wide.prompt_ids.shape[1] == 64
    np.testing.assert_array_equal(own.response_ids, wide.response_ids)
    np.testing.assert_allclose(own.logprobs, wide.logprobs, atol=2e-5)
    # batches with longest prompts of 3 and 20 tokens (buckets 4 and 32) share one prefill at the run's width
    cfg, params, _ = policy
    sampler = Sampler(cfg, policy[2].mesh)
    sampling = SamplingConfig(max_response_len=4, prompt_width=24, length_aware=False)
    for prompts in ([[5] * 3, [6] * 2], [[7] * 20, [8]]):
        assert sampler.generate(params, prompts, 2, jax.random.key(0), sampling).prompt_ids.shape[1] == 32
    assert sampler._prefill._cache_size() == 1


def test_invalid_settings_name_the_field(policy):
    with pytest.raises(ValueError, match="SamplingConfig.temperature"):
        SamplingConfig(max_response_len=4, temperature=0.0)
    with pytest.raises(ValueError, match="SamplingConfig.top_p"):
        SamplingConfig(max_response_len=4, top_p=1.5)
    with pytest.raises(ValueError, match="SamplingConfig.max_response_len"):
        SamplingConfig(max_response_len=0)
    with pytest.raises(ValueError, match="SamplingConfig.top_k=100 exceeds"):
        _gen(policy, top_k=100)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        _gen(policy, prompts=[[3], []])
    with pytest.raises(ValueError, match=f"outside \\[0, {VOCAB}\\)"):
        _gen(policy, prompts=[[3, VOCAB]])


def test_the_cpus_straight_line_threefry_gives_the_bits_of_jaxs_primitive(monkeypatch):
    """``threefry2x32`` (the CPU's hash, straight-line operations) against JAX's ``threefry2x32_p``
    on keys and counters across the uint32 range (0, 2^32 - 1 and their neighbours: the carries),
    and ``gumbel_noise`` on the CPU's path against the GPU's (the primitive), bit for bit."""
    from jax.extend.random import threefry2x32_p

    from arlopti_jax.rollout.sampling import gumbel_noise, threefry2x32

    rng = np.random.default_rng(3)
    edges = np.array([0, 1, 2, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1], dtype=np.uint64)
    x1 = np.concatenate([np.repeat(edges, len(edges)), rng.integers(0, 2**32, 500, dtype=np.uint64)])
    x2 = np.concatenate([np.tile(edges, len(edges)), rng.integers(0, 2**32, 500, dtype=np.uint64)])
    x1, x2 = jnp.asarray(x1.astype(np.uint32)), jnp.asarray(x2.astype(np.uint32))
    for k1, k2 in [(0, 0), (2**32 - 1, 2**32 - 1), (0x1BD11BDA, 7), *rng.integers(0, 2**32, (3, 2)).tolist()]:
        k1, k2 = jnp.uint32(k1), jnp.uint32(k2)
        want = jax.jit(threefry2x32_p.bind)(k1, k2, x1, x2)
        got = jax.jit(threefry2x32)(k1, k2, x1, x2)
        for w, g in zip(want, got):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    rows = jnp.array([0, 5, 2**20], jnp.int32)
    noise = {}
    for platform in ("cpu", "gpu"):
        monkeypatch.setattr(shd, "platform", lambda: platform)
        noise[platform] = np.asarray(jax.jit(lambda k, t: gumbel_noise(k, t, rows, 300))(jax.random.key(9), 4))
    np.testing.assert_array_equal(noise["cpu"], noise["gpu"])
    assert np.isfinite(noise["cpu"]).all() and len(np.unique(noise["cpu"])) > 890


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize("mode", ["sampled", "greedy", "top_p"])
def test_draws_and_logprobs_equal_a_numpy_transcription(platform, mode, monkeypatch):
    """``sample_tokens`` on each platform's path (the CPU's max-then-min argmax, the GPU and TPU's
    one value-and-index reduction; the log-softmax shifted by the draw's own maximum) against numpy:
    the first index of the maximum of logits / T + the same Gumbel noise (ties included), and
    log_softmax(logits / T) at that token."""
    from arlopti_jax.rollout import gumbel_noise, sample_tokens

    monkeypatch.setattr(shd, "platform", lambda: platform)
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=(6, 50)) * 4).astype(np.float32)
    logits[0, [7, 30]] = 40.0  # a tie at the maximum: greedy takes the first index
    logits[1, :] = -np.inf
    logits[1, [4, 9]] = 2.0  # most of the vocabulary masked out
    key, rows, t = jax.random.key(11), jnp.arange(10, 16, dtype=jnp.int32), 5
    temperature, top_p = jnp.float32(0.7), jnp.float32(0.9)
    tokens, lp = sample_tokens(jnp.asarray(logits), key, t, rows, temperature, top_p, top_k=0,
                               use_top_p=mode == "top_p", greedy=mode == "greedy")
    scaled = logits.astype(np.float64) / 0.7
    m = scaled.max(axis=1, keepdims=True)
    log_softmax = scaled - (m + np.log(np.exp(scaled - m).sum(axis=1, keepdims=True)))
    if mode == "greedy":
        expected = np.argmax(logits, axis=1)
    elif mode == "sampled":
        expected = np.argmax(scaled.astype(np.float32) + np.asarray(gumbel_noise(key, t, rows, 50)), axis=1)
    else:  # the nucleus (the tokens whose more likely tokens hold under top_p of the mass), noise by token id
        probs = np.exp(log_softmax)
        before = (probs[:, None, :] * (scaled[:, None, :] > scaled[:, :, None])).sum(-1)  # [row, token]
        noisy = np.where(before < 0.9, scaled.astype(np.float32) + np.asarray(gumbel_noise(key, t, rows, 50)), -np.inf)
        expected = np.argmax(noisy, axis=1)
    np.testing.assert_array_equal(np.asarray(tokens), expected)
    if mode == "greedy":
        assert tokens[0] == 7
    np.testing.assert_allclose(np.asarray(lp), log_softmax[np.arange(6), expected], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("digit_bits", [4, 2, 1])
def test_the_nucleus_floor_keeps_the_tokens_numpy_keeps(digit_bits):
    """``nucleus_floor`` (no sort) against numpy in float64: a token is kept when the tokens strictly
    more likely than it hold less than top_p of the mass. Rows of every kind (flat, peaked, ties
    at the boundary, masked-out tokens, negative and positive logits, one dominant token, neighbouring
    floats) at top_p
    from 1e-6 to 0.999; a row whose boundary sits within float32 rounding of top_p is left out."""
    from arlopti_jax.rollout.sampling import _ordered, nucleus_floor

    rng = np.random.default_rng(digit_bits)
    rows = [rng.normal(size=300) * scale for scale in (0.1, 1.0, 3.0, 10.0)]
    rows.append(np.repeat(rng.normal(size=30), 10))  # ties of 10 everywhere
    rows.append(np.where(rng.random(300) < 0.9, -np.inf, rng.normal(size=300)))  # most masked out
    rows.append(np.concatenate([[25.0], rng.normal(size=299)]))  # one token holds nearly all
    rows.append(np.full(300, -7.5))  # flat: one tie of all
    rows.append(rng.permutation((np.float32(2.0).view(np.int32) + np.arange(300, dtype=np.int32)).view(np.float32)))
    # ^ 300 neighbouring floats, one ulp apart: the floor must be exact to its last bit
    logits = np.stack(rows).astype(np.float32)
    lse = jax.nn.logsumexp(jnp.asarray(logits), axis=-1)
    x = logits.astype(np.float64)
    probs = np.exp(x - x.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    before = (probs[:, None, :] * (logits[:, None, :] > logits[:, :, None])).sum(-1)
    checked = 0
    for top_p in (1e-6, 0.1, 0.5, 0.9, 0.999):
        floor = nucleus_floor(jnp.asarray(logits), lse, jnp.float32(top_p), digit_bits=digit_bits)
        kept = np.asarray(_ordered(jnp.asarray(logits)) >= floor[:, None])
        want = before < top_p
        clear = (np.abs(before - top_p) > 1e-4 * np.maximum(before, top_p)).all(axis=1)  # float32 sums' error
        np.testing.assert_array_equal(kept[clear], want[clear])
        assert kept.any(axis=1).all()  # never empty: the most likely tokens are always kept
        checked += clear.sum()
    assert checked >= 40  # of 45 (row, top_p) cases
    flat = nucleus_floor(jnp.asarray(logits[-2:-1]), lse[-2:-1], jnp.float32(0.5), digit_bits=digit_bits)
    assert (np.asarray(_ordered(jnp.asarray(logits[-2:-1])) >= flat[:, None])).all()  # a tie is all in


def test_one_row_count_for_the_padded_batch_its_compiled_programs_and_a_process_share():
    """``batch_rows``: prompts bucketed (min(next power of 2, next multiple of batch_bucket)), then
    a multiple of the mesh's data x fsdp, as pad_prompts, programs and process_share all lay it out."""
    sampling = SamplingConfig(max_response_len=4, batch_bucket=8, length_aware=False)
    want = {1: 8, 3: 8, 5: 8, 8: 8, 9: 16, 17: 24, 20: 24, 33: 40}  # by hand, for data x fsdp = 8
    assert {n: batch_rows(n, sampling, 8) for n in want} == want
    assert [batch_rows(n, sampling, 1) for n in (1, 3, 5, 9, 17)] == [1, 4, 8, 16, 24]
    assert [batch_rows(n, sampling, 3) for n in (1, 3, 5, 9)] == [3, 6, 9, 18]
    widths = [eos_width(SamplingConfig(max_response_len=4, eos_ids=ids)) for ids in ((), (1,), tuple(range(9)))]
    assert widths == [8, 8, 16]
    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=8)
    sampler = Sampler(cfg, shd.make_mesh({"fsdp": 8}))
    for n in want:
        assert sampler.pad_prompts([[3, 4]] * n, sampling).ids.shape[0] == want[n]
        assert sampler.process_share(n, sampling) == slice(0, n)

    class Prefill(Exception):
        pass

    def compile(name, fn, *args, **kwargs):  # stops at the prefill, with its prompt rows
        if name == "prefill":
            raise Prefill(args[1].shape[0])
        return args[0]

    with pytest.raises(Prefill) as prefill:
        sampler.programs(None, 17, 5, 1, sampling, compile)
    assert prefill.value.args[0] == want[17]



@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize("kernel", [dict(top_k=0, use_top_p=False), dict(top_k=7, use_top_p=False),
                                    dict(top_k=0, use_top_p=True), dict(top_k=9, use_top_p=True)],
                         ids=["plain", "top_k", "top_p", "top_k+top_p"])
def test_a_traced_greedy_flag_draws_what_each_static_program_draws(platform, kernel, monkeypatch):
    """``sample_tokens`` with ``greedy`` a traced bool (one jitted program for both) draws the tokens
    of the Python flag's two programs, greedy being numpy's first argmax of the logits, on each
    platform's argmax path, with ties and masked-out tokens, at two temperatures; the log-probs agree
    to float32 rounding (XLA may round ``logits / T`` differently in two separately compiled small
    programs, as they may the sampler's own programs below)."""
    from arlopti_jax.rollout import sample_tokens

    monkeypatch.setattr(shd, "platform", lambda: platform)
    rng = np.random.default_rng(len(str(kernel)) + len(platform))
    logits = (rng.normal(size=(8, 40)) * 3).astype(np.float32)
    logits[0, [3, 21]] = 30.0  # a tie at the maximum
    logits[1, :] = -np.inf
    logits[1, [5, 11]] = 1.5
    rows = jnp.arange(4, 12, dtype=jnp.int32)
    traced = jax.jit(lambda lg, key, t, temp, p, g: sample_tokens(lg, key, t, rows, temp, p, greedy=g, **kernel))
    for greedy in (True, False, True):
        for temperature, seed, t in ((0.7, 1, 3), (1.3, 2, 0)):
            args = (jnp.asarray(logits), jax.random.key(seed), t, jnp.float32(temperature), jnp.float32(0.8))
            want = jax.jit(lambda lg, key, t, temp, p: sample_tokens(lg, key, t, rows, temp, p, greedy=greedy,
                                                                     **kernel))(*args)
            got = traced(*args, jnp.bool_(greedy))
            np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
            scaled = logits.astype(np.float64) / temperature
            ulp = np.spacing(np.float32(np.abs(scaled[np.isfinite(scaled)]).max()))  # of the largest logit / T
            np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=0, atol=2 * ulp)
            m = scaled.max(axis=1, keepdims=True)
            lse = m[:, 0] + np.log(np.exp(scaled - m).sum(axis=1))
            np.testing.assert_allclose(np.asarray(got[1]), scaled[np.arange(8), np.asarray(got[0])] - lse,
                                       rtol=1e-5, atol=1e-5)
            if greedy:
                np.testing.assert_array_equal(np.asarray(got[0]), np.argmax(logits, axis=1))
    assert traced._cache_size() == 1  # one program for both flags


def _static_flag_sampler(cfg, mesh):
    """A sampler whose programs take ``greedy`` as a compile-time constant, as they did before it
    became data (the Python flag's branches of ``sample_tokens`` are that code, unchanged)."""
    import functools

    from arlopti_jax.rollout import programs

    sampler = Sampler(cfg, mesh)
    sampler._start = jax.jit(programs.start, static_argnames=("n", "max_len", "slots", "kernel", "greedy"))
    sampler._decode = jax.jit(functools.partial(programs.decode, cfg, devices=sampler.devices),
                              static_argnames=("kernel", "greedy"), donate_argnames=("state",))
    sampler._traced_settings = lambda sampling: Sampler._traced_settings(sampling)[:3] + (bool(sampling.greedy),)
    return sampler


SLOW = pytest.mark.slow  # default-suite budget (10 minutes on 2 cores): CI runs it in the slow pass


@pytest.mark.parametrize("kw", [dict(temperature=0.8), pytest.param(dict(temperature=1.2, top_k=20), marks=SLOW),
                                pytest.param(dict(top_p=0.9), marks=SLOW)], ids=["sampled", "top_k", "top_p"])
def test_greedy_and_sampled_decoding_share_one_compiled_program(policy, kw):
    """Greedy decoding, then sampling with the same kernel settings (``kernel_key``) at the same
    shapes on other prompts, then greedy again, run the same compiled prefill, start and decode
    loops: no compile after the first call. Each call's tokens equal those of programs compiled for
    the one flag (``_static_flag_sampler``), and its log-probs theirs to float32 rounding (two
    differently compiled programs may round differently: 4.8e-7 apart on an AVX-512 machine); both
    agree with ``reference_generate``'s (straight-line layers, no cache) to float32 rounding."""
    cfg, params, _ = policy
    sampler, static = Sampler(cfg, policy[2].mesh), _static_flag_sampler(cfg, policy[2].mesh)
    compiles = []

    def listen(event, duration, **meta):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(meta.get("fun_name", "?"))

    prompts = {"greedy": [[5, 6, 7, 8], [12, 13, 14]], "sampled": [[40, 41], [3, 4, 5, 6]],
               "again": [[9, 10, 11], [20, 21, 22, 23]]}
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for i, (mode, greedy) in enumerate((("greedy", True), ("sampled", False), ("again", True))):
            sampling = SamplingConfig(max_response_len=8, eos_ids=(2,), min_rows=1, phase_tokens=2, greedy=greedy,
                                      **kw)
            key = jax.random.key(4 + i)
            before = len(compiles)
            roll = sampler.generate(params, prompts[mode], N, key, sampling)
            if i:
                assert compiles[before:] == [], (mode, compiles[before:])
            before = len(compiles)
            want = static.generate(params, prompts[mode], N, key, sampling)
            if i == 1:  # the flag's own programs: a new start and decode loops for sampling
                assert {"start", "decode"} <= {name.split("(")[-1].rstrip(")") for name in compiles[before:]}, \
                    compiles[before:]
            np.testing.assert_array_equal(roll.response_ids, want.response_ids)
            np.testing.assert_allclose(roll.logprobs, want.logprobs, rtol=1e-6, atol=2e-6)
            tokens, logprobs, mask = reference_generate(cfg, params, prompts[mode], N, key, sampling)
            np.testing.assert_array_equal(roll.response_ids, tokens)
            np.testing.assert_array_equal(roll.response_mask, mask)
            np.testing.assert_allclose(roll.logprobs, logprobs, atol=1e-4)
            same = np.array_equal(roll.response_ids[::N], roll.response_ids[1::N])
            assert same if greedy else not same  # a group's greedy samples agree; sampled ones differ
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert sampler._prefill._cache_size() == 1


def test_the_fused_products_falling_back_to_xla_is_said_once_where_the_sampler_is_built(caplog):
    """``model.decode_matmul=pallas`` takes whole weights: a mesh that splits them (fsdp=8, without
    ``whole_weights``) makes ``fused_layers`` fall back to XLA's products, and the sampler says so."""
    from arlopti_jax.rollout import sampler as sampler_module

    sampler_module._warn_once.cache_clear()
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, decode_attention="pallas", decode_matmul="pallas")
    said = lambda: [r.getMessage() for r in caplog.records if "decode_matmul=pallas" in r.getMessage()]
    Sampler(cfg, shd.make_mesh({"fsdp": -1}), whole_weights="on")  # whole copies: the kernels apply
    Sampler(cfg, shd.make_mesh({"data": -1}), whole_weights="off")  # rows split, weights whole
    Sampler(cfg.replace(decode_matmul="xla"), shd.make_mesh({"fsdp": -1}), whole_weights="off")
    assert said() == []
    for _ in range(2):
        Sampler(cfg, shd.make_mesh({"fsdp": -1}), whole_weights="off")
    assert len(said()) == 1 and "splits the weights' embed axes" in said()[0] and "XLA's products" in said()[0]


def test_generate_steps_keeps_its_mesh_to_its_own_turns(folder, policy):
    """Between its turns (where the update's programs are traced, rl/pipeline.py) the sampler's mesh
    and rules are not in force: the first generator of this kind held them across its yields, and the
    update's programs then traced under the sampler's mesh (another trace each step, on split meshes).
    The tokens are ``generate``'s."""
    mesh = shd.make_mesh({"data": 2}, jax.devices()[4:6])
    cfg, params = load_pretrained(folder, mesh=mesh)
    sampling = SamplingConfig(max_response_len=R, temperature=0.8, phase_tokens=4, min_rows=1)
    steps = Sampler(cfg, mesh).generate_steps(params, PROMPTS, 2, jax.random.key(3), sampling)
    turns = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            got = done.value
            break
        turns += 1
        assert shd.platform() == jax.default_backend() and jax.sharding.get_abstract_mesh().empty
    assert turns >= 2  # a length-aware decode: several loops, each a yield
    want = Sampler(cfg, mesh).generate(params, PROMPTS, 2, jax.random.key(3), sampling)
    np.testing.assert_array_equal(got.response_ids, want.response_ids)
