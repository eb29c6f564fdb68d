"""LoRA adapters in the decoder (``decoder.adapted``) and as trees (``models.lora``), against the
base model and against a direct transcription of W + (alpha / r) A B."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlopti_jax.models import ModelConfig, init_params, logits, lora
from arlopti_jax.runtime import sharding as shd

BASE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def mesh():
    return shd.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, BASE.vocab_size, (3, 10)), jnp.int32)
    mask = jnp.asarray(np.arange(10)[None, :] >= np.array([[0], [3], [5]]), jnp.int32)  # left padding
    return ids, mask


def _with_adapters(cfg, base_params, mesh, seed=1, b_scale=0.0):
    """The base weights with fresh adapters of ``cfg``; B drawn at ``b_scale`` when nonzero."""
    adapters = lora.init_adapters(cfg, jax.random.key(seed), mesh)
    if b_scale:
        keys = iter(jax.random.split(jax.random.key(seed + 1), 64))
        adapters = jax.tree_util.tree_map_with_path(
            lambda path, x: b_scale * jax.random.normal(next(keys), x.shape, x.dtype)
            if str(path[-1].key).endswith("_lora_b") else x, adapters)
    return lora.combine(base_params, adapters)


@pytest.mark.parametrize("targets", [("q", "v"), ("q", "k", "v", "o", "gate", "up", "down")], ids=["qv", "all"])
def test_fresh_adapters_leave_the_base_logits_exactly(mesh, targets):
    base_params = init_params(BASE, jax.random.key(0), mesh)
    cfg = dataclasses.replace(BASE, lora_rank=4, lora_alpha=8.0, lora_targets=targets)
    params = _with_adapters(cfg, base_params, mesh)
    names = {str(path[-1].key) for path, _ in jax.tree_util.tree_flatten_with_path(lora.split(params)[1])[0]}
    assert names == {f"{t}_lora_{m}" for t in targets for m in "ab"}
    ids, mask = _batch()
    np.testing.assert_array_equal(logits(cfg, params, ids, mask), logits(BASE, base_params, ids, mask))
    # A is not zero: with B drawn, the logits move; switched off, they are the base's again
    moved = _with_adapters(cfg, base_params, mesh, b_scale=0.5)
    assert not np.allclose(logits(cfg, moved, ids, mask), logits(BASE, base_params, ids, mask), atol=1e-3)
    np.testing.assert_array_equal(logits(cfg, lora.adapters_off(moved), ids, mask),
                                  logits(BASE, base_params, ids, mask))


def _transcribed(cfg, params):
    """W + (alpha / r) A B for each adapted weight, written out here by einsum per projection."""
    layer = params["layers"]
    s = cfg.lora_scale
    out = jax.tree.map(lambda x: x, lora.split(params)[0])
    for group, names in (("attn", ("q", "k", "v", "o")), ("mlp", ("gate", "up", "down"))):
        for name in names:
            a, b = layer[group][f"{name}_lora_a"], layer[group][f"{name}_lora_b"]
            spec = "ldr,lrnh->ldnh" if name in "qkv" else "lnhr,lrd->lnhd" if name == "o" else "ldr,lrf->ldf"
            out["layers"][group][f"{name}_kernel"] = layer[group][f"{name}_kernel"] + s * jnp.einsum(spec, a, b)
    return out


def test_merged_and_unmerged_agree_and_gradients_equal_the_transcription(mesh):
    cfg = dataclasses.replace(BASE, lora_rank=4, lora_alpha=16.0)
    base_params = init_params(BASE, jax.random.key(0), mesh)
    params = _with_adapters(cfg, base_params, mesh, b_scale=0.3)
    ids, mask = _batch(seed=2)
    unmerged = logits(cfg, params, ids, mask)
    np.testing.assert_allclose(unmerged, logits(BASE, lora.merge(cfg, params), ids, mask), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(unmerged, logits(BASE, _transcribed(cfg, params), ids, mask), rtol=2e-5, atol=2e-5)

    weights = jax.random.normal(jax.random.key(3), unmerged.shape)
    base, adapters = lora.split(params)

    def ours(adapters):
        return jnp.sum(weights * logits(cfg, lora.combine(base, adapters), ids, mask))

    def direct(adapters):
        return jnp.sum(weights * logits(BASE, _transcribed(cfg, lora.combine(base, adapters)), ids, mask))

    got, want = jax.grad(ours)(adapters), jax.grad(direct)(adapters)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        assert np.abs(np.asarray(w)).max() > 0, path  # every adapter leaf gets a gradient
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * np.abs(np.asarray(w)).max(), err_msg=str(path))


@pytest.mark.parametrize("bad, field", [(dict(lora_rank=-1), "lora_rank"),
                                        (dict(lora_rank=4, lora_alpha=0.0), "lora_alpha"),
                                        (dict(lora_rank=4, lora_targets=("q", "w_in")), "lora_targets"),
                                        (dict(lora_rank=4, lora_targets=()), "lora_targets")])
def test_bad_lora_settings_name_the_field(bad, field):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}="):
        dataclasses.replace(BASE, **bad)


@pytest.mark.parametrize("kind", ["qwen2", pytest.param("qwen3", marks=pytest.mark.slow), "gemma3"])
def test_the_exported_peft_adapter_and_merged_folder_give_our_logits_in_transformers(tmp_path, kind):
    """Our adapters written as a PEFT folder and loaded by ``peft`` onto transformers' model of the
    base folder, and the merged weights written as a plain Hugging Face folder: both give the
    logits of our model with its adapters (Qwen3 and Gemma 3 too: their q/k norms and Gemma's
    sublayer norms sit between the adapted projections)."""
    peft = pytest.importorskip("peft")
    import torch
    import transformers
    from hf_fixtures import write_hf_model

    from arlopti_jax.models import load_pretrained, save_pretrained
    from arlopti_jax.models.hf import save_adapter

    folder = write_hf_model(tmp_path / "base", kind=kind)
    mesh = shd.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    base_cfg, base_params = load_pretrained(folder, mesh=mesh)
    cfg = dataclasses.replace(base_cfg, lora_rank=4, lora_alpha=8.0, lora_targets=("q", "v", "o", "gate", "down"))
    params = _with_adapters(cfg, base_params, mesh, b_scale=0.2)
    rng = np.random.default_rng(5)
    ids = rng.integers(3, base_cfg.vocab_size, (2, 12))
    ours = np.asarray(logits(cfg, params, jnp.asarray(ids, jnp.int32), jnp.ones(ids.shape, jnp.int32)))
    assert not np.allclose(ours, np.asarray(logits(base_cfg, base_params, jnp.asarray(ids, jnp.int32),
                                                   jnp.ones(ids.shape, jnp.int32))), atol=1e-2)

    save_adapter(cfg, params, tmp_path / "adapter", base_model=str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(model, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = adapted(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=2e-3)
    # a pinned Hub base: PEFT's repo id and revision fields, not "ORG/NAME@REV" as an id
    save_adapter(cfg, params, tmp_path / "pinned", base_model="Org/Base-1.5B@0a1b2c3")
    pinned = peft.PeftConfig.from_pretrained(tmp_path / "pinned")
    assert (pinned.base_model_name_or_path, pinned.revision) == ("Org/Base-1.5B", "0a1b2c3")
    assert peft.PeftConfig.from_pretrained(tmp_path / "adapter").base_model_name_or_path == str(folder)

    save_pretrained(base_cfg, lora.merge(cfg, params), tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        np.testing.assert_allclose(merged(torch.from_numpy(ids)).logits.numpy(), ours, atol=2e-3)


def test_a_bfloat16_base_gets_float32_adapters(mesh):
    """The base keeps param_dtype bfloat16; its adapters (and so their AdamW moments) are float32,
    and fresh ones still leave the base's logits exactly."""
    base_cfg = dataclasses.replace(BASE, param_dtype="bfloat16")
    cfg = dataclasses.replace(base_cfg, lora_rank=4, lora_targets=("q", "down"))
    base_params = init_params(base_cfg, jax.random.key(0), mesh)
    params = _with_adapters(cfg, base_params, mesh)
    base, adapters = lora.split(params)
    assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
    ids, mask = _batch()
    np.testing.assert_array_equal(logits(cfg, params, ids, mask), logits(base_cfg, base_params, ids, mask))
    merged = lora.merge(cfg, _with_adapters(cfg, base_params, mesh, b_scale=0.5))
    assert {x.dtype for x in jax.tree.leaves(merged)} == {jnp.dtype(jnp.bfloat16)}  # the base's dtype


def test_the_sampler_samples_a_lora_policy_as_its_written_out_weights(mesh):
    """A LoRA policy's rollout (the sampler merges the adapters once, then runs the plain model)
    draws the tokens a plain sampler draws from W + (alpha / r) A B written out here, with the
    same log-probs, and they are not the base model's."""
    from arlopti_jax.rollout import Sampler, SamplingConfig

    cfg = dataclasses.replace(BASE, lora_rank=4, lora_alpha=16.0)
    base_params = init_params(BASE, jax.random.key(0), mesh)
    params = _with_adapters(cfg, base_params, mesh, b_scale=0.5)
    prompts = [list(range(3, 9)), list(range(10, 14)), list(range(20, 27))]
    sampling = SamplingConfig(max_response_len=8, eos_ids=(), prompt_bucket=8, batch_bucket=4, length_aware=False)
    run = lambda c, p: Sampler(c, mesh).generate(p, prompts, 2, jax.random.key(5), sampling)
    got, want, base = run(cfg, params), run(BASE, _transcribed(cfg, params)), run(BASE, base_params)
    np.testing.assert_array_equal(got.response_ids, want.response_ids)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    assert not np.array_equal(got.response_ids, base.response_ids)
