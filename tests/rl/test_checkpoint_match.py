"""A checkpoint and the command that reads it: resume refuses another LoRA setting, data order or
parameter shape in one line before anything loads, and keeps the run's records; eval reads a
checkpoint at its own LoRA settings; export reads the parameters alone, on the devices at hand."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from run_fixtures import cli, make_config, overrides

from arlopti_jax import eval as eval_command
from arlopti_jax.rl import resume, run_setup
from arlopti_jax.store.checkpoint import Checkpointer

LORA = {"model.lora_rank": 4, "model.lora_alpha": 8.0, "model.lora_targets": "q,v"}


def _checkpoint(values: dict, step: int = 2):
    """A run folder holding checkpoint ``step`` of ``values``' run, written as the trainer writes
    one (zeros for the arrays: these tests read shapes and records), and its metrics.jsonl."""
    config = make_config(values)
    inputs = run_setup.prepare_inputs(config)
    mesh = run_setup.make_mesh(config)
    cfg = run_setup.model_config(config, inputs.model_path)
    abstract = resume.saved_state(cfg, run_setup.abstract_state(cfg, run_setup.make_optimizer(config, 4), mesh))
    state = jax.tree.map(lambda a: jax.device_put(jnp.zeros(a.shape, a.dtype), a.sharding), abstract)
    ckpt = resume.checkpointer(config)
    ckpt.save(step, state, resume.checkpoint_record(config, step, inputs.iterator.state_dict(), inputs.model_path,
                                                    inputs.base_sha256))
    ckpt.close()
    records = "".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in range(1, step + 1))
    with open(os.path.join(config.run_dir, "metrics.jsonl"), "w") as f:
        f.write(records)
    return records


@pytest.fixture(scope="module")
def lora_run(start_point, tmp_path_factory):
    """(the run's values, its metrics.jsonl) of a LoRA run folder with checkpoint 2 (read only)."""
    values = overrides(start_point, tmp_path_factory.mktemp("lora") / "run", **LORA)
    return values, _checkpoint(values)


@pytest.mark.parametrize("change,needle", [
    ({"model.lora_alpha": 16.0}, "config.model.lora_alpha=16.0 but the checkpoint .*/checkpoints/2 was written with "
                                 "8.0: resume with --config.model.lora_alpha=8.0"),
    ({"model.lora_rank": 8}, "config.model.lora_rank=8 but .* written with 4"),
    ({"model.lora_targets": "q,v,gate"}, "config.model.lora_targets=q,v,gate but .* written with q,v"),
    ({"train.batch_prompts": 2}, "config.train.batch_prompts=2 but .* written with 4: a resumed run keeps its data"),
    ({"data.shuffle_seed": 5}, "config.data.shuffle_seed=5 but"),
    ({"model.lora_rank": 0}, "config.model.lora_rank=0 but .* written with 4"),
])
def test_resuming_under_another_setting_is_refused_and_loses_no_record(lora_run, change, needle):
    values, records = lora_run
    with pytest.raises(ValueError, match=needle):
        run_setup.prepare_inputs(make_config({**values, **change, "resume": "auto"}))
    run_setup.prepare_inputs(make_config({**values, "resume": "auto"}))  # the run's own settings resume
    run_dir = Path(values["run_dir"])
    assert (run_dir / "metrics.jsonl").read_text() == records
    assert Checkpointer(run_dir / "checkpoints").steps() == [2]


def test_a_full_weights_checkpoint_of_another_model_is_refused_by_its_shapes(start_point, tmp_path):
    values = overrides(start_point, tmp_path / "run")
    _checkpoint(values)
    # another model: the start point's with twice its MLP width, a whole folder (weights as config.json says)
    from arlopti_jax.models import ModelConfig, init_params, save_pretrained
    from arlopti_jax.runtime import sharding as shd

    cfg = ModelConfig.from_pretrained(start_point / "model")
    cfg = cfg.replace(intermediate_size=2 * cfg.intermediate_size)
    other = save_pretrained(cfg, init_params(cfg, jax.random.key(1), shd.make_mesh({"fsdp": -1})),
                            tmp_path / "other_model", tokenizer_dir=start_point / "model")
    with pytest.raises(ValueError, match=r"the parameters of checkpoint .*/2 .* does not match this run: "
                                         r"layers/mlp/\w+ is float32\[.*\] there, float32\[.*\] here"):
        run_setup.prepare_inputs(make_config({**values, "model.path": str(other), "resume": "auto"}))


def test_the_command_line_refuses_a_typo_on_resume_in_one_line(lora_run):
    values, records = lora_run
    proc = subprocess.run(cli({**values, "model.lora_rank": 8}), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "config.model.lora_rank=8 but the checkpoint" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert (Path(values["run_dir"]) / "metrics.jsonl").read_text() == records


def test_eval_reads_a_checkpoint_at_its_own_lora_settings(lora_run, capsys):
    values, _ = lora_run
    config = make_config({**values, "model.lora_alpha": 16.0, "model.lora_targets": "q"})
    eval_command.adopt_checkpoint_settings(config, Path(values["run_dir"]) / "checkpoints" / "2")
    assert (config.model.lora_rank, config.model.lora_alpha, config.model.lora_targets) == (4, 8.0, "q,v")
    out = capsys.readouterr().out
    assert "note: model.lora_alpha=8.0 from the checkpoint" in out and "(this command's is 16.0)" in out
    assert "note: model.lora_targets=q,v" in out and "lora_rank" not in out
    # eval reads the parameters alone: another batch or data order is not a resume's mismatch
    other = make_config({**values, "train.batch_prompts": 2, "data.shuffle_seed": 9})
    eval_command.adopt_checkpoint_settings(other, Path(values["run_dir"]) / "checkpoints" / "2")
    resume.check_checkpoint(other, run_setup.model_config(other, Path(values["model.path"])),
                            folder=Path(values["run_dir"]) / "checkpoints" / "2", resuming=False)


def test_export_reads_the_parameters_alone_on_fewer_devices(lora_run, tmp_path):
    """A checkpoint saved on 8 devices (fsdp=8) exports in a process that has one."""
    values, _ = lora_run
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    proc = subprocess.run([sys.executable, "-m", "arlopti_jax.export", "--checkpoint",
                           str(Path(values["run_dir"]) / "checkpoints" / "2"), "--out", str(tmp_path / "adapter"),
                           "--adapter"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["revision"]) == (4, 8.0, None)
    assert adapter["target_modules"] == ["q_proj", "v_proj"]
