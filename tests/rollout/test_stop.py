"""Stop strings (arlopti_jax.rollout.stop): responses of the tiny byte-level BPE tokenizer that a
stop string ends inside a token, across tokens and after several, against a plain decode of every
prefix; a collected step's loss mask and rewards, and an evaluation's scores and kept responses, seeing
the trimmed responses."""

import numpy as np
import pytest

from arlopti_jax.config import base_config
from arlopti_jax.rl.collect import Collector
from arlopti_jax.rollout import Rollout, SamplingConfig, apply_stops, find_stop
from arlopti_jax.store.metrics import Timer
from arlopti_jax.tasks.data import BatchIterator
from task_fixtures import tiny_tokenizer

TEXT = "<think> reasoning process here </think><answer> (1) Zoey is a knight </answer> more text"
PAD = 0


def reference(tok, ids, stops, include):
    """Independently: decode each prefix in turn; the first holding a stop string ends the response
    (the first such string in ``stops``' order, its first occurrence)."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=False)
        for s in stops:
            if s in text:
                return k, text[: text.find(s) + (len(s) if include else 0)]
    return None


def responses(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    return [tok.encode(TEXT), tok.encode("short</answer>") + [eos], tok.encode("x é y é z"),
            tok.encode("no stop here at all"), tok.encode("ok </answ") + [eos]]


CASES = [
    ("</answer>",),  # spans ' </', 'answer', '>' and appears twice: the first wins
    ("<answ",),  # ends inside the token 'answer'
    ("nswer> (",),  # starts inside one token and ends in another
    ("knight",),  # after several tokens, a whole token
    ("é",),  # a character split over two byte tokens
    ("zzz",),  # never appears
    ("here", "</think>"),  # two strings: the earlier completed wins
    ("s here", "here"),  # the token ' here' completes both: the first listed wins
    ("here", "s here"),
    ("<|im_end|>",),  # a special token's text
]


@pytest.mark.parametrize("stops", CASES)
@pytest.mark.parametrize("include", [False, True])
def test_find_stop_equals_a_decode_of_every_prefix(stops, include):
    tok = tiny_tokenizer()
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False)
    for ids in responses(tok):
        want = reference(tok, ids, stops, include)
        got = find_stop(decode, ids, stops, include)
        if want is None:
            assert got is None
            continue
        k, cut = got
        text = decode(ids[:k])
        assert (k, text[: len(text) - cut]) == want


def rollout_of(rows, width, eos=None):
    n = len(rows)
    ids = np.full((n, width), PAD, np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    mask = (np.arange(width) < np.array([len(r) for r in rows])[:, None]).astype(np.int32)
    truncated = np.array([r[-1] != eos for r in rows])
    prompt = np.full((n, 1), 3, np.int32)
    return Rollout(prompt, np.ones_like(prompt), ids, mask, -0.25 * mask.astype(np.float32),
                   mask.sum(1).astype(np.int32), truncated, np.arange(n, dtype=np.int32), width)


@pytest.mark.parametrize("include", [False, True])
def test_apply_stops_trims_masks_and_texts(include):
    tok = tiny_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    rows = responses(tok)
    width = max(map(len, rows)) + 2
    rollout = rollout_of(rows, width, eos)
    after = tok.encode("er>")  # beyond row 4's EOS (its length): not part of the response
    rollout.response_ids[4, len(rows[4]): len(rows[4]) + len(after)] = after
    stops = ("</answer>", "é")
    assert apply_stops(rollout, tok, (), include, PAD) is rollout  # none: the same object
    out = apply_stops(rollout, tok, stops, include, PAD)
    from arlopti_jax.rl.evaluation import decode_solutions

    texts = decode_solutions(tok, [{"prompt_ids": [3]}] * len(rows), out, 1)
    for i, ids in enumerate(rows):
        want = reference(tok, ids, stops, include)
        k = len(ids) if want is None else want[0]
        assert out.lengths[i] == k and out.response_mask[i].tolist() == [1] * k + [0] * (width - k)
        assert i == 4 or (out.response_ids[i, k:] == PAD).all()
        assert (out.logprobs[i, k:] == 0).all()
        assert out.response_ids[i, :k].tolist() == ids[:k] and (out.logprobs[i, :k] == -0.25).all()
        assert out.truncated[i] == (rollout.truncated[i] and want is None)
        body = tok.decode(ids) if want is None else want[1]
        assert texts[i] == tok.decode([3]) + body
    assert out.lengths[1] == rollout.lengths[1] - 1  # the EOS after the stop string is cut
    for i in (3, 4):  # no stop string; one ended by EOS before its stop string would complete
        assert out.lengths[i] == rollout.lengths[i] and out.text_cut[i] == 0 and out.truncated[i] == (i == 3)
        assert (out.response_ids[i] == rollout.response_ids[i]).all()


class TokenSampler:
    """Every prompt's n responses are the first n given token lists, right-padded."""

    def __init__(self, rows, eos):
        self.rows, self.eos = rows, eos

    def generate_steps(self, *args, **kwargs):  # the collector's form of generate: no device waits to yield at
        return self.generate(*args, **kwargs)
        yield

    def generate(self, params, prompts, n, key, sampling):
        rows = [r for _ in prompts for r in self.rows[:n]]
        out = rollout_of(rows, sampling.max_response_len, self.eos)
        p = np.repeat(np.array([prompts[0]], np.int32), len(rows), 0)
        return Rollout(p, np.ones_like(p), out.response_ids, out.response_mask, out.logprobs, out.lengths,
                       out.truncated, np.repeat(np.arange(len(prompts), dtype=np.int32), n), out.decode_steps)


def solution_reward(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the rewarded text ends with the answer's close tag, else 0."""
    return float(solution_str.endswith("</answer>"))


@pytest.mark.parametrize("include", [False, True])
def test_collected_batch_sees_trimmed_responses(include):
    tok = tiny_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    rows = responses(tok)
    c = base_config()
    c.rollout.n, c.rollout.max_response_length, c.train.batch_prompts, c.reward.workers = 5, 40, 2, 0
    c.rollout.stop, c.rollout.include_stop_str = ("</answer>",), include
    sampling = SamplingConfig(max_response_len=40, eos_ids=(eos,), pad_id=PAD)
    data = [{"prompt_ids": tok.encode("Q:"), "data_source": "scripted", "ground_truth": "",
             "extra_info": {"index": i}} for i in range(2)]
    collector = Collector(c, TokenSampler(rows, eos), sampling, solution_reward, tok, None, Timer())
    step = collector(None, BatchIterator(data, 2, seed=0), None)
    kept = [len(rows[i]) if (r := reference(tok, rows[i], ("</answer>",), include)) is None else r[0]
            for i in range(5)] * 2
    prompt = len(tok.encode("Q:"))
    mask = np.asarray(step.batch["response_mask"])
    assert mask[:, :prompt].sum() == 0 and mask.sum(1).tolist() == kept
    assert np.asarray(step.lengths).tolist() == kept
    # rows 0 and 1 end with the tag only when it is kept; row 1's EOS after it is cut
    assert np.asarray(step.rewards).tolist() == [float(include), float(include), 0.0, 0.0, 0.0] * 2


def test_evaluation_scores_and_keeps_the_trimmed_responses(tmp_path):
    import json

    import jax

    from arlopti_jax.rl.evaluation import Evaluator

    tok = tiny_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    rows = responses(tok)

    class Sampler(TokenSampler):
        def process_share(self, count, sampling, pad_to=0):
            return slice(0, count)

        def generate(self, params, prompts, n, key, sampling, pad_to=0):
            return super().generate(params, prompts, n, key, sampling)

    class Run:
        sampler = Sampler(rows, eos)

        def sampling(self, greedy=False, temperature=None):
            return SamplingConfig(max_response_len=40, greedy=greedy, temperature=temperature or 1.0, pad_id=PAD)

    c = base_config()
    c.rollout.n, c.train.batch_prompts, c.train.eval_n, c.train.eval_ks, c.reward.workers = 5, 1, 5, (1,), 0
    c.rollout.stop = ("</answer>",)
    data = type("Set", (), {"rows": [{"prompt_ids": tok.encode("Q:"), "data_source": "scripted", "ground_truth": "",
                                      "extra_info": {}, "row": 0}]})()
    for include in (False, True):
        c.rollout.include_stop_str = include
        evaluator = Evaluator(c, Run(), tok, {"s": data}, solution_reward)
        out = evaluator.run(None, jax.random.key(0), tmp_path / str(include))
        # greedy: the first response; sampled: all five, the first two ending with the tag only when kept
        assert out["eval/s/greedy_reward"] == float(include)
        assert out["eval/s/sampled_reward"] == pytest.approx(0.4 * include)
        records = [json.loads(line) for line in (tmp_path / str(include) / "s.jsonl").read_text().splitlines()]
        want = [tok.decode(r) if (w := reference(tok, r, ("</answer>",), include)) is None else w[1] for r in rows]
        assert [r["response"] for r in records if r["mode"] == "sampled"] == want
