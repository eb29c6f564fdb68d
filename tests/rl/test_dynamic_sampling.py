"""DAPO's dynamic sampling and overlong penalty (arlopti_jax.rl.collect), with a scripted sampler and
reward; the end-to-end kill + resume with it on is in test_train.py."""

import jax
import numpy as np
import pytest

from arlopti_jax.rl.collect import Collector, informative_groups, overlong_penalty
from arlopti_jax.config import base_config
from arlopti_jax.store.metrics import Timer
from arlopti_jax.rollout import Rollout, SamplingConfig
from arlopti_jax.tasks.data import BatchIterator

EOS, PAD = 2, 0


def scripted_reward(data_source, solution_str, ground_truth, extra_info=None):
    """'live' prompts: a different reward per sample (its first response token); 'dead': all 1."""
    return float(solution_str.split()[-2]) if ground_truth == "live" else 1.0


class Tokens:
    """Decodes ids as text: 'p p p r EOS'."""

    @staticmethod
    def batch_decode(seqs, skip_special_tokens=False):
        return [" ".join(map(str, s)) for s in seqs]


class ScriptedSampler:
    """Sample s of every prompt answers [10 + s, EOS]; records the keys it was given. Call c
    returns responses padded to 2 + c tokens (a sampler may trim to the longest response)."""

    def __init__(self):
        self.keys = []

    def generate_steps(self, *args, **kwargs):  # the collector's form of generate: no device waits to yield at
        return self.generate(*args, **kwargs)
        yield

    def generate(self, params, prompts, n, key, sampling):
        self.keys.append(np.asarray(jax.random.key_data(key)))
        width, rows = max(len(p) for p in prompts), len(prompts) * n
        prompt_ids, prompt_mask = np.full((rows, width), PAD, np.int32), np.zeros((rows, width), np.int32)
        for i, p in enumerate(np.repeat(np.arange(len(prompts)), n)):
            prompt_ids[i, width - len(prompts[p]):] = prompts[p]
            prompt_mask[i, width - len(prompts[p]):] = 1
        response = np.full((rows, min(sampling.max_response_len, 1 + len(self.keys))), PAD, np.int32)
        response[:, 0] = 10 + np.tile(np.arange(n), len(prompts))
        response[:, 1] = EOS
        mask = (response != PAD).astype(np.int32)
        return Rollout(prompt_ids, prompt_mask, response, mask, -0.5 * mask.astype(np.float32),
                       mask.sum(1).astype(np.int32), np.zeros(rows, bool),
                       np.repeat(np.arange(len(prompts), dtype=np.int32), n), 2)


def dataset(live: list[bool]) -> list[dict]:
    return [{"prompt_ids": list(range(3, 4 + i % 5)), "data_source": "scripted",
             "ground_truth": "live" if flag else "dead", "extra_info": {"index": i}}
            for i, flag in enumerate(live)]


def make_collector(rows, sampler, **algo):
    c = base_config()
    c.rollout.n, c.rollout.max_response_length = 4, 6
    c.train.batch_prompts = 3
    c.reward.workers = 0
    for k, v in algo.items():
        c.algo[k] = v
    sampling = SamplingConfig(max_response_len=6, eos_ids=(EOS,), pad_id=PAD)
    collector = Collector(c, sampler, sampling, scripted_reward, Tokens(), None, Timer())
    return collector, BatchIterator(rows, 3, seed=0)


def expected_groups(rows, rounds_limit):
    """Independently: walk the same data order; keep live prompts until 3 or the round limit."""
    it = BatchIterator(rows, 3, seed=0)
    live, dead, rounds = [], [], 0
    while len(live) < 3 and rounds < rounds_limit:
        batch = next(it)
        rounds += 1
        live += [r for r in batch if r["ground_truth"] == "live"]
        dead += [r for r in batch if r["ground_truth"] == "dead"]
    return (live + dead)[:3], rounds, len(dead) / (3 * rounds), it.state_dict()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filter_groups_fills_the_batch_with_informative_groups_only(seed):
    live = list(np.random.default_rng(seed).random(30) < 0.35)
    rows = dataset(live)
    sampler = ScriptedSampler()
    collect, iterator = make_collector(rows, sampler, filter_groups=True, max_sample_rounds=10)
    out = collect(None, iterator, jax.random.key(7))
    want, rounds, dropped, position = expected_groups(rows, 10)
    assert all(r["ground_truth"] == "live" for r in want)
    assert out.stats == {"dynamic/rounds": rounds, "dynamic/dropped_share": pytest.approx(dropped),
                         "dynamic/filled_groups": 0.0}
    assert iterator.state_dict() == position  # rounds consumed the data in order
    batch = out.batch
    assert batch["input_ids"].shape[0] == 12  # batch_prompts x n rows, always
    for g, row in enumerate(want):
        for s in range(4):
            i = 4 * g + s
            ids, mask = batch["input_ids"][i], batch["attention_mask"][i]
            assert ids[mask > 0].tolist() == row["prompt_ids"] + [10 + s, EOS]
            assert batch["response_mask"][i].sum() == 2 and ids[batch["response_mask"][i] > 0].tolist() == [10 + s, EOS]
            assert out.rewards[i] == 10 + s and out.group_ids[i] == g
    assert (batch["input_ids"][batch["attention_mask"] == 0] == PAD).all()
    assert (batch["old_logprobs"] == -0.5 * batch["response_mask"]).all()
    # round r's key is fold_in(step_key, r) (round 0: the step key itself, as without filtering)
    want_keys = [jax.random.key(7)] + [jax.random.fold_in(jax.random.key(7), r) for r in range(1, rounds)]
    assert [k.tolist() for k in sampler.keys] == [np.asarray(jax.random.key_data(k)).tolist() for k in want_keys]
    # metrics describe every response sampled, all rounds
    assert len(out.scores) == 12 * rounds and len(out.rows) == 3 * rounds


def test_too_few_informative_groups_are_topped_up_with_dropped_ones():
    rows = dataset([i == 4 for i in range(30)])  # one live prompt in the data
    collect, iterator = make_collector(rows, ScriptedSampler(), filter_groups=True, max_sample_rounds=2)
    out = collect(None, iterator, jax.random.key(0))
    want, rounds, _, _ = expected_groups(rows, 2)
    assert rounds == 2 and out.stats["dynamic/rounds"] == 2
    live = sum(r["ground_truth"] == "live" for r in want)
    assert out.stats["dynamic/filled_groups"] == 3 - live
    assert out.batch["input_ids"].shape[0] == 12
    assert sorted(out.rewards.tolist()) == sorted(
        [10.0 + s for r in want if r["ground_truth"] == "live" for s in range(4)] + [1.0] * 4 * (3 - live))


def test_without_filtering_one_round_as_before():
    rows = dataset([False] * 12)
    sampler = ScriptedSampler()
    collect, iterator = make_collector(rows, sampler)
    out = collect(None, iterator, jax.random.key(3))
    assert len(sampler.keys) == 1 and out.stats == {} and (out.rewards == 1.0).all()
    assert iterator.state_dict()["index"] == 3


def test_overlong_penalty():
    lengths = np.array([1, 15, 16, 18, 20])
    np.testing.assert_allclose(overlong_penalty(lengths, 20, 5, 1.0), [0, 0, -0.2, -0.6, -1.0], atol=1e-6)
    np.testing.assert_allclose(overlong_penalty(lengths, 20, 5, 0.5), [0, 0, -0.1, -0.3, -0.5], atol=1e-6)
    # added to the rewards (and filtered on): 'dead' groups become informative when lengths differ
    rows = dataset([False] * 12)
    collect, iterator = make_collector(rows, ScriptedSampler(), overlong_buffer=5, overlong_penalty=2.0)
    out = collect(None, iterator, jax.random.key(0))
    # every response has 2 of the 6 tokens: 2 <= 6 - 5 + ... -> penalty min(0, (6 - 5 - 2) / 5) x 2 = -0.4
    np.testing.assert_allclose(out.rewards, 1.0 - 0.4, atol=1e-6)
    assert out.stats["reward/overlong_penalty"] == pytest.approx(-0.4)
    assert (out.scores == 1.0).all()  # the task scores (accuracy) are unchanged


def test_informative_groups():
    rewards = np.array([1, 1, 1, 0, 2, 2, 3, 3.0])
    assert informative_groups(rewards, 2).tolist() == [False, True, False, False]
    assert informative_groups(rewards, 4).tolist() == [True, True]
