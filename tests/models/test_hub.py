"""model.path as a Hugging Face Hub id, resolved through huggingface_hub against a real Hub cache
laid out on disk (blobs, snapshots linking to them, refs), offline: no network, no mock."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from hf_fixtures import hub_cache

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def run(args, home, startup_only=True):
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    if startup_only:
        env["ARLOPTI_STARTUP_CHECK"] = "1"
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def hub_home(start_point, tmp_path_factory):
    """A Hub cache holding the start point's model as TestOrg/kk-tiny (main), a second snapshot
    with an unsupported architecture as TestOrg/kk-tiny@mistral, and TestOrg/other (a Mistral)."""
    home = tmp_path_factory.mktemp("hf_home")
    hub_cache(home, "TestOrg/kk-tiny", start_point / "model", COMMIT)
    other = tmp_path_factory.mktemp("mistral")
    shutil.copytree(start_point / "model", other, dirs_exist_ok=True)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"],
                                                   "model_type": "mistral"}))
    hub_cache(home, "TestOrg/kk-tiny", other, OTHER, branch="mistral")
    return home


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(hub_home, start_point, tmp_path):
    code = ("from arlopti_jax.models import hub; import sys\n"
            "for p in sys.argv[1:]: print(hub.resolve(p))")
    ids = ["TestOrg/kk-tiny", f"TestOrg/kk-tiny@{COMMIT}", "TestOrg/kk-tiny@mistral", str(start_point / "model")]
    env = {**os.environ, "HF_HOME": str(hub_home), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code, *ids], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = proc.stdout.split()
    snapshots = hub_home / "hub" / "models--TestOrg--kk-tiny" / "snapshots"
    assert got == [str(snapshots / COMMIT), str(snapshots / COMMIT), str(snapshots / OTHER), str(start_point / "model")]
    assert json.loads((snapshots / COMMIT / "config.json").read_text()) == \
        json.loads((start_point / "model" / "config.json").read_text())


@pytest.mark.parametrize("module", ["arlopti_jax.eval", *(pytest.param(m, marks=pytest.mark.slow) for m in (
    "arlopti_jax.train", "arlopti_jax.sft", "arlopti_jax.aot"))])  # 9-10 s each: the others in the slow pass
def test_commands_start_from_a_hub_id_and_refuse_a_missing_one_or_an_unsupported_architecture(
        module, hub_home, start_point, tmp_path):
    from arlopti_jax.embedded.start_point import compact_rows, sft_target

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": r["prompt"], "response": sft_target(r)}) + "\n"
                             for r in compact_rows(2, 32, seed=0)))
    data = {"arlopti_jax.sft": [f"--config.data.files={pairs}", f"--config.out_dir={tmp_path / 'sft'}",
                                "--config.train.batch=4"],
            "arlopti_jax.aot": ["--target=local"]}.get(module, [
        f"--config.data.train_files={start_point / 'data' / 'train.parquet'}",
        f"--config.data.test_files={start_point / 'data' / 'test_2ppl.parquet'}",
        f"--config.run_dir={tmp_path / 'run'}"])
    ok = run([module, "--config.model.path=TestOrg/kk-tiny", *data], hub_home)
    assert ok.returncode == 0 and "start-up check passed" in ok.stdout + ok.stderr, ok.stderr[-3000:]
    for path in ("TestOrg/absent-model", "TestOrg/kk-tiny@mistral"):
        proc = run([module, f"--config.model.path={path}", *data], hub_home)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1 and path in errors[0], proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
    assert "MistralForCausalLM" in errors[0] and "unsupported" in errors[0]
