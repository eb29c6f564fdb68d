"""Qwen3 and Gemma 3 in the sampler, at tiny random configs written by transformers
(``hf_fixtures``): greedy decoding equals transformers' ``generate``, and sampled tokens and
log-probs equal a cache-free reference and a teacher-forced pass, through the length-aware
schedule's phases and compactions, on the CPU's layer loop, the GPU's layout and decode kernel
(forced on the CPU, the kernel in Pallas' interpret mode) and the TPU's read-before-write
attention. Gemma 3's sliding window (5 slots) is shorter than most prompts, so its local layers
attend to part of the prompt only; the window is exact in the KV cache, not global attention."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlopti_jax.runtime import sharding as shd
from arlopti_jax.models import load_pretrained
from arlopti_jax.models import token_logprobs as _token_logprobs
from arlopti_jax.rollout import Sampler, SamplingConfig
from hf_fixtures import gemma3_attention_softcap, hf_model, write_hf_model
from reference_sampler import reference_generate

# prompts of 7, 2, 11 and 9 tokens (Gemma 3's window: 5), N samples each
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], list(range(3, 14)), list(range(40, 49))]
N, R = 2, 12
STOPS = np.array([3, 1, 99, 6, 2, 8, 4, 12])  # forced response lengths: early, at the phase ends (4, 8), never
PHASES = dict(phase_tokens=4, min_rows=1)
FAMILIES = {"qwen3": dict(kind="qwen3", tied=False), "gemma3": dict(kind="gemma3", tied=True)}
token_logprobs = jax.jit(_token_logprobs, static_argnums=0, static_argnames="temperature")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, folder, config, weights, sampler) on one device."""
    folder = write_hf_model(tmp_path_factory.mktemp(request.param) / "ckpt", **FAMILIES[request.param])
    mesh = shd.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    cfg, params = load_pretrained(folder, mesh=mesh)
    return request.param, folder, cfg, params, Sampler(cfg, mesh)


def _sampling(**kw) -> SamplingConfig:
    return SamplingConfig(**{"max_response_len": R, "eos_ids": (2,), "temperature": 0.8, **PHASES, **kw})


def test_greedy_equals_transformers_generate(family):
    import torch

    name, folder, cfg, params, sampler = family
    assert cfg.family == name and (name != "gemma3" or cfg.sliding_window < max(map(len, PROMPTS)))
    ours = sampler.generate(params, PROMPTS, 1, jax.random.key(0), _sampling(greedy=True, pad_id=0))
    width = max(map(len, PROMPTS))
    ids, mask = np.zeros((len(PROMPTS), width), np.int64), np.zeros((len(PROMPTS), width), np.int64)
    for i, p in enumerate(PROMPTS):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    with torch.no_grad(), gemma3_attention_softcap():
        out = hf_model(folder).generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                                        do_sample=False, max_new_tokens=R, eos_token_id=2, pad_token_id=0)
    out = out.numpy()[:, width:]  # rows end at EOS (2) or after R tokens; padded with 0 after an EOS
    np.testing.assert_array_equal(ours.response_ids[:, :out.shape[1]], out)
    assert np.all(ours.response_ids[:, out.shape[1]:] == 0)
    assert len({tuple(row) for row in ours.response_ids}) == len(PROMPTS)  # the rows differ: a real check
    if name == "gemma3":  # a negative control: the same weights with every layer global draw other tokens
        plain = dataclasses.replace(cfg, layer_types=None, rope_local_theta=None)
        everywhere = Sampler(plain, sampler.mesh).generate(params, PROMPTS, 1, jax.random.key(0),
                                                           _sampling(greedy=True, pad_id=0))
        assert not np.array_equal(everywhere.response_ids, ours.response_ids)


def test_sampled_logprobs_equal_the_reference_and_teacher_forcing(family):
    """Length-aware decoding with forced response lengths (so rows finish, the batch compacts and the
    cache grows) draws the tokens and log-probs of ``reference_generate`` (each position's whole
    sequence through the training forward, no cache), and its log-probs are a teacher-forced pass's."""
    _, _, cfg, params, sampler = family
    sampling = _sampling()
    tokens, logprobs, mask = reference_generate(cfg, params, PROMPTS, N, jax.random.key(3), sampling, STOPS)
    roll = sampler.generate(params, PROMPTS, N, jax.random.key(3), sampling, stop_at=STOPS)
    rows, slots = [r for r, _, _ in roll.decode_loops], {s for _, s, _ in roll.decode_loops}
    assert rows[-1] < rows[0] and len(slots) == 3  # compacted, and grew through three phases
    np.testing.assert_array_equal(roll.response_ids, tokens)
    np.testing.assert_array_equal(roll.response_mask, mask)
    np.testing.assert_allclose(roll.logprobs, logprobs, atol=1e-5)
    batch = roll.train_batch()
    lp, _ = token_logprobs(cfg, params, jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"]),
                           temperature=0.8)
    resp = batch["response_mask"].astype(bool)
    assert resp.sum() > 40
    np.testing.assert_allclose(batch["old_logprobs"][resp], np.asarray(lp)[resp], atol=1e-5)


def _draw(sampler, params):
    return sampler.generate(params, PROMPTS, N, jax.random.key(5), _sampling(top_k=20), stop_at=STOPS)


def _assert_same(got, want):
    loops = got.decode_loops
    assert loops[-1][0] < loops[0][0] and len({s for _, s, _ in loops}) == 3  # compacted, and grew twice
    np.testing.assert_array_equal(got.response_ids, want.response_ids)
    np.testing.assert_array_equal(got.response_mask, want.response_mask)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


@pytest.mark.slow  # 15-35 s each (the kernel interpreted); test_length_aware.py checks this path on Qwen2 by default
@pytest.mark.parametrize("layout", [{}, {"data": 2, "fsdp": 2, "tensor": 2}], ids=["1device", "data2xfsdp2xtensor2"])
def test_the_gpu_layout_and_decode_kernel_equal_the_loop(family, layout, monkeypatch):
    """The GPU's sampler (a buffer per layer, straight-line layers, the Pallas decode kernel in each
    decode step: Qwen3's q/k norms applied before it, Gemma 3's window as the start of each row's
    live run of slots; Qwen3 also with the fused products of ``decode_matmul``), forced on the CPU,
    draws the tokens and log-probs of the CPU's layer loop, on one device and split over 8."""
    from arlopti_jax.models import decode_attention as da
    from arlopti_jax.rollout import programs

    name, folder, cfg, params, sampler = family
    want = _draw(sampler, params)
    mesh = shd.make_mesh(layout) if layout else sampler.mesh
    if layout:
        cfg, params = load_pretrained(folder, mesh=mesh)
    monkeypatch.setattr(programs, "per_layer_cache", lambda platform=None: True)
    traced, kernel = [], da.decode_attention
    monkeypatch.setattr(da, "decode_attention", lambda *a, **k: traced.append(a[4].shape) or kernel(*a, **k))
    settings = [dict(decode_attention="pallas")] + ([dict(decode_attention="pallas", decode_matmul="pallas")]
                                                    if name == "qwen3" and not layout else [])
    for setting in settings:
        got = _draw(Sampler(cfg.replace(**setting), mesh), params)
        _assert_same(got, want)
    assert len(traced) >= cfg.num_layers * len({loop[:2] for loop in got.decode_loops})  # the kernel ran


@pytest.mark.slow  # 8-10 s each; tests/rollout/test_length_aware.py checks the same path on Qwen2 by default
def test_the_tpu_attention_equals_the_cpu_one(family, monkeypatch):
    """The TPU's read-before-write attention over the stacked cache (``decode.read_before_write``),
    forced on the CPU, draws what the CPU's write-then-read attention draws."""
    from arlopti_jax.models import decode

    _, _, cfg, params, sampler = family
    want = _draw(sampler, params)
    monkeypatch.setattr(decode, "read_before_write", lambda: True)
    _assert_same(_draw(Sampler(cfg, sampler.mesh), params), want)
