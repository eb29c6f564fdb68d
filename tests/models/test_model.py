"""Parity of the Flax decoder with transformers, checkpoint round trips, corrupt checkpoints."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from arlopti_jax.runtime import sharding as shd
from arlopti_jax.models import (CheckpointError, ModelConfig, load_pretrained, logits, save_pretrained,
                                token_logprobs)
from hf_fixtures import SOFTCAPS, hf_logits, padded_batch, write_hf_model

# (family, tied embeddings, more config fields); Gemma 3 with both soft-caps, its sliding window of 5
# shorter than the batches' rows (hf_fixtures.GEMMA3)
VARIANTS = [("qwen2", False, {}), ("qwen2", True, {}), ("llama", False, {}), ("qwen3", True, {}),
            ("gemma3", False, SOFTCAPS)]


def _single_mesh():
    return shd.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])


@pytest.fixture(scope="module", params=VARIANTS,
                ids=lambda v: f"{v[0]}-{'tied' if v[1] else 'untied'}{'-softcaps' if v[2] else ''}")
def hf_folder(request, tmp_path_factory):
    kind, tied, extra = request.param
    return write_hf_model(tmp_path_factory.mktemp(f"{kind}{tied}") / "ckpt", kind=kind, tied=tied, **extra)


def test_logits_match_transformers_with_padding(hf_folder):
    ids, mask = padded_batch()
    cfg, params = load_pretrained(hf_folder, mesh=_single_mesh())
    ours = np.asarray(logits(cfg, params, jnp.asarray(ids), jnp.asarray(mask)))
    ref = hf_logits(hf_folder, ids, mask)
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], ref[valid], atol=1e-4, rtol=0)


def test_export_reload_in_transformers_gives_same_logits(hf_folder, tmp_path):
    ids, mask = padded_batch(seed=1)
    cfg, params = load_pretrained(hf_folder, mesh=_single_mesh())
    out = save_pretrained(cfg, params, tmp_path / "export", tokenizer_dir=hf_folder)
    ref = hf_logits(hf_folder, ids, mask)
    again = hf_logits(out, ids, mask)
    valid = mask.astype(bool)
    np.testing.assert_array_equal(again[valid], ref[valid])
    # and the exported folder loads back into Flax bit-identically
    cfg2, params2 = load_pretrained(out, mesh=_single_mesh())
    assert cfg2 == cfg
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, params2)


def test_bf16_import_casts_per_request(tmp_path):
    folder = write_hf_model(tmp_path / "bf16", dtype="bfloat16")
    cfg, params = load_pretrained(folder, mesh=_single_mesh(), param_dtype="bfloat16", dtype="bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params))
    ids, mask = padded_batch()
    ours = np.asarray(logits(cfg, params, jnp.asarray(ids), jnp.asarray(mask)))
    ref = hf_logits(folder, ids, mask)
    valid = mask.astype(bool)
    rel = np.linalg.norm(ours[valid] - ref[valid]) / np.linalg.norm(ref[valid])
    assert rel < 2e-2, rel


def test_sharded_index_files_load(tmp_path):
    src = write_hf_model(tmp_path / "src")
    cfg, params = load_pretrained(src, mesh=_single_mesh())
    out = save_pretrained(cfg, params, tmp_path / "sharded", max_shard_bytes=20_000)
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*.safetensors"))) > 2
    ids, mask = padded_batch()
    np.testing.assert_array_equal(hf_logits(out, ids, mask)[mask.astype(bool)],
                                  hf_logits(src, ids, mask)[mask.astype(bool)])


def test_token_logprobs_equal_naive_log_softmax(hf_folder):
    ids, mask = padded_batch(seed=2, length=23)
    cfg, params = load_pretrained(hf_folder, mesh=_single_mesh())
    full = np.asarray(logits(cfg, params, jnp.asarray(ids), jnp.asarray(mask)), np.float64) / 0.7
    logz = np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1)) + full.max(-1)
    logp_all = full - logz[..., None]
    want_lp = np.take_along_axis(logp_all[:, :-1], ids[:, 1:, None], -1)[..., 0]
    want_ent = -(np.exp(logp_all) * logp_all).sum(-1)[:, :-1]
    for chunk in (1, 5, 256):  # chunks that do and do not divide the length
        lp, ent = token_logprobs(cfg, params, jnp.asarray(ids), jnp.asarray(mask), temperature=0.7,
                                 chunk_size=chunk)
        np.testing.assert_allclose(np.asarray(lp)[:, 1:], want_lp, atol=1e-5)
        np.testing.assert_allclose(np.asarray(ent)[:, 1:], want_ent, atol=1e-5)
        assert np.all(np.asarray(lp)[:, 0] == 0)


def test_token_logprobs_gradient_matches_naive(tmp_path):
    folder = write_hf_model(tmp_path / "g")
    cfg, params = load_pretrained(folder, mesh=_single_mesh())
    ids, mask = padded_batch(seed=3, length=10)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)

    def chunked(p):
        lp, ent = token_logprobs(cfg, p, ids, mask, chunk_size=3)
        return jnp.sum(lp * mask) + 0.1 * jnp.sum(ent * mask)

    def naive(p):
        lg = jax.nn.log_softmax(logits(cfg, p, ids, mask), -1)
        lp = jnp.take_along_axis(lg[:, :-1], ids[:, 1:, None], -1)[..., 0]
        ent = -jnp.sum(jnp.exp(lg) * lg, -1)[:, :-1]
        return jnp.sum(lp * mask[:, 1:]) + 0.1 * jnp.sum(ent * mask[:, 1:])

    g1, g2 = jax.jit(jax.grad(chunked))(params), jax.jit(jax.grad(naive))(params)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4), g1, g2)


# ---- corrupt and mismatched checkpoints ----

def _rewrite(folder, fn):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    folder = write_hf_model(tmp_path / "m")
    _rewrite(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        load_pretrained(folder, mesh=_single_mesh())


def test_extra_tensor_is_named(tmp_path):
    folder = write_hf_model(tmp_path / "e")
    _rewrite(folder, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((96, 64), np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['model.layers.2.mlp.up_proj.weight'\]"):
        load_pretrained(folder, mesh=_single_mesh())


def test_misshaped_tensor_names_both_shapes(tmp_path):
    folder = write_hf_model(tmp_path / "s")
    _rewrite(folder, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((16, 64), np.float32)}))
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.k_proj.weight has shape \[16, 64\], "
                                              r"expected \[32, 64\]"):
        load_pretrained(folder, mesh=_single_mesh())


def test_index_pointing_at_missing_shard(tmp_path):
    folder = write_hf_model(tmp_path / "i")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_pretrained(folder, mesh=_single_mesh())


def test_unsupported_architecture_and_values(tmp_path):
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf_dict({"architectures": ["GPT2LMHeadModel"]})
    folder = write_hf_model(tmp_path / "u")
    cfg = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        ModelConfig.from_hf_dict({**cfg, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="rope_parameters type 'yarn'"):
        ModelConfig.from_hf_dict({**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path / "nowhere")


# a Gemma 3 config.json in the layout of the Hub's older files (transformers 4.50: rope_theta,
# rope_local_base_freq, rope_scaling and sliding_window_pattern; no layer_types, no rope_parameters)
GEMMA3_OLD_LAYOUT = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
                     "intermediate_size": 96, "num_hidden_layers": 8, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 97, "query_pre_attn_scalar": 24,
                     "rope_theta": 500000.0,
                     "rope_local_base_freq": 5000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                     "sliding_window": 6, "sliding_window_pattern": 3, "hidden_activation": "gelu_pytorch_tanh",
                     "final_logit_softcapping": None, "attn_logit_softcapping": None, "eos_token_id": [1, 96]}


def test_config_json_of_both_gemma3_layouts_reads_as_transformers_reads_it():
    """The older layout's keys give the layer kinds and RoPE that transformers 5 makes of them (its
    Gemma3TextConfig reads the same dict), and so does the layout transformers 5 writes."""
    import transformers

    theirs = transformers.Gemma3TextConfig(**{k: v for k, v in GEMMA3_OLD_LAYOUT.items() if k != "architectures"})
    new_layout = {**theirs.to_dict(), "architectures": ["Gemma3ForCausalLM"]}
    for hf in (GEMMA3_OLD_LAYOUT, new_layout):
        cfg = ModelConfig.from_hf_dict(hf)
        assert cfg.layer_types == tuple(theirs.layer_types) and cfg.sliding_window == theirs.sliding_window
        assert cfg.rope_theta == theirs.rope_parameters["full_attention"]["rope_theta"] == 500000.0
        assert cfg.rope_local_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"] == 5000.0
        assert dict(cfg.rope_scaling) == {"rope_type": "linear", "factor": 2.0}
        assert (cfg.query_pre_attn_scalar, cfg.qk_norm, cfg.tie_word_embeddings, cfg.eos_token_id) == (24, True, True,
                                                                                                      (1, 96))
    assert cfg.layer_types[:3] == ("sliding_attention", "sliding_attention", "full_attention")


def test_an_image_text_gemma3_folder_gives_its_text_model(tmp_path):
    """Gemma 3 from 4B up ships as Gemma3ForConditionalGeneration: its text model's tensors
    (``language_model.``) load, the vision tower's are left, the logits of a text-only batch are
    transformers' image-text model's, and the export is a text model transformers loads with them."""
    import torch
    import transformers

    torch.manual_seed(0)
    text = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, sliding_window=5, sliding_window_pattern=2,
                rope_scaling={"rope_type": "linear", "factor": 8.0})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "mm")
    cfg, params = load_pretrained(tmp_path / "mm", mesh=_single_mesh())
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.layer_types == (
        "sliding_attention", "full_attention", "sliding_attention")
    ids, mask = padded_batch(seed=6, length=14)
    with torch.no_grad():
        want = model.eval()(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                            position_ids=torch.tensor(np.maximum(mask.cumsum(-1) - 1, 0))).logits.numpy()
    valid = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(logits(cfg, params, jnp.asarray(ids), jnp.asarray(mask)))[valid],
                               want[valid], atol=1e-4, rtol=0)
    out = save_pretrained(cfg, params, tmp_path / "text")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    np.testing.assert_allclose(hf_logits(out, ids, mask)[valid], want[valid], atol=1e-4, rtol=0)


def test_settings_that_cannot_serve_an_architecture_stop_it():
    """Soft-capped attention scores: not in cuDNN's kernel nor the Pallas decode kernel (an 'auto'
    setting falls back to XLA's on a GPU, with a start-up line each); Gemma 3's sublayer norms and
    GELU: not in the fused decode products."""
    capped = ModelConfig.from_hf_dict({**GEMMA3_OLD_LAYOUT, "attn_logit_softcapping": 50.0}, dtype="bfloat16")
    for setting, message in ((dict(attention="cudnn"), "cuDNN's fused attention does not cap"),
                             (dict(decode_attention="pallas"), "the Pallas decode kernel does not cap")):
        with pytest.raises(ValueError, match=message):
            capped.replace(**setting)
    with pytest.raises(ValueError, match="model.decode_matmul='pallas'.*Gemma 3"):
        ModelConfig.from_hf_dict(GEMMA3_OLD_LAYOUT, decode_matmul="pallas")
    lines = capped.fallbacks("gpu")
    assert len(lines) == 2 and lines[0].startswith("model.decode_attention=auto") and "cuDNN" in lines[1]
    assert capped.fallbacks("tpu") == [] and ModelConfig.from_hf_dict(GEMMA3_OLD_LAYOUT).fallbacks("gpu") == []
    wide = ModelConfig.from_hf_dict({**GEMMA3_OLD_LAYOUT, "head_dim": 256}, dtype="bfloat16")  # Gemma 3's heads
    with pytest.raises(ValueError, match="at most 128.*are 256"):
        wide.replace(attention="cudnn")
    assert len(wide.fallbacks("gpu")) == 1 and "heads of at most 128" in wide.fallbacks("gpu")[0]
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_dict({**GEMMA3_OLD_LAYOUT, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="attention_bias=true: not supported for Qwen3ForCausalLM"):
        ModelConfig.from_hf_dict({"architectures": ["Qwen3ForCausalLM"], "attention_bias": True})


def test_remat_gives_same_logits_and_gradients(tmp_path):
    folder = write_hf_model(tmp_path / "r")
    cfg, params = load_pretrained(folder, mesh=_single_mesh())
    ids, mask = (jnp.asarray(a) for a in padded_batch(seed=4, length=9))

    def loss(c, p):
        lp, _ = token_logprobs(c, p, ids, mask)
        return jnp.sum(lp * mask)

    plain = jax.jit(jax.value_and_grad(lambda p: loss(cfg, p)))(params)
    remat = jax.jit(jax.value_and_grad(lambda p: loss(cfg.replace(remat=True), p)))(params)
    np.testing.assert_allclose(plain[0], remat[0], rtol=1e-6)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), plain[1], remat[1])


def test_attention_mask_has_no_empty_row_and_keeps_valid_rows():
    """Left-padded prompts: a valid query sees exactly the valid slots up to its own (checked
    against a direct loop); a padding query sees its own slot only, so no softmax row is empty
    (what the fused GPU kernel needs)."""
    from arlopti_jax.models.decoder import attention_mask

    kv = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]], np.int32)
    got = np.asarray(attention_mask(jnp.asarray(kv), 6, 0))[:, 0]
    for b in range(3):
        for t in range(6):
            want = [bool(kv[b, s]) and s <= t for s in range(6)] if kv[b, t] else [s == t for s in range(6)]
            assert got[b, t].tolist() == want, (b, t)
    # decode: one query at slot 4 of a 6-slot cache
    step = np.asarray(attention_mask(jnp.asarray(kv), 1, 4))[:, 0, 0]
    assert step.tolist() == [[bool(kv[b, s]) and s <= 4 for s in range(6)] for b in range(3)]


def test_attention_impl_is_validated():
    with pytest.raises(ValueError, match=r"attention='flash'.*'auto', 'xla', 'cudnn'"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=4, attention="flash")


# (backend, dtype) -> the kernel 'auto' must run: cuDNN's fused one only on a GPU at 16 bits; XLA's own
# lowering of dot_product_attention on a GPU otherwise; the causal query blocks on CPUs and TPUs.
AUTO_KERNELS = [("gpu", jnp.bfloat16, "cudnn"), ("gpu", jnp.float16, "cudnn"), ("gpu", jnp.float32, "xla"),
                ("tpu", jnp.bfloat16, "causal blocks"), ("tpu", jnp.float32, "causal blocks"),
                ("cpu", jnp.bfloat16, "causal blocks"), ("cpu", jnp.float32, "causal blocks")]


@pytest.mark.parametrize("backend, dtype, want", AUTO_KERNELS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_auto_attention_picks_the_kernel_for_backend_and_dtype(monkeypatch, backend, dtype, want):
    """The dispatch itself, on any machine: the backend is stubbed and the kernels record
    that they ran, with 'xla' and 'cudnn' asked for explicitly as the references. Soft-capped
    scores (neither of dot_product_attention's kernels caps them) take the causal blocks everywhere."""
    from arlopti_jax.models import attention

    q = jnp.zeros((1, 4, 2, 8), dtype)
    kv = jnp.zeros((1, 4, 1, 8), dtype)
    mask = jnp.tril(jnp.ones((4, 4), bool))[None, None]
    ran = []
    monkeypatch.setattr(attention.jax, "default_backend", lambda: backend)
    monkeypatch.setattr(attention.jax.nn, "dot_product_attention",
                        lambda q, *a, implementation=None, **k: ran.append(implementation or "xla") or q)
    monkeypatch.setattr(attention, "_causal_blocks", lambda q, *a: ran.append("causal blocks") or q)
    for impl in ("auto", "xla", "cudnn"):
        attention.attention(q, kv, kv, mask, 0.35, impl)
    explicit_xla = "xla" if backend == "gpu" else "causal blocks"
    assert ran == [want, explicit_xla, "cudnn"]
    ran.clear()
    for impl in ("auto", "xla"):
        attention.attention(q, kv, kv, mask, 0.35, impl, softcap=2.0)
    assert ran == ["causal blocks"] * 2
    ran.clear()  # heads of 256 (Gemma 3's), which cuDNN's kernel refuses: 'auto' takes XLA's
    attention.attention(jnp.zeros((1, 4, 2, 256), dtype), *(jnp.zeros((1, 4, 1, 256), dtype),) * 2, mask, 0.35, "auto")
    assert ran == [explicit_xla]


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's fused attention needs a GPU")
def test_cudnn_attention_matches_xla_on_gpu(tmp_path):
    """cuDNN's fused kernel and XLA's attention, both in bfloat16, each within bfloat16 rounding
    of the float32 model's logits and log-probs, on left-padded rows."""
    folder = write_hf_model(tmp_path / "a")
    ids, mask = (jnp.asarray(a) for a in padded_batch(seed=5, length=64))
    valid = np.asarray(mask).astype(bool)

    def outputs(dtype, impl):
        cfg, params = load_pretrained(folder, mesh=_single_mesh(), dtype=dtype, attention=impl)
        return (np.asarray(logits(cfg, params, ids, mask))[valid],
                np.asarray(token_logprobs(cfg, params, ids, mask)[0])[valid])

    want = outputs("float32", "xla")
    for impl in ("cudnn", "xla"):
        for got, ref in zip(outputs("bfloat16", impl), want):
            assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2, impl


def _attention_case(shared: bool, dtype, cap: float | None = None):
    """Packed rows of 800 slots (3 uneven query blocks): row 0 holds two sequences then padding,
    or with ``shared`` a prompt and two responses that see it and not each other; row 1 is one
    sequence. Returns (q, k, v as float32 numpy, mask, float64 numpy softmax attention, its scaled
    scores s soft-capped to cap tanh(s / cap) with a ``cap``)."""
    from arlopti_jax.models.decoder import segment_mask

    rng = np.random.default_rng(0)
    b, t, n, kv, h = 2, 800, 4, 2, 8
    q, k, v = (np.asarray(jnp.asarray(rng.normal(0, 1, (b, t, heads, h)), dtype).astype(jnp.float32))
               for heads in (n, kv, kv))
    seg, prefix = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    seg[0, :70], seg[0, 70:700] = 1, 2
    seg[1, :] = 1
    if shared:
        seg[0, 400:700] = 3
        prefix[0, 70:700] = 1
    mask = segment_mask(jnp.asarray(seg), jnp.asarray(prefix) if shared else None)
    m = np.asarray(mask)[:, 0]
    s = np.einsum("btnh,bsnh->bnts", q.astype(np.float64), np.repeat(k, n // kv, axis=2).astype(np.float64)) * 0.3
    s = cap * np.tanh(s / cap) if cap else s
    s = np.where(m[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), np.repeat(v, n // kv, axis=2))
    return q, k, v, mask, want


@pytest.mark.parametrize("shared, cap", [(False, None), (True, None), (True, 1.5)],
                         ids=["segments", "shared-prefix", "shared-prefix-softcap"])
def test_causal_blocks_equal_plain_attention_forward_and_backward(shared, cap):
    """The CPU and TPU attention skips the key blocks above the diagonal and writes its own
    gradient (probabilities recomputed from the log-sum-exp): on packed rows, plain or with a
    shared prompt, with scores soft-capped or not, its output equals a float64 numpy softmax and its
    gradients equal autodiff through a plain softmax over all T x T scores."""
    from arlopti_jax.models.attention import _causal_blocks

    q, k, v, mask, want = _attention_case(shared, jnp.float32, cap)
    b, t, n, h = q.shape
    kv = k.shape[2]

    def plain(q, k, v):
        qh = q.transpose(0, 2, 1, 3).reshape(b, kv, n // kv, t, h)
        s = jnp.einsum("bkgth,bskh->bkgts", qh, k) * 0.3
        s = cap * jnp.tanh(s / cap) if cap else s
        p = jax.nn.softmax(jnp.where(mask[:, :, None], s, -1e30), axis=-1)
        return jnp.einsum("bkgts,bskh->bkgth", p, v).reshape(b, n, t, h).transpose(0, 2, 1, 3)

    got = jax.jit(lambda *a: _causal_blocks(*a, mask, 0.3, cap))(*(jnp.asarray(x) for x in (q, k, v)))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)
    w = np.random.default_rng(1).normal(0, 1, (b, t, n, h)).astype(np.float32)
    grads = [jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2)))(*(jnp.asarray(x) for x in (q, k, v)))
             for f in (lambda *a: _causal_blocks(*a, mask, 0.3, cap), plain)]
    for g_blocked, g_plain in zip(*grads):
        np.testing.assert_allclose(np.asarray(g_blocked), np.asarray(g_plain), atol=2e-5)


def test_causal_blocks_in_bfloat16_stay_within_its_rounding():
    """In bfloat16 (probabilities and score gradients rounded to it, as the TPU runs them), the
    output and the gradients stay as close to float32 autodiff as autodiff through bfloat16
    softmax attention does (the rounding a bfloat16 model has anyway), within 1.5x."""
    from arlopti_jax.models.attention import _causal_blocks

    q, k, v, mask, _ = _attention_case(True, jnp.bfloat16)
    b, t, n, h = q.shape
    kv = k.shape[2]
    w = jnp.asarray(np.random.default_rng(1).normal(0, 1, (b, t, n, h)), jnp.float32)

    def plain(q, k, v):
        qh = q.transpose(0, 2, 1, 3).reshape(b, kv, n // kv, t, h)
        s = jnp.einsum("bkgth,bskh->bkgts", qh, k, preferred_element_type=jnp.float32) * 0.3
        p = jax.nn.softmax(jnp.where(mask[:, :, None], s, -1e30), axis=-1).astype(v.dtype)
        return jnp.einsum("bkgts,bskh->bkgth", p, v).reshape(b, n, t, h).transpose(0, 2, 1, 3)

    def run(f, dtype):
        args = [jnp.asarray(x, dtype) for x in (q, k, v)]
        loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w)
        with jax.default_matmul_precision("highest"):
            return jax.jit(lambda *a: (f(*a), *jax.grad(loss, argnums=(0, 1, 2))(*a)))(*args)

    exact = run(plain, jnp.float32)
    errors = {name: [float(jnp.linalg.norm(a.astype(jnp.float32) - e) / jnp.linalg.norm(e))
                     for a, e in zip(run(f, jnp.bfloat16), exact)]
              for name, f in (("blocks", lambda *a: _causal_blocks(*a, mask, 0.3)), ("autodiff", plain))}
    for got, ref in zip(errors["blocks"], errors["autodiff"]):
        assert got < 1.5 * ref, errors
        assert got < 2e-2, errors
