"""The warm-up of a run with tool episodes (``rl/warm_up.py``, ``env.name``) compiles every sampler
program its episodes and its evaluations reach, whatever the number of turns: after it, rounds of
episodes capped at 4, 1 and 2 turns, whose episodes end at different turns (the environment's
turn count set by the policy's first draws, the budget), with the length-aware sampler's
compactions and growth, and an evaluation of episodes, compile nothing. Before ``episodes._outputs``
a rollout that never compacted ran its outputs' sharding constraints eagerly: a program per output
array, compiled after the warm-up."""

import jax
import numpy as np
from run_fixtures import make_config, overrides

from arlopti_jax.config import validate
from arlopti_jax.rl import run_setup, warm_up
from arlopti_jax.rl.collect import EpisodeCollector, make_collector
from arlopti_jax.rl.evaluation import Evaluator
from arlopti_jax.runtime import compiles
from arlopti_jax.store.metrics import Timer
from arlopti_jax.tasks import load_reward_fn


def test_nothing_compiles_after_the_warm_up_for_any_number_of_turns(start_point, tmp_path):
    values = overrides(start_point, tmp_path / "run", **{
        "env.name": "episode_fixtures:ScriptedEnv", "env.params": '{"turns": [1, 1, 2, 3, 4]}', "env.max_turns": 4,
        "env.observation_format": "\n<o>{observation}</o>\n", "env.turn_tokens": 8, "env.observation_tokens": 40,
        "rollout.max_response_length": 128, "data.max_prompt_length": 128, "reward.workers": 0,
        # phases of 32 and 64 slots after the prompt, then 128; 4 rows a device (4 prompts padded to 8 x 4
        # samples on 8 devices), 2 after a compaction
        "rollout.length_aware": True, "rollout.phase_tokens": 32, "rollout.min_rows": 2,
        "data.test_files": str(start_point / "data" / "test_2ppl.parquet"), "train.eval_max_prompts": 2})
    config = make_config(values)
    validate(config, jax.device_count(), "cpu")
    jax.clear_caches()  # nothing this process compiled before (another test's programs) counts as warmed up
    inputs = run_setup.prepare_inputs(config)
    mesh = run_setup.make_mesh(config)
    policy = run_setup.load_policy(config, mesh, inputs.model_path, inputs.tokenizer)
    run = run_setup.assemble(config, mesh, policy.model_cfg, eos_ids=run_setup.eos_ids(policy),
                             pad_id=run_setup.pad_id(policy), total_steps=4, prompt_width=inputs.longest_prompt)
    reward_fn = load_reward_fn(None)
    evaluator = Evaluator(config, run, inputs.tokenizer, inputs.test_sets, reward_fn)
    key = jax.random.key(config.seed)
    log = compiles.watch()
    mark = log.programs
    assert warm_up.compile_rollouts(run, evaluator, policy.params, jax.random.fold_in(key, 0)) > 0
    assert log.programs > mark
    mark = log.programs

    turns, loops = {}, set()
    for i, max_turns in enumerate((4, 1, 2)):
        variant = make_config({**values, "env.max_turns": max_turns})
        collector = make_collector(variant, run.sampler, run.sampling(), reward_fn, inputs.tokenizer, mesh, Timer())
        assert isinstance(collector, EpisodeCollector)
        iterator = run_setup.train_iterator(variant, inputs.iterator.dataset)
        collector(policy.params, iterator, jax.random.fold_in(key, i))
        (_, rollout, counted), = collector._batches
        turns[max_turns] = set(counted.tolist())
        loops.update(rollout.decode_loops)
    results = evaluator.run(policy.params, jax.random.fold_in(key, 10**9))
    late = log.since(mark)
    assert not late, [(r.name, r.shapes[:200]) for r in late]

    # what ran: episodes of 1 to 4 turns, within each cap; compacted and grown loops
    assert turns[1] == {1} and turns[2] == {1, 2} and {1, 2, 3} <= turns[4] <= {1, 2, 3, 4}, turns
    assert len({rows for rows, _, _ in loops}) > 1 and len({slots for _, slots, _ in loops}) > 1, loops
    assert results and all(np.isfinite(v) for v in results.values())
