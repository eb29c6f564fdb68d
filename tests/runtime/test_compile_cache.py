"""JAX's persistent compilation cache, turned on by the command lines from
``config.compile_cache_dir``: a second process compiles nothing that the first compiled."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A command line's start (the trainer's flags, with the cache folder overridden), then a tiny
# model's sampler (length-aware: prefill, start, decode loops, compact, grow, scatter) and
# teacher-forced log-prob pass. JAX's monitoring events count the compile requests that went
# through the cache, the ones it answered and the entries written.
SCRIPT = r"""
import json, sys
import jax
from ml_collections import config_flags
from arlopti_jax.config.cli import parse_command_line
from arlopti_jax.config import DEFAULT_CONFIG
from arlopti_jax.train import COMMAND

events = {"/jax/compilation_cache/compile_requests_use_cache": "requests",
          "/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "written"}
counts = dict.fromkeys(events.values(), 0)
jax.monitoring.register_event_listener(lambda event, **_: event in events and counts.update(
    {events[event]: counts[events[event]] + 1}))
define = lambda: config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "config", lock_config=True)
cache_dir = sys.argv[1]
sys.argv = ["train", "--config.compile_cache_dir=" + cache_dir]  # ml_collections reads sys.argv when it defines
parse_command_line(sys.argv, COMMAND, define)

import numpy as np
from arlopti_jax import algos
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.models import ModelConfig, init_params
from arlopti_jax.rollout import Sampler, SamplingConfig

cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8)
mesh = shd.make_mesh({"fsdp": -1})
params = init_params(cfg, jax.random.key(0), mesh)
sampling = SamplingConfig(max_response_len=8, eos_ids=(2,), phase_tokens=2, min_rows=1)
roll = Sampler(cfg, mesh).generate(params, [[5, 6, 7], [8, 9]], 4, jax.random.key(1), sampling,
                                   stop_at=np.array([1, 2, 3, 8, 2, 5, 9, 9]))
batch = roll.train_batch()
logp = algos.make_compute_logprobs(cfg, mesh, tokens_per_device=64)(params, batch)
print(json.dumps({**counts, "loops": len(roll.decode_loops), "tokens": roll.response_ids.tolist(),
                  "logp": np.asarray(logp).round(6).tolist(), "cache": jax.config.jax_compilation_cache_dir}))
"""


def _run(cache: Path) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(cache)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # default-suite budget (10 minutes on 2 cores): CI runs it in the slow pass
def test_second_process_compiles_nothing_new(tmp_path):
    first, second = _run(tmp_path / "cache"), _run(tmp_path / "cache")
    assert Path(first["cache"]).parent == tmp_path / "cache"  # the config field's folder (a subfolder per CPU)
    assert first["loops"] >= 3  # the length-aware schedule compacted and grew: its programs are in there
    assert first["requests"] >= 10 and first["written"] == first["requests"] and first["hits"] == 0
    assert second["requests"] == first["requests"]
    assert second["hits"] == second["requests"] and second["written"] == 0  # everything read back
    assert second["tokens"] == first["tokens"] and second["logp"] == first["logp"]


def test_a_remote_folder_is_not_a_local_one(tmp_path, monkeypatch):
    """``gs://bucket/...`` goes to JAX as the URL it is (not a local folder named 'gs:'); without its
    storage backend (gcsfs) the command stops at start-up with one line."""
    import jax
    from etils import epath

    from arlopti_jax.runtime import compile_cache

    monkeypatch.chdir(tmp_path)
    before = jax.config.jax_compilation_cache_dir
    try:
        made = []

        class Remote:  # a storage backend that works, standing in for gcsfs
            def __init__(self, url):
                self.url = url

            def mkdir(self, parents, exist_ok):
                made.append(self.url)

        monkeypatch.setattr(epath, "Path", Remote)
        folder = compile_cache.enable("gs://bucket/jax_cache/")
        assert folder.startswith("gs://bucket/jax_cache/") and made == [folder]
        assert jax.config.jax_compilation_cache_dir == folder
        monkeypatch.undo()
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    assert not any(tmp_path.iterdir())  # no local "gs:" folder
    env = {**os.environ, "ARLOPTI_STARTUP_CHECK": "1"}
    # s3fs is not among the extras (gcsfs is, and a gs:// bucket would be looked up on the network)
    proc = subprocess.run([sys.executable, "-m", "arlopti_jax.train", "--config.compile_cache_dir=s3://bucket/x"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: config.compile_cache_dir=s3://bucket/x cannot be used") and "s3fs" in lines[0]
    assert not (tmp_path / "s3:").exists()


def test_the_cache_settings_are_made_in_one_place(tmp_path):
    """``compile_cache.use`` makes the three settings (folder, every program cached, JAX's size bound off);
    ``enable`` (local and remote) and the sweep's own folder go through it, and no other module sets them."""
    import jax

    from arlopti_jax.runtime import compile_cache

    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs", "jax_compilation_cache_max_size")
    before = {k: getattr(jax.config, k) for k in keys}
    try:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        jax.config.update("jax_compilation_cache_max_size", 1 << 20)
        assert compile_cache.use(tmp_path / "a") == tmp_path / "a"
        assert {k: getattr(jax.config, k) for k in keys} == dict(zip(keys, (str(tmp_path / "a"), 0.0, -1)))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        folder = compile_cache.enable(str(tmp_path / "b"))
        assert folder.parent == tmp_path / "b"
        assert {k: getattr(jax.config, k) for k in keys} == dict(zip(keys, (str(folder), 0.0, -1)))
    finally:
        for k, v in before.items():
            jax.config.update(k, v)
    package = Path(compile_cache.__file__).parents[1]
    setters = [str(p.relative_to(package)) for p in package.rglob("*.py")
               if re.search(r"config\.update\(\s*\"jax_(compilation_cache_dir|persistent_cache_min)", p.read_text())]
    assert setters == ["runtime/compile_cache.py"]


def test_trim_deletes_the_least_recently_used_entries_beyond_the_bound(tmp_path, monkeypatch):
    """Under the bound nothing goes; over it, the entries used longest ago go first, down to three
    quarters of the bound; ``enable`` trims its folder with ``MAX_BYTES``."""
    import time

    import jax

    from arlopti_jax.runtime import compile_cache

    now = time.time()
    for name, age in {"a-cache": 50, "b-cache": 10, "c-cache": 40, "d-cache": 20, "e-cache": 30}.items():
        (tmp_path / name).write_bytes(b"x" * 100)
        os.utime(tmp_path / name, (now - age, now - age))
    (tmp_path / ".lockfile").write_bytes(b"")
    assert compile_cache.trim(tmp_path, max_bytes=500) == 0
    assert compile_cache.trim(tmp_path, max_bytes=400) == 2  # 500 bytes > 400: down to 300, oldest first
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lockfile", "b-cache", "d-cache", "e-cache"]

    host = tmp_path / "run" / compile_cache._host_tag()
    host.mkdir(parents=True)
    (host / "old-cache").write_bytes(b"x" * 64)
    monkeypatch.setattr(compile_cache, "MAX_BYTES", 32)
    before = jax.config.jax_compilation_cache_dir
    try:
        assert compile_cache.enable(str(tmp_path / "run")) == host
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    assert not (host / "old-cache").exists()
