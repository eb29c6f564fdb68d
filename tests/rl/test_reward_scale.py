"""Correctness on any reward scale: a reward returning a score or a verl-style dict (score, acc, other
numbers), and ``reward.correct_at``, decide acc/* in training and greedy/sampled accuracy, pass@k,
maj@k and mean@k in evaluation. A scripted sampler answers; the reward runs in a worker process, as
every user reward does. Expected values are computed here from the script, independently."""

import itertools
import re
from collections import Counter

import jax
import numpy as np
import pytest
from task_fixtures import tiny_tokenizer

from arlopti_jax.config import base_config
from arlopti_jax.rl.collect import Collector
from arlopti_jax.rl.evaluation import Evaluator, is_correct
from arlopti_jax.rl.loop import rollout_metrics
from arlopti_jax.rollout import Rollout, SamplingConfig
from arlopti_jax.store.metrics import Timer
from arlopti_jax.tasks import Reward
from arlopti_jax.tasks.data import BatchIterator
from arlopti_jax.tasks.registry import as_reward

PAD = 0
# each prompt's responses (greedy first, then eval_n = 4 samples): "\boxed{ANSWER} sS" where the
# reward's score is S / 10 and its acc is ANSWER == the ground truth "7"
SCRIPT = [
    ["\\boxed{7} s2", "\\boxed{7} s9", "\\boxed{3} s8", "\\boxed{3} s6", "\\boxed{7} s1"],
    ["\\boxed{3} s9", "\\boxed{5} s0", "\\boxed{7} s3", "\\boxed{5} s7", "\\boxed{7} s4"],
    ["\\boxed{4} s5", "\\boxed{4} s9", "\\boxed{4} s2", "\\boxed{9} s1", "\\boxed{8} s0"],
]


def _parsed(text: str) -> tuple[str, float]:
    answer, score = re.findall(r"\\boxed\{(\w+)\} s(\d)", text)[-1]
    return answer, int(score) / 10


def dict_reward(data_source, solution_str, ground_truth, extra_info=None):
    answer, score = _parsed(solution_str)
    return {"score": score, "acc": answer == ground_truth, "digits": float(len(answer)), "note": "ignored"}


def float_reward(data_source, solution_str, ground_truth, extra_info=None):
    return _parsed(solution_str)[1]


class ScriptSampler:
    """Prompt p's response: SCRIPT[p][0] greedy, SCRIPT[p][1 + s] as sample s, tokenized."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def process_share(self, count, sampling, pad_to=0):
        return slice(0, count)

    def generate_steps(self, *args, **kwargs):  # the collector's form of generate: no device waits to yield at
        return self.generate(*args, **kwargs)
        yield

    def generate(self, params, prompts, n, key, sampling, pad_to=0):
        texts = [SCRIPT[p[0] - 5][0 if sampling.greedy else 1 + s] for p in prompts for s in range(n)]
        ids = [self.tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        width = max(map(len, ids))
        response = np.array([i + [PAD] * (width - len(i)) for i in ids], np.int32)
        mask = (np.arange(width) < np.array([len(i) for i in ids])[:, None]).astype(np.int32)
        rows = len(texts)
        return Rollout(np.repeat(np.array(prompts, np.int32), n, axis=0), np.ones((rows, 1), np.int32), response,
                       mask, np.zeros(mask.shape, np.float32), mask.sum(1).astype(np.int32), np.zeros(rows, bool),
                       np.repeat(np.arange(len(prompts), dtype=np.int32), n), width)


def _config(correct_at):
    c = base_config()
    c.rollout.n, c.train.batch_prompts, c.train.eval_n, c.train.eval_ks = 4, 3, 4, (1, 2, 4)
    c.reward.workers, c.reward.correct_at = 0, correct_at
    return c


ROWS = [{"prompt_ids": [5 + p], "data_source": "math_dsr", "ground_truth": "7", "extra_info": {}, "row": p}
        for p in range(len(SCRIPT))]


def _correct(text: str, rule) -> bool:
    answer, score = _parsed(text)
    return {"acc": answer == "7", "at_0.5": score >= 0.5, "at_1": score >= 1.0}[rule]


def _expected(rule) -> dict[str, float]:
    """The evaluation's metrics from the script alone: pass@k by enumerating every k-subset."""
    greedy = [_correct(s[0], rule) for s in SCRIPT]
    samples = [[_correct(t, rule) for t in s[1:]] for s in SCRIPT]
    out = {"greedy_acc": np.mean(greedy), "sampled_acc": np.mean(samples)}
    for k in (1, 2, 4):
        out[f"pass@{k}"] = np.mean([np.mean([any(c) for c in itertools.combinations(ok, k)]) for ok in samples])
        out[f"mean@{k}"] = np.mean([np.mean(ok[:k]) for ok in samples])
        majority = []
        for s, ok in zip(SCRIPT, samples):
            answers = [_parsed(t)[0] for t in s[1:1 + k]]
            top = max(Counter(answers).values())
            winner = next(a for a in answers if answers.count(a) == top)  # ties: the first to appear
            majority.append(ok[answers.index(winner)])
        out[f"maj@{k}"] = np.mean(majority)
    return out


@pytest.mark.parametrize("reward, correct_at, rule", [
    (dict_reward, None, "acc"),  # the dict's acc decides
    (dict_reward, 0.5, "at_0.5"),  # reward.correct_at wins over acc
    (float_reward, None, "at_1"),  # a plain score on [0, 1]: the default level, 1
    (float_reward, 0.5, "at_0.5"),
])  # fmt: skip
def test_evaluation_counts_what_the_reward_or_the_threshold_calls_correct(reward, correct_at, rule):
    tok = tiny_tokenizer()
    config = _config(correct_at)

    class Run:
        sampler = ScriptSampler(tok)

        def sampling(self, greedy=False, temperature=None):
            return SamplingConfig(max_response_len=16, greedy=greedy, temperature=temperature or 1.0)

    data = type("Set", (), {"rows": ROWS})()
    results = Evaluator(config, Run(), tok, {"script": data}, reward).run(None, jax.random.key(0))
    want = _expected(rule)
    for name, value in want.items():
        assert results[f"eval/script/{name}"] == pytest.approx(value), name
    assert results["eval/script/greedy_reward"] == pytest.approx(np.mean([_parsed(s[0])[1] for s in SCRIPT]))
    if reward is dict_reward:  # its other number, averaged; strings are not numbers to log
        assert results["eval/script/sampled_info/digits"] == 1.0
        assert not any("note" in k for k in results)
    else:
        assert not any("_info/" in k for k in results)
    assert len({_expected(r)["sampled_acc"] for r in ("acc", "at_0.5", "at_1")}) == 3  # the rules disagree here


class Tokens:
    @staticmethod
    def batch_decode(seqs, skip_special_tokens=False):
        return [" ".join(map(str, s)) for s in seqs]


class CountingSampler:
    """Sample s of every prompt answers one token, 10 + s."""

    def generate_steps(self, *args, **kwargs):  # the collector's form of generate: no device waits to yield at
        return self.generate(*args, **kwargs)
        yield

    def generate(self, params, prompts, n, key, sampling):
        rows = len(prompts) * n
        response = (10 + np.tile(np.arange(n), len(prompts)))[:, None].astype(np.int32)
        mask = np.ones_like(response)
        return Rollout(np.repeat(np.array(prompts, np.int32), n, axis=0), np.ones((rows, 1), np.int32), response,
                       mask, np.zeros(mask.shape, np.float32), np.ones(rows, np.int32), np.zeros(rows, bool),
                       np.repeat(np.arange(len(prompts), dtype=np.int32), n), 1)


def sample_reward(data_source, solution_str, ground_truth, extra_info=None):
    """Sample s scores s / 4 on [0, 1); acc: s is even; 'bonus' 2 s."""
    s = int(solution_str.split()[-1]) - 10
    return {"score": s / 4, "acc": s % 2 == 0, "bonus": 2.0 * s}


@pytest.mark.parametrize("correct_at, want_acc", [(None, 0.5), (0.7, 0.25), (0.0, 1.0)])
def test_training_acc_follows_the_reward_dict_or_the_threshold(correct_at, want_acc):
    config = _config(correct_at)
    sampling = SamplingConfig(max_response_len=4, pad_id=PAD)
    rows = [{"prompt_ids": [3 + i], "data_source": "mine", "ground_truth": None, "extra_info": {}} for i in range(6)]
    out = Collector(config, CountingSampler(), sampling, sample_reward, Tokens(), None, Timer())(
        None, BatchIterator(rows, 3, seed=0), jax.random.key(0))
    np.testing.assert_allclose(out.scores, np.tile(np.arange(4) / 4, 3))  # the dict's score is the reward
    np.testing.assert_allclose(out.rewards, out.scores)
    metrics = rollout_metrics(out.rows, out.scores, out.correct, out.lengths, out.truncated, 4)
    assert metrics["acc/all"] == metrics["acc/mine"] == pytest.approx(want_acc)
    assert metrics["reward/mean"] == pytest.approx(0.375)
    assert out.stats == {"reward_info/bonus": pytest.approx(3.0)}


def test_what_counts_as_correct():
    assert is_correct("kk_logic", Reward(3.0)) and not is_correct("kk_logic", Reward(2.9))
    assert is_correct("math_dsr", Reward(1.0)) and not is_correct("math_dsr", Reward(0.99))
    assert is_correct("math_dsr", Reward(0.1, acc=True)) and not is_correct("math_dsr", Reward(5.0, acc=False))
    assert is_correct("kk_logic", Reward(0.3), correct_at=0.25) and not is_correct("x", Reward(0.2, True), 0.25)
    assert not is_correct("x", Reward(0.0, failed=True), correct_at=-1.0)  # a failed scoring never is


@pytest.mark.parametrize("value, want", [
    (0.5, Reward(0.5)),
    (np.float32(2.0), Reward(2.0)),
    ("text", Reward(-1.0, failed=True)),
    (float("nan"), Reward(-1.0, failed=True)),
    ({"score": 0.25, "acc": True, "format": 1, "pred": "7", "flag": False}, Reward(0.25, True, {"format": 1.0,
                                                                                                 "flag": 0.0})),
    ({"score": 1.0, "acc": 0.0}, Reward(1.0, False)),
    ({"score": 1.0, "acc": np.bool_(True)}, Reward(1.0, True)),
    ({"score": 1.0, "acc": None}, Reward(1.0)),
    ({"acc": True}, Reward(-1.0, failed=True)),
    ({"score": float("inf"), "acc": True}, Reward(-1.0, failed=True)),
])  # fmt: skip
def test_a_reward_value_as_a_reward(value, want):
    assert as_reward(value, -1.0) == want
