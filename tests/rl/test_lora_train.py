"""A LoRA run (``model.lora_rank``): only the adapters train, the base stays bit for bit the
folder's, the optimizer holds state for the adapters alone, and the export is the merged model."""

import hashlib
import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import safetensors.numpy
from run_fixtures import assert_nothing_compiled_late, kill_after_checkpoint, make_config, overrides, step_metrics

from arlopti_jax import export
from arlopti_jax.models import load_params, load_pretrained, logits, lora
from arlopti_jax.rl import resume, run_setup
from arlopti_jax.experiments.sweep import MATCHED_METHODS, METHOD_BASE, VARIANTS
from arlopti_jax.rl.loop import train
from arlopti_jax.store.checkpoint import Checkpointer


LORA = {"model.lora_rank": 4, "model.lora_alpha": 8.0, "model.lora_targets": "q,v,gate", "optim.lr": 1e-3}


@pytest.mark.slow  # end to end, about a minute on 2 cores; CI runs the slow tests
def test_a_lora_run_trains_the_adapters_alone(start_point, tmp_path, capsys, caplog):
    base_dir = tmp_path / "base"  # a copy: changed below, to see a checkpoint refuse another base
    shutil.copytree(start_point / "model", base_dir)
    values = overrides(start_point, tmp_path / "run", **{
        "model.path": str(base_dir), "train.max_steps": 2, "train.save_every": 2, "train.export_at_end": True,
        **LORA})
    summary = train(make_config(values))
    assert not summary["preempted"]
    late = [r.getMessage() for r in caplog.records if "after the warm-up" in r.getMessage()]
    assert not [m for m in late if "merge" in m], late  # the end's merge is the export's, not a late compile
    assert_nothing_compiled_late(summary)  # the sampler's merged weights included (warm-up)

    config = make_config(values)
    mesh = run_setup.make_mesh(config)
    cfg = run_setup.model_config(config, base_dir)
    optimizer = run_setup.make_optimizer(config, 2)
    step_dir = tmp_path / "run" / "checkpoints" / "2"
    ckpt = Checkpointer(step_dir.parent)
    state, meta = ckpt.restore(2, resume.saved_state(cfg, run_setup.abstract_state(cfg, optimizer, mesh)))
    ckpt.close()
    # the checkpoint holds the adapters, their optimizer state and the base's hash, not the base
    adapters = state["params"]
    assert lora.split(adapters)[0] == {}
    assert meta["base_sha256"] == hashlib.sha256(b"".join(
        name.encode() + b"\0" + hashlib.sha256((base_dir / name).read_bytes()).digest()
        for name in sorted(["config.json", "model.safetensors"]))).hexdigest()
    ckpt_bytes = sum(f.stat().st_size for f in (step_dir / "state").rglob("*") if f.is_file())
    assert ckpt_bytes < (base_dir / "model.safetensors").stat().st_size / 4
    flat = jax.tree_util.tree_flatten_with_path(adapters)[0]
    assert {str(p[-1].key) for p, _ in flat} == {f"{t}_lora_{m}" for t in ("q", "v", "gate") for m in "ab"}
    assert all(np.abs(np.asarray(b)).max() > 0 for p, b in flat if str(p[-1].key).endswith("_lora_b"))  # trained
    # AdamW's two moments cover the adapters and nothing else
    sizes = lambda tree: sum(x.size for x in jax.tree.leaves(tree) if np.ndim(x))
    assert sizes(state["opt_state"]) == 2 * sizes(adapters)

    # the adapters alone, in PEFT's layout (tests/models/test_lora.py loads that layout with peft)
    assert export.main(["--checkpoint", str(step_dir), "--out", str(tmp_path / "adapter"), "--adapter"]) == 0
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8.0 and adapter["target_modules"] == [
        "gate_proj", "q_proj", "v_proj"]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()

    # the exported folders are the merged model: plain checkpoints with the LoRA model's logits, at the
    # run's end and from the checkpoint (the adapters on the base folder's weights)
    whole = lora.combine(load_params(base_dir, cfg.replace(lora_rank=0), mesh), adapters)
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 9)).astype(np.int32)
    mask = np.ones_like(ids)
    want = logits(cfg, whole, ids, mask)
    assert export.main(["--checkpoint", str(step_dir), "--out", str(tmp_path / "merged")]) == 0
    for folder in (tmp_path / "run" / "export", tmp_path / "merged"):
        export_cfg, exported = load_pretrained(folder, mesh=mesh)
        assert export_cfg.lora_rank == 0
        np.testing.assert_allclose(logits(export_cfg, exported, ids, mask), want, atol=2e-4, rtol=2e-4)

    # `eval --checkpoint` of the LoRA run scores what the merged folder scores
    test_file = sorted((start_point / "data").glob("test*.parquet"))[0]
    flags = [f"--config.{k}={v}" for k, v in {**values, "data.train_files": "", "data.test_files": test_file,
                                                "run_dir": tmp_path / "eval"}.items()]
    evaluate = lambda *extra: subprocess.run([sys.executable, "-m", "arlopti_jax.eval", *flags, *extra],
                                             capture_output=True, text=True, timeout=300)
    proc = evaluate(f"--checkpoint={step_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = evaluate(f"--config.model.path={tmp_path / 'merged'}", "--config.model.lora_rank=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lora_eval, merged_eval = (json.loads(line) for line in (tmp_path / "eval" / "eval.jsonl").read_text().splitlines())
    key = f"eval/{test_file.stem}/greedy_reward"  # the accuracy of this tiny start point is 0
    assert lora_eval[key] == merged_eval[key] != 0, (lora_eval[key], merged_eval[key])

    # another base under the same path: resuming, exporting and evaluating are refused in one line
    weights = safetensors.numpy.load_file(base_dir / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name] + np.ones_like(weights[name])
    safetensors.numpy.save_file(weights, base_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"checkpoints/2 holds adapters trained on the base .*not on .*base"):
        run_setup.prepare_inputs(make_config({**values, "resume": "auto"}))
    capsys.readouterr()
    assert export.main(["--checkpoint", str(step_dir), "--out", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "use the same base model" in err
    assert not (tmp_path / "other").exists()
    proc = evaluate(f"--checkpoint={step_dir}")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"error: {step_dir} holds adapters") and "use the same base model" in proc.stderr


def test_a_checkpoint_and_a_config_that_disagree_on_lora_are_refused(tmp_path):
    for saved_rank, rank, needle in ((0, 4, "model.lora_rank=0; this one has model.lora_rank=4"),
                                     (4, 0, "model.lora_rank=4; this one has model.lora_rank=0"),
                                     (4, 4, "records no base model hash")):
        folder = tmp_path / f"r{saved_rank}_{rank}" / "checkpoints" / "3"
        (folder / "meta").mkdir(parents=True)
        (folder / "meta" / "metadata").write_text(json.dumps(
            {"step": 3, "config": json.dumps({"model": {"lora_rank": saved_rank}})}))
        with pytest.raises(ValueError, match=needle):
            resume.check_checkpoint_base(folder, tmp_path, rank)


@pytest.mark.slow  # two runs of 4 steps and a killed one
def test_a_killed_lora_run_resumes_to_the_uninterrupted_one(start_point, tmp_path):
    """On the tests' 8 host devices (fsdp=8): the adapters sharded like their weights."""
    train(make_config(overrides(start_point, tmp_path / "a", **LORA)))
    want = step_metrics(tmp_path / "a")
    values = overrides(start_point, tmp_path / "b", **LORA)
    kill_after_checkpoint(values)
    assert_nothing_compiled_late(train(make_config({**values, "resume": "auto"})))
    got = step_metrics(tmp_path / "b")
    assert set(got) == set(want) == {1, 2, 3, 4}
    for step in want:
        assert got[step] == want[step], f"step {step} differs after resume"


@pytest.mark.slow  # one step of each method
@pytest.mark.parametrize("variant", [*MATCHED_METHODS, "dapo_filter"])
def test_every_method_trains_the_adapters(variant, start_point, tmp_path):
    """Each method of the matched comparison, and DAPO's group filter, with LoRA: a step that
    moves the adapters (a finite, nonzero gradient), with the quartile diagnostics and the
    shared-prefix update as the defaults run them."""
    method = {**METHOD_BASE, **({"algo.filter_groups": True} if variant == "dapo_filter" else VARIANTS[variant][1])}
    values = overrides(start_point, tmp_path / "run", **{**LORA, **method, "train.max_steps": 1,
                                                         "train.save_every": 1, "train.diagnostics_every": 1})
    assert not train(make_config(values))["preempted"]
    [metrics] = step_metrics(tmp_path / "run").values()
    norms = [v for k, v in metrics.items() if k.startswith("update/") and k.endswith("grad_norm")]  # Lopti: 2
    assert len(norms) == (2 if "lopti" in variant else 1) and all(np.isfinite(norms)) and max(norms) > 0, metrics
    assert all(metrics[f"quartile/q{i}_grad_norm"] > 0 for i in range(1, 5)), metrics  # the diagnostics' passes
