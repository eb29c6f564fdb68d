"""The tool episodes' collector (``rl/collect.py``'s ``EpisodeCollector``) on the embedded start
point with a scripted environment: for every episode the trained ids are the ids the sampler drew and the ids the host
fed, concatenated (no re-tokenization: multi-byte observation text, and drawn tokens that would
come back as other ids), the observations the template's text around the environment's output,
the rewards the environment's parts, the episode metrics counted; an environment that raises ends
its episode with reward 0 and the run goes on; the batch trains. The run-level checks (training,
evaluation, resume after a kill with episodes in flight) are in tests/runtime/test_faults.py."""

import functools
import json

import jax
import numpy as np
import pytest

from arlopti_jax import algos
from arlopti_jax.config import validate
from arlopti_jax.rl import run_setup
from arlopti_jax.rl.collect import make_collector
from arlopti_jax.rl.episode_host import EpisodeBatch
from arlopti_jax.rl.collect import EpisodeCollector
from arlopti_jax.store.metrics import Timer
from episode_fixtures import OBSERVATION
from run_fixtures import make_config, overrides

FORMAT = "\n<o>{observation}</o>\n"


def episode_config(sp, run_dir, **extra):
    values = overrides(sp, run_dir, **{"env.name": "episode_fixtures:ScriptedEnv", "env.observation_format": FORMAT,
                                       "env.turn_tokens": 8, "env.observation_tokens": 40,
                                       "rollout.max_response_length": 128, "data.max_prompt_length": 128,
                                       "reward.workers": 0, **extra})
    config = make_config(values)
    validate(config, jax.device_count(), "cpu")
    return config


@functools.cache
def _setup(sp, run_dir):
    config = episode_config(sp, run_dir)
    inputs = run_setup.prepare_inputs(config)
    mesh = run_setup.make_mesh(config)
    policy = run_setup.load_policy(config, mesh, inputs.model_path, inputs.tokenizer)
    run = run_setup.assemble(config, mesh, policy.model_cfg, eos_ids=run_setup.eos_ids(policy),
                             pad_id=run_setup.pad_id(policy), total_steps=4, prompt_width=inputs.longest_prompt)
    return config, inputs, mesh, policy, run


@pytest.fixture(scope="module")
def setup(start_point, tmp_path_factory):
    return _setup(start_point, tmp_path_factory.mktemp("episodes") / "run")


def collect(setup, config=None, seed=0, record=None):
    base, inputs, mesh, policy, run = setup
    config = base if config is None else config
    collector = make_collector(config, run.sampler, run.sampling(), None, inputs.tokenizer, mesh, Timer())
    assert isinstance(collector, EpisodeCollector)
    if record is not None:  # what the host was told (the sampler's ids) and answered
        answer = EpisodeBatch.answer

        def recording(self, ends):
            replies = answer(self, ends)
            record.append((self, ends, replies))
            return replies

        EpisodeBatch.answer = recording
    try:
        iterator = run_setup.train_iterator(config, inputs.iterator.dataset)
        return collector, collector(policy.params, iterator, jax.random.key(seed))
    finally:
        if record is not None:
            EpisodeBatch.answer = answer


def test_the_trained_ids_are_the_drawn_and_the_fed_ids(setup):
    config, inputs, _, _, _ = setup
    tokenizer = inputs.tokenizer
    record = []
    collector, step = collect(setup, record=record)
    batch = step.batch
    (episodes, rollout, turns), = collector._batches
    width = rollout.prompt_ids.shape[1]
    sequences = {e: [] for e in range(len(episodes.envs))}
    for host, ends, replies in record:
        assert host is episodes
        for end, reply in zip(ends, replies):
            sequences[end.episode] += end.tokens + (reply or [])
    retokenized_differ = 0
    for e, env in enumerate(episodes.envs):
        row = batch["input_ids"][e]
        assert row[:width].tolist() == rollout.prompt_ids[e].tolist()
        assert row[width:width + rollout.lengths[e]].tolist() == sequences[e]  # token in, token out
        attended = batch["attention_mask"][e, width:]
        assert attended[:rollout.lengths[e]].all() and not attended[rollout.lengths[e]:].any()
        # the observations: the environment's text in the format, exactly as tokenized from it
        fed = [ids for _, ends, replies in record for end, ids in zip(ends, replies) if end.episode == e and ids]
        assert len(fed) == len(env.observations) == turns[e] - 1 >= 1
        for ids, text in zip(fed, env.observations):
            assert text.startswith(OBSERVATION.split(":")[0][:4])
            whole = tokenizer(FORMAT.format(observation=text), add_special_tokens=False)["input_ids"]
            assert ids == whole or tokenizer.decode(ids).endswith(" [... cut]</o>\n")
        drawn = [end.tokens for _, ends, _ in record for end in ends if end.episode == e]
        for ids in drawn:
            retokenized_differ += tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] != ids
        mask = batch["response_mask"][e, width:width + rollout.lengths[e]].astype(bool)
        assert mask.sum() == sum(map(len, drawn)) and (~mask).sum() == sum(map(len, fed))
        assert np.all(batch["old_logprobs"][e, width:width + rollout.lengths[e]][~mask] == 0)  # no pi_old there
    assert retokenized_differ > 0  # decoding and encoding again would have trained other ids
    rewards = np.asarray(step.rewards)
    for e, env in enumerate(episodes.envs):
        chars = sum(map(len, env.actions))
        want = float(chars % 2 == 0) - 0.01 * chars if len(env.actions) == 3 else 0.0
        np.testing.assert_allclose(rewards[e], want, rtol=1e-6, atol=1e-6)
    s = step.stats
    np.testing.assert_allclose(s["episode/turns"], turns.mean())
    np.testing.assert_allclose(s["episode/tool_calls"], np.mean([len(env.observations) for env in episodes.envs]))
    action, observed = batch["response_mask"].sum(), batch["attention_mask"][:, width:].sum() - batch[
        "response_mask"].sum()
    np.testing.assert_allclose(s["episode/action_share"], action / (action + observed))
    np.testing.assert_allclose(s["episode/observation_tokens"], observed / len(rewards))
    assert s["episode/env_errors"] == 0 and "time/environment" in s


def test_an_environment_that_raises_ends_its_episode_with_reward_0(setup, start_point, tmp_path, caplog):
    config = episode_config(start_point, tmp_path / "run", **{"env.params": '{"fail_on": "e"}'})
    collector, step = collect(setup, config)
    (episodes, _, _), = collector._batches
    failed = [e for e, env in enumerate(episodes.envs) if any("e" in a for a in env.actions)]
    raised = np.asarray(episodes.counts["env_errors"]) > 0
    assert raised.any() and not raised.all()
    assert np.all(np.asarray(step.rewards)[raised] == 0) and not np.asarray(step.correct)[raised].any()
    assert step.stats["episode/env_errors"] == raised.sum() and set(np.flatnonzero(raised)) <= set(failed)
    assert "step raised RuntimeError: scripted failure" in caplog.text and "at turn" in caplog.text


def test_the_batch_of_episodes_trains(setup):
    config, inputs, mesh, policy, run = setup
    _, step = collect(setup, seed=1)
    batch = {k: np.asarray(v) for k, v in step.batch.items()}
    passes = algos.prepare_updates(run.adv_cfg, run.weight_cfg, run.lopti_cfg, np.asarray(step.rewards),
                                   np.asarray(step.group_ids), batch["response_mask"], batch["old_logprobs"])
    batch["ref_logprobs"] = run.logprobs(policy.params, batch)
    params = jax.tree.map(lambda x: x.copy(), policy.params)
    opt_state = algos.init_opt_state(run.optimizer, run.model_cfg, params, mesh)
    _, _, metrics = algos.update_on_batch(run.train_step, params, opt_state, batch, passes, config.train.mini_batch)
    assert all(np.isfinite(v) for m in metrics for v in m.values())
    per_mini_batch = batch["response_mask"].sum() / (len(batch["response_mask"]) // config.train.mini_batch)
    assert metrics[0]["n_tokens"] == per_mini_batch  # the policy's tokens alone
    assert abs(metrics[0]["kl"]) < 1e-5  # the reference is the policy: its log-probs at the drawn tokens agree


@pytest.mark.slow
def test_a_run_killed_with_episodes_in_flight_resumes_to_the_same_records(start_point, tmp_path):
    """Four steps of tool episodes, checkpoints at 2 and 4: the run is killed (SIGKILL) in step 3,
    where the host is about to answer a batch of turns (fault site ``episode``), and resumed from
    checkpoint 2: its metrics equal the uninterrupted run's line by line (timings aside), and it
    compiled nothing after its first step. The environment is counted per step in the uninterrupted
    run, so the kill lands in step 3 whatever the episodes do."""
    import os
    import subprocess
    from pathlib import Path

    from arlopti_jax.rl.loop import train
    from arlopti_jax.runtime import faults
    from run_fixtures import TIMING, assert_nothing_compiled_late, cli

    def values(run_dir):
        return overrides(start_point, run_dir, **{
            "env.name": "episode_fixtures:ScriptedEnv", "env.observation_format": FORMAT, "env.turn_tokens": 8,
            "env.observation_tokens": 40, "rollout.max_response_length": 128, "data.max_prompt_length": 128,
            "reward.workers": 0})

    marks, answers = [], []
    steps, answer = EpisodeCollector.steps, EpisodeBatch.answer

    def counted_steps(self, *args):
        marks.append(len(answers))
        return (yield from steps(self, *args))

    def counted_answer(self, ends):
        answers.append(len(ends))
        return answer(self, ends)

    EpisodeCollector.steps, EpisodeBatch.answer = counted_steps, counted_answer
    try:
        reference = tmp_path / "reference"
        assert_nothing_compiled_late(train(make_config(values(reference))))
    finally:
        EpisodeCollector.steps, EpisodeBatch.answer = steps, answer
    assert len(marks) == 4 and marks[3] - marks[2] >= 2, marks  # several answers in step 3
    killed = tmp_path / "killed"
    armed = marks[2] + 1 + (marks[3] - marks[2]) // 2  # step 3's middle answer
    helpers = str(Path(__file__).resolve().parents[1] / "helpers")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([helpers, os.environ.get("PYTHONPATH", "")]),
           faults.ENV: f"episode:{armed}"}
    proc = subprocess.run(cli(values(killed)), env=env, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert (killed / "checkpoints" / "2").is_dir() and not (killed / "checkpoints" / "4").exists()
    assert_nothing_compiled_late(train(make_config(values(killed))))
    lines = lambda run: [{k: v for k, v in json.loads(line).items() if not k.startswith(TIMING)}
                         for line in (run / "metrics.jsonl").read_text().splitlines()]
    got, want = lines(killed), lines(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for a, b in zip(got, want):
        assert a == b, a["step"]
    assert want[2]["episode/turns"] > 1 and want[2]["episode/observation_tokens"] > 0
