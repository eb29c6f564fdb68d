"""Run by tests/rollout/test_episodes.py in every process of ``launch/local.sh 2 --devices 4 --module
multiprocess_episodes``: each process runs the tool episodes of its share of the prompts, its host
answering its own rows (``episode_fixtures.ScriptedHost``, by global episode), the loop deciding from
the global counts the devices computed; each writes its rows to ``--out``/process_<i>.npz for the
test to compare with one process's 8 devices."""

import argparse
from pathlib import Path

import jax
import ml_collections
import numpy as np

from episode_fixtures import ScriptedHost
from length_aware_fixtures import MODEL, NUM_PROMPTS, N, prompts

TEXTS = ["" if i < 3 else "abc"[i % 3] + ("" if i % 4 else "abc"[i // 3 % 3]) for i in range(MODEL.vocab_size)]
TURNS = [1 + (e * 7) % 4 for e in range(NUM_PROMPTS * N)]
R = 48


def episodes(mesh, prompt_slice=slice(None), offset=0):
    """(rollout, turns) of ``prompts()[prompt_slice]`` on ``mesh`` (the tests' one-process run too)."""
    from arlopti_jax.models import init_params
    from arlopti_jax.rollout import Sampler, SamplingConfig
    from arlopti_jax.rollout.episodes import EpisodeSpec, episode_sampler
    from arlopti_jax.rollout.markers import marker_table

    params = init_params(MODEL, jax.random.key(0), mesh)
    host = ScriptedHost(marker_table(TEXTS, "aba", MODEL.vocab_size), lambda e: TURNS[e], first=True, offset=offset)
    sampling = SamplingConfig(max_response_len=R, temperature=1.2, eos_ids=(2,), phase_tokens=8, min_rows=1)
    sampler = episode_sampler(Sampler(MODEL, mesh), EpisodeSpec(turn_tokens=6, observation_tokens=5, marker_length=3))
    return sampler.generate(params, prompts()[prompt_slice], N, jax.random.key(5), sampling, host)


def main():
    ap = argparse.ArgumentParser()
    for name in ("coordinator", "num_processes", "process_id"):
        ap.add_argument(f"--config.distributed.{name}", dest=name)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    config = ml_collections.ConfigDict({"distributed": {
        "coordinator": args.coordinator, "num_processes": int(args.num_processes), "process_id": int(args.process_id),
        "heartbeat_timeout_s": 100}})

    from arlopti_jax.rollout import Sampler, SamplingConfig
    from arlopti_jax.runtime import distributed as dist
    from arlopti_jax.runtime import sharding as shd

    assert dist.initialize(config) and jax.process_count() == 2
    mesh = dist.process_contiguous(shd.make_mesh({"fsdp": -1}))
    mine = Sampler(MODEL, mesh).process_share(NUM_PROMPTS, SamplingConfig(max_response_len=R))
    rollout, turns = episodes(mesh, mine, offset=mine.start * N)
    assert len({rows for rows, _, _ in rollout.decode_loops}) > 1, rollout.decode_loops  # compacted
    np.savez(Path(args.out) / f"process_{jax.process_index()}.npz", start=mine.start, turns=turns,
             response_ids=rollout.response_ids, response_mask=rollout.response_mask,
             observation_mask=rollout.observation_mask, logprobs=rollout.logprobs, lengths=rollout.lengths)
    print(f"episodes done on process {jax.process_index()}", flush=True)


if __name__ == "__main__":
    main()
