"""A LoRA run (``model.lora_rank``): only the adapters train, the base stays bit for bit the
folder's, the optimizer holds state for the adapters alone, and the export is the merged model."""

import json

import jax
import numpy as np
import pytest
from run_fixtures import kill_after_checkpoint, make_config, overrides, step_metrics

from arlopti_jax import export
from arlopti_jax.models import load_params, load_pretrained, logits, lora
from arlopti_jax.rl import run_setup
from arlopti_jax.rl.loop import train
from arlopti_jax.store.checkpoint import Checkpointer


LORA = {"model.lora_rank": 4, "model.lora_alpha": 8.0, "model.lora_targets": "q,v,gate", "optim.lr": 1e-3}


def test_a_lora_run_trains_the_adapters_alone(start_point, tmp_path):
    values = overrides(start_point, tmp_path / "run", **{
        "train.max_steps": 2, "train.save_every": 2, "train.export_at_end": True, **LORA})
    summary = train(make_config(values))
    assert not summary["preempted"]

    config = make_config(values)
    mesh = run_setup.make_mesh(config)
    cfg = run_setup.model_config(config, start_point / "model")
    optimizer = run_setup.make_optimizer(config, 2)
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints")
    state, _ = ckpt.restore(2, run_setup.abstract_state(cfg, optimizer, mesh))
    ckpt.close()
    base, adapters = lora.split(state["params"])
    folder = load_params(start_point / "model", cfg.replace(lora_rank=0), mesh)
    for got, want in zip(jax.tree.leaves(base), jax.tree.leaves(folder), strict=True):
        np.testing.assert_array_equal(got, want)  # the base never moved
    flat = jax.tree_util.tree_flatten_with_path(adapters)[0]
    assert {str(p[-1].key) for p, _ in flat} == {f"{t}_lora_{m}" for t in ("q", "v", "gate") for m in "ab"}
    assert all(np.abs(np.asarray(b)).max() > 0 for p, b in flat if str(p[-1].key).endswith("_lora_b"))  # trained
    # AdamW's two moments cover the adapters and nothing else
    sizes = lambda tree: sum(x.size for x in jax.tree.leaves(tree) if np.ndim(x))
    assert sizes(state["opt_state"]) == 2 * sizes(adapters)

    # the adapters alone, in PEFT's layout (tests/models/test_lora.py loads that layout with peft)
    assert export.main(["--checkpoint", str(tmp_path / "run" / "checkpoints" / "2"), "--out",
                        str(tmp_path / "adapter"), "--adapter"]) == 0
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8.0 and adapter["target_modules"] == [
        "gate_proj", "q_proj", "v_proj"]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()

    # the exported folder is the merged model: a plain checkpoint with the LoRA model's logits
    export_cfg, exported = load_pretrained(tmp_path / "run" / "export", mesh=mesh)
    assert export_cfg.lora_rank == 0
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 9)).astype(np.int32)
    mask = np.ones_like(ids)
    np.testing.assert_allclose(logits(export_cfg, exported, ids, mask), logits(cfg, state["params"], ids, mask),
                               atol=2e-4, rtol=2e-4)


@pytest.mark.slow  # two runs of 4 steps and a killed one
def test_a_killed_lora_run_resumes_to_the_uninterrupted_one(start_point, tmp_path):
    """On the tests' 8 host devices (fsdp=8): the adapters sharded like their weights."""
    train(make_config(overrides(start_point, tmp_path / "a", **LORA)))
    want = step_metrics(tmp_path / "a")
    values = overrides(start_point, tmp_path / "b", **LORA)
    kill_after_checkpoint(values)
    train(make_config({**values, "resume": "auto"}))
    got = step_metrics(tmp_path / "b")
    assert set(got) == set(want) == {1, 2, 3, 4}
    for step in want:
        assert got[step] == want[step], f"step {step} differs after resume"
