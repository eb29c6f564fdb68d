"""Run by tests/runtime/test_distributed.py in every process of ``launch/local.sh 2 --devices 4 --module
multiprocess_checks``: the collectives of arlopti_jax.runtime.distributed and the sampler's process shares
and an orbax checkpoint saved and restored by both processes, on a real 2-process run, without
training. Prints ``checks passed on process <i>``."""

import argparse

import jax
import ml_collections
import numpy as np


def main():
    ap = argparse.ArgumentParser()
    for name in ("coordinator", "num_processes", "process_id"):
        ap.add_argument(f"--config.distributed.{name}", dest=name)
    ap.add_argument("--checkpoints", required=True, help="a folder both processes see")
    args = ap.parse_args()
    config = ml_collections.ConfigDict({"distributed": {
        "coordinator": args.coordinator, "num_processes": int(args.num_processes), "process_id": int(args.process_id),
        "heartbeat_timeout_s": 100}})

    from arlopti_jax.runtime import distributed as dist
    from arlopti_jax.runtime import sharding as shd
    from arlopti_jax.store.checkpoint import Checkpointer
    from arlopti_jax.models import ModelConfig
    from arlopti_jax.rollout import Sampler, SamplingConfig

    assert dist.initialize(config) and jax.process_count() == 2 and jax.device_count() == 8
    pid = jax.process_index()
    # a preemption signal on one process stops every process
    assert dist.any_process(pid == 1) and not dist.any_process(False)
    # uneven per-process rows (eval chunks) come back whole, in process order
    a, b = dist.gather(np.arange(3 * pid, 3 * pid + 2 + pid), np.full(2 + pid, pid == 0))
    assert a.tolist() == [0, 1, 3, 4, 5] and b.tolist() == [True, True, False, False, False], (a, b)
    # JSON values of different sizes, in process order; reward dicts' numbers over the keys any process's gave
    assert dist.gather_json({"p": pid, "keys": ["a"] * (1 + 3 * pid)}) == [{"p": 0, "keys": ["a"]},
                                                                          {"p": 1, "keys": ["a"] * 4}]
    from arlopti_jax.rl.evaluation import gather_info

    info = gather_info({"fmt": np.full(2 + pid, pid, np.float32)} if pid == 0 else
                       {"fmt": np.ones(3, np.float32), "len": np.arange(3, dtype=np.float32)}, 2 + pid)
    assert sorted(info) == ["fmt", "len"] and info["fmt"].tolist() == [0, 0, 1, 1, 1], info
    assert np.isnan(info["len"][:2]).all() and info["len"][2:].tolist() == [0, 1, 2], info
    # process-local rows -> a global batch -> this process's rows again; the whole array on every host
    mesh = dist.process_contiguous(shd.make_mesh({"fsdp": -1}))
    local = np.arange(8 * pid, 8 * pid + 8, dtype=np.float32).reshape(4, 2)
    glob = dist.global_rows({"x": local}, mesh)["x"]
    assert glob.shape == (8, 2) and not glob.is_fully_addressable
    np.testing.assert_array_equal(dist.local_rows(glob), local)
    np.testing.assert_array_equal(dist.to_host(glob), np.arange(16, dtype=np.float32).reshape(8, 2))
    assert int(dist.to_host(dist.replicated(np.int32(7), mesh))) == 7
    # eval's split of 6 prompts matches one process's padded layout of 8 rows: [0..3] and [4, 5]
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16)
    sampling = SamplingConfig(max_response_len=4)
    share = Sampler(cfg, mesh).process_share(6, sampling)
    assert (share.start, share.stop) == ((0, 4) if pid == 0 else (4, 6)), share
    batch = Sampler(cfg, mesh).pad_prompts([[5, 6]] * (share.stop - share.start), sampling)
    assert batch.global_rows == 8 and batch.ids.shape[0] == 4
    # every process writes its shards of a checkpoint; both restore it into the same shardings
    state = {"w": glob, "rng": dist.replicated(np.arange(2, dtype=np.uint32), mesh)}
    ckpt = Checkpointer(args.checkpoints)
    ckpt.save(5, state, {"step": 5, "data": {"epoch": 0, "index": 40}})
    ckpt.close()
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    ckpt = Checkpointer(args.checkpoints)
    step, restored, meta = ckpt.restore_latest(target)
    ckpt.close()
    assert step == 5 and meta["data"] == {"epoch": 0, "index": 40}
    np.testing.assert_array_equal(dist.local_rows(restored["w"]), local)
    np.testing.assert_array_equal(dist.to_host(restored["rng"]), [0, 1])
    print(f"checks passed on process {pid}", flush=True)


if __name__ == "__main__":
    main()
