"""A LoRA run (``model.lora_rank``): only the adapters train, the base stays bit for bit the
folder's, the optimizer holds state for the adapters alone, and the export is the merged model."""

import jax
import numpy as np
from run_fixtures import make_config, overrides

from arlopti_jax.models import load_params, load_pretrained, logits, lora
from arlopti_jax.rl import run_setup
from arlopti_jax.rl.loop import train
from arlopti_jax.store.checkpoint import Checkpointer


def test_a_lora_run_trains_the_adapters_alone(start_point, tmp_path):
    values = overrides(start_point, tmp_path / "run", **{
        "train.max_steps": 2, "train.save_every": 2, "train.export_at_end": True, "model.lora_rank": 4,
        "model.lora_alpha": 8.0, "model.lora_targets": "q,v,gate", "optim.lr": 1e-3})
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

    # the exported folder is the merged model: a plain checkpoint with the LoRA model's logits
    export_cfg, exported = load_pretrained(tmp_path / "run" / "export", mesh=mesh)
    assert export_cfg.lora_rank == 0
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 9)).astype(np.int32)
    mask = np.ones_like(ids)
    np.testing.assert_allclose(logits(export_cfg, exported, ids, mask), logits(cfg, state["params"], ids, mask),
                               atol=2e-4, rtol=2e-4)
