"""Run by tests/rollout/test_length_aware.py in every process of ``launch/local.sh 2 --devices 4 --module
multiprocess_sampler``: each process samples its share of the prompts with the dense and the
length-aware sampler (forced EOS lengths, so rows finish and the batch is compacted while the
processes decide together from global live counts), checks that both agree, and writes its rows
to ``--out``/process_<i>.npz for the test to compare with one process."""

import argparse
from pathlib import Path

import jax
import ml_collections
import numpy as np

from length_aware_fixtures import MODEL, NUM_PROMPTS, N, prompts, sampling, stops


def main():
    ap = argparse.ArgumentParser()
    for name in ("coordinator", "num_processes", "process_id"):
        ap.add_argument(f"--config.distributed.{name}", dest=name)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    config = ml_collections.ConfigDict({"distributed": {
        "coordinator": args.coordinator, "num_processes": int(args.num_processes), "process_id": int(args.process_id),
        "heartbeat_timeout_s": 100}})

    from arlopti_jax.runtime import distributed as dist
    from arlopti_jax.runtime import sharding as shd
    from arlopti_jax.models import init_params
    from arlopti_jax.rollout import Sampler

    assert dist.initialize(config) and jax.process_count() == 2
    mesh = dist.process_contiguous(shd.make_mesh({"fsdp": -1}))
    params = init_params(MODEL, jax.random.key(0), mesh)
    sampler = Sampler(MODEL, mesh)
    mine = sampler.process_share(NUM_PROMPTS, sampling(True))
    rows = slice(mine.start * N, mine.stop * N)
    key = jax.random.key(5)
    dense = sampler.generate(params, prompts()[mine], N, key, sampling(False), stop_at=stops()[rows])
    batch = sampler.pad_prompts(prompts()[mine], sampling(True))
    done = sampler.decode(params, sampler.start(params, batch, N, key, sampling(True), stops()[rows]), key,
                          sampling(True))
    assert len({r for r, _, _ in done.loops}) > 1, done.loops  # compacted
    aware = sampler.generate(params, prompts()[mine], N, key, sampling(True), stop_at=stops()[rows])
    np.testing.assert_array_equal(aware.response_ids, dense.response_ids)
    np.testing.assert_allclose(aware.logprobs, dense.logprobs, atol=1e-5)
    np.savez(Path(args.out) / f"process_{jax.process_index()}.npz", start=mine.start,
             response_ids=aware.response_ids, logprobs=aware.logprobs, lengths=aware.lengths)
    print(f"sampler checks passed on process {jax.process_index()}", flush=True)


if __name__ == "__main__":
    main()
