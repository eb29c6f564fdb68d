"""Qwen3 and Gemma 3 through the trainer's command: tiny random models written by transformers (with
the embedded start point's tokenizer and data), the Qwen3 one laid out as a Hugging Face Hub
cache and named by its id, offline, train a few RL steps on the CPU with
``python -m arlopti_jax.train``; their exported folders load in transformers and give our logits."""

import json
import math
import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from arlopti_jax.models import hf, load_pretrained, logits
from arlopti_jax.runtime import sharding as shd
from hf_fixtures import gemma3_attention_softcap, hf_model, hub_cache, write_hf_model
from run_fixtures import cli, overrides, step_metrics

COMMIT = "3333333333333333333333333333333333333333"
HUB_ID = "TestOrg/tiny-qwen3"


@pytest.mark.slow  # two runs of the trainer's command, about 50 s each on 2 cores
@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_rl_steps_from_the_command_then_the_export_loads_in_transformers_with_our_logits(kind, start_point,
                                                                                          tmp_path):
    import torch

    vocab = json.loads((start_point / "model" / "config.json").read_text())["vocab_size"]
    folder = write_hf_model(tmp_path / "model", kind=kind, tied=kind == "gemma3", vocab_size=vocab)
    for name in hf.TOKENIZER_FILES:  # the start point's tokenizer: its prompts are this model's
        if (start_point / "model" / name).is_file():
            shutil.copy2(start_point / "model" / name, folder / name)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    path = str(folder)
    if kind == "qwen3":
        hub_cache(tmp_path / "hf_home", HUB_ID, folder, COMMIT)
        path = HUB_ID
    run_dir = tmp_path / "run"
    values = overrides(start_point, run_dir, **{"model.path": path, "train.max_steps": 2, "train.save_every": 2,
                                               "train.export_at_end": True, "optim.lr": 1e-3})
    proc = subprocess.run(cli(values), capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = step_metrics(run_dir)
    assert set(metrics) >= {1, 2} and all(math.isfinite(metrics[s]["update/low/pg_loss"]) for s in (1, 2))

    export = run_dir / "export"
    before, after = load_file(folder / "model.safetensors"), load_file(export / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    assert np.abs(after[name] - before[name]).max() > 0  # the steps moved the weights
    cfg, params = load_pretrained(export, mesh=shd.make_mesh({"fsdp": 1}, devices=jax.devices()[:1]))
    assert cfg.architecture == {"qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[kind]
    rng = np.random.default_rng(0)
    ids = rng.integers(3, vocab, (2, 16))
    mask = np.ones_like(ids)
    mask[1, :5] = 0  # left padding
    ours = np.asarray(logits(cfg, params, jnp.asarray(ids), jnp.asarray(mask)))
    with torch.no_grad(), gemma3_attention_softcap():
        theirs = hf_model(export)(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                                  position_ids=torch.tensor(np.maximum(mask.cumsum(-1) - 1, 0))).logits.numpy()
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], theirs[real], atol=1e-4)
