"""The cost of the turns: an RL step on tool episodes of several turns against one on single-turn
responses of the same total tokens, SmolLM2-135M-Instruct.

    python bench/episode_cost.py [--model models/smollm2-135m --turns 3 --turn-tokens 32 --observation-tokens 16]
                                 [--rounds 3] [--micro-batch 4]

Both arms sample ``--prompts`` x ``--n`` rows from the same calc prompts with the run's own sampler
(configs/smollm2.py's settings; ``--config`` another file) and update on them (GRPO, random rewards):

- episodes: ``--turns`` turns of exactly ``--turn-tokens`` drawn tokens each (no EOS, so every turn
  ends at its cap), each but the last answered by an observation of exactly ``--observation-tokens``
  ids (``rollout/episodes.py``: fed one per decode step, the loop leaving to the host at each turn);
- single turn: responses of the same length, turns x turn-tokens + (turns - 1) x observation-tokens,
  drawn without a stop (``Sampler.generate``).

Each arm's step is timed after one warm-up step that compiles it, the arms interleaved for
``--rounds`` rounds; printed per arm: seconds per step (rollout, update, all), tokens per second
(the episode's tokens after the prompt, observations included), the decode loops and row-steps
the sampler ran. The sequences forwarded by the update are the same length in both arms; the
episodes' loss reads fewer tokens (the observations are masked out).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from arlopti_jax import algos
from arlopti_jax.config import load_config_file
from arlopti_jax.config.cli import CONFIGS_DIR
from arlopti_jax.models.tokenizer import load_tokenizer
from arlopti_jax.rl import run_setup
from arlopti_jax.rollout.episodes import EpisodeSpec, episode_sampler
from arlopti_jax.rollout.markers import marker_table
from arlopti_jax.tasks import calc
from arlopti_jax.tasks.data import render_prompt


class FixedTurns:
    """An episode host: every turn but the last answered with ``observation`` (ids), then the end."""

    def __init__(self, vocab: int, turns: int, observation: list[int]):
        self.table = marker_table([], "~", vocab)  # no token has text here: turns end at their cap
        self.turns, self.observation = turns, observation

    def first(self, count):
        return [[] for _ in range(count)]

    def answer(self, ends):
        return [None if end.turn >= self.turns else self.observation for end in ends]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m")
    p.add_argument("--config", default="smollm2.py:cpu,grpo", help="configs/FILE[:ARG] whose settings the run uses")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-tokens", type=int, default=32)
    p.add_argument("--observation-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=4,
                   help="the update's micro-batch rows (default 4, about 6.5 GB; at the config's 16 the "
                        "update's first step passed 12 GB at these lengths, at 32 the kernel's 24 GB; 2026-12-07)")
    args = p.parse_args(argv)
    path, _, arg = args.config.partition(":")
    config = load_config_file(CONFIGS_DIR / path, arg)
    total = args.turns * args.turn_tokens + (args.turns - 1) * args.observation_tokens
    config.model.path, config.rollout.max_response_length = args.model, total
    config.rollout.n, config.train.batch_prompts = args.n, args.prompts
    rows = args.prompts * args.n
    config.train.micro_batch = args.micro_batch
    tokenizer = load_tokenizer(Path(args.model))
    model_cfg = run_setup.model_config(config, Path(args.model))
    mesh = run_setup.make_mesh(config)
    policy = run_setup.load_policy(config, mesh, Path(args.model), tokenizer)
    questions = calc.generate(args.prompts, 1, seed=0)[0]
    prompts = [tokenizer(render_prompt(q["prompt"], tokenizer, "messages"), add_special_tokens=False)["input_ids"]
               for q in questions]
    run = run_setup.assemble(config, mesh, model_cfg, eos_ids=run_setup.eos_ids(policy),
                             pad_id=run_setup.pad_id(policy), total_steps=1000, prompt_width=max(map(len, prompts)))
    sampling = dataclasses.replace(run.sampling(), eos_ids=())  # no EOS: every row runs to its length
    observation = (tokenizer("\n<output>0</output>\n" * args.observation_tokens, add_special_tokens=False)
                   ["input_ids"])[:args.observation_tokens]
    episodes = episode_sampler(run.sampler, EpisodeSpec(args.turn_tokens, args.observation_tokens, 1))
    host = FixedTurns(model_cfg.vocab_size, args.turns, observation)
    params = policy.params
    opt_state = algos.init_opt_state(run.optimizer, model_cfg, params, mesh)
    rng = np.random.default_rng(0)

    def step(arm: str, key) -> dict:
        nonlocal params, opt_state
        began = time.perf_counter()
        if arm == "episodes":
            rollout, _ = episodes.generate(params, prompts, args.n, key, sampling, host)
        else:
            rollout = run.sampler.generate(params, prompts, args.n, key, sampling)
        sampled = time.perf_counter()
        batch = rollout.train_batch()
        passes = algos.prepare_updates(run.adv_cfg, run.weight_cfg, run.lopti_cfg, rng.normal(size=rows),
                                       rollout.group_ids, batch["response_mask"], batch["old_logprobs"])
        params, opt_state, _ = algos.update_on_batch(run.train_step, params, opt_state, batch, passes,
                                                      config.train.mini_batch)
        done = time.perf_counter()
        assert int(rollout.lengths.min()) == int(rollout.lengths.max()) == total, rollout.lengths
        return {"rollout": sampled - began, "update": done - sampled, "step": done - began,
                "tokens": int(rollout.lengths.sum()), "loops": len(rollout.decode_loops),
                "row_steps": rollout.decode_row_steps}

    arms = ("episodes", "single turn")
    for i, arm in enumerate(arms):  # compile each arm's programs
        step(arm, jax.random.key(100 + i))
    times = {arm: [] for arm in arms}
    for r in range(args.rounds):
        for i, arm in enumerate(arms):
            times[arm].append(step(arm, jax.random.key(r * 2 + i)))
    print(f"{rows} rows of {total} tokens after the prompt ({args.turns} turns of {args.turn_tokens} tokens and "
          f"{args.turns - 1} observations of {args.observation_tokens}), {args.rounds} rounds, {jax.devices()[0]}")
    print(f"{'arm':<12}{'rollout s':>11}{'update s':>10}{'step s':>9}{'tokens/s':>10}{'loops':>7}{'row-steps':>11}")
    for arm, runs in times.items():
        med = lambda k: statistics.median(x[k] for x in runs)
        print(f"{arm:<12}{med('rollout'):>11.2f}{med('update'):>10.2f}{med('step'):>9.2f}"
              f"{runs[0]['tokens'] / med('step'):>10.0f}{runs[0]['loops']:>7}{runs[0]['row_steps']:>11}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
