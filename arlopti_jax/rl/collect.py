"""Steps 1-3 of an RL step: prompts -> sampled responses -> rewards, as the update's batch.

    collector = Collector(config, sampler, sampling, reward_fn, tokenizer, mesh, timer)
    step_batch = collector(params, iterator, step_key)

By default one round: the iterator's next ``train.batch_prompts`` prompts, ``rollout.n``
responses each (this process's block of the prompts), scored on host.

Two options from DAPO (Yu et al., 2025), both off by default:

- **Dynamic sampling** (``algo.filter_groups``). A group whose rewards are all equal has zero
  advantage under a group baseline (grpo, rloo, dr_grpo) and spends update compute for
  nothing. Such groups are dropped and further rounds draw the iterator's next batches, with
  keys ``fold_in(step_key, round)``, until ``train.batch_prompts`` informative groups are held
  or ``algo.max_sample_rounds`` rounds are spent; then the first ``batch_prompts``
  informative groups form the batch, topped up with dropped ones if there are too few
  (``dynamic/filled_groups``). Surplus groups are discarded, not carried over, so the
  checkpoint's iterator position and RNG keep resume exact. With several processes the
  groups' flags and rows are gathered, so every process makes the same choice and takes its
  block of the kept groups.
- **Soft overlong penalty** (``algo.overlong_buffer`` L_c > 0): a response of L tokens (EOS
  included) gets ``overlong_penalty x min(0, (L_max - L_c - L) / L_c)`` added to its reward,
  L_max = ``rollout.max_response_length``: 0 up to L_max - L_c, then linearly down to
  ``-overlong_penalty`` at L_max. Groups are filtered on these final rewards.

Metrics describe every response sampled in the step (all rounds): an unbiased sample of
the policy, comparable with filtering off. The batch handed to the update always holds
``batch_prompts x n`` rows.

With ``config.env.name`` set, ``make_collector`` gives an ``EpisodeCollector``: the same calls and
batch, each round's responses tool episodes (docs/guides/tools.md).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from arlopti_jax.runtime import distributed as dist
from arlopti_jax.rl.episode_host import EpisodeBatch, EpisodeSetup
from arlopti_jax.rl.evaluation import (concat_info, gather_info, info_means, score_episodes, score_rollout_steps,
                                       stopped)
from arlopti_jax.rollout.sampler import drain


def overlong_penalty(lengths: np.ndarray, max_length: int, buffer: int, factor: float) -> np.ndarray:
    """DAPO's soft length penalty, <= 0, per response of ``lengths`` tokens."""
    lengths = np.asarray(lengths, np.float32)
    return (factor * np.minimum(0.0, (max_length - buffer - lengths) / buffer)).astype(np.float32)


def informative_groups(rewards: np.ndarray, n: int) -> np.ndarray:
    """[groups] bool: whether a group's rewards are not all equal (its advantage is not zero)."""
    grouped = np.asarray(rewards).reshape(-1, n)
    return grouped.max(axis=1) > grouped.min(axis=1)


@dataclasses.dataclass
class StepBatch:
    """batch        the update's arrays (global with several processes): input_ids,
                    attention_mask, response_mask, old_logprobs, [batch_prompts x n, T]
    rewards, group_ids  per row (global arrays likewise)
    rows, scores, correct, lengths, truncated  every response sampled this step (all rounds,
                    all processes), for metrics; rows[i // n] is response i's prompt
    sample_text, sample_score  this process's first response, for TensorBoard
    stats           dynamic sampling / overlong penalty metrics, and ``reward_info/<key>``: the mean
                    of each other number the reward's dicts gave (empty when none of these applies)
    """

    batch: dict
    rewards: object
    group_ids: object
    rows: list
    scores: np.ndarray
    correct: np.ndarray
    lengths: np.ndarray
    truncated: np.ndarray
    sample_text: str
    sample_score: float
    stats: dict[str, float]


@dataclasses.dataclass
class _Round:
    rows: list
    rollout: object
    texts: list[str]
    scores: np.ndarray
    rewards: np.ndarray
    correct: np.ndarray
    info: dict[str, np.ndarray]


class Collector:
    def __init__(self, config, sampler, sampling, reward_fn, tokenizer, mesh, timer):
        self.config, self.sampler, self.sampling, self.reward_fn = config, sampler, sampling, reward_fn
        self.tokenizer, self.mesh, self.timer = tokenizer, mesh, timer
        self.n = config.rollout.n
        self.prompts = config.train.batch_prompts
        self.mine = dist.block(self.prompts)  # this process's prompts of every batch

    def _round(self, params, rows, key):
        """One round's rollout and scores (a generator: it yields where the sampler waits for a decode
        loop, ``Sampler.generate_steps``; returns the ``_Round``)."""
        a = self.config.algo
        mine = rows[self.mine]
        with self.timer("rollout"):
            rollout = yield from self.sampler.generate_steps(params, [r["prompt_ids"] for r in mine], self.n, key,
                                                             self.sampling)
            rollout = stopped(self.config, self.tokenizer, rollout, self.sampling.pad_id)
        with self.timer("reward"):
            scored = yield from score_rollout_steps(self.config, self.reward_fn, self.tokenizer, mine, rollout,
                                                    self.n)
        rewards = scores = scored.scores
        if a.overlong_buffer > 0:
            rewards = scores + overlong_penalty(rollout.lengths, self.sampling.max_response_len, a.overlong_buffer,
                                                a.overlong_penalty)
        return _Round(rows, rollout, scored.texts, scores, rewards, scored.correct, scored.info)

    def __call__(self, params, iterator, step_key) -> StepBatch:
        return drain(self.steps(params, iterator, step_key))

    def steps(self, params, iterator, step_key):
        """``__call__`` as a generator that yields wherever the host would wait for the sampler's
        devices (``Sampler.generate_steps``), so the sampling loop can dispatch the update's programs
        meanwhile (``rl/pipeline.py``); returns the ``StepBatch``."""
        first = yield from self._round(params, next(iterator), step_key)
        rounds = [first]
        if self.config.algo.filter_groups:
            flags = list(dist.gather(informative_groups(first.rewards, self.n)))
            while sum(int(f.sum()) for f in flags) < self.prompts and len(rounds) < self.config.algo.max_sample_rounds:
                rounds.append((yield from self._round(params, next(iterator),
                                                      jax.random.fold_in(step_key, len(rounds)))))
                flags += dist.gather(informative_groups(rounds[-1].rewards, self.n))
            batch, rewards, group_ids, stats = self._filtered(rounds, flags)
        else:
            batch = dist.global_rows(first.rollout.train_batch(), self.mesh)
            rewards, group_ids = dist.global_rows((first.rewards, first.rollout.group_ids + self.mine.start), self.mesh)
            stats = {}
        gathered = [dist.gather(r.scores, r.rewards - r.scores, r.correct, r.rollout.lengths, r.rollout.truncated)
                    for r in rounds]
        scores, penalties, correct, lengths, truncated = (np.concatenate(parts) for parts in zip(*gathered))
        if self.config.algo.overlong_buffer > 0:
            stats["reward/overlong_penalty"] = float(penalties.mean())
            stats["response/overlong_share"] = float((penalties < 0).mean())
        infos = [gather_info(r.info, len(r.scores)) for r in rounds]
        stats.update(info_means(concat_info(infos, [len(g[0]) for g in gathered]), "reward_info/"))
        return StepBatch(batch, rewards, group_ids, [row for r in rounds for row in r.rows], scores, correct, lengths,
                         truncated, first.texts[0] if first.texts else "",
                         float(first.scores[0]) if len(first.scores) else float("nan"), stats)

    def _filtered(self, rounds: list[_Round], flags: list[np.ndarray]):
        """The first batch_prompts informative groups (topped up with dropped ones), every
        process's rows gathered so each takes its block of them."""
        n = self.n
        informative = [(r, g) for r, f in enumerate(flags) for g in np.flatnonzero(f)]
        dropped = [(r, g) for r, f in enumerate(flags) for g in np.flatnonzero(~f)]
        chosen = (informative + dropped)[: self.prompts]
        sampled = sum(len(f) for f in flags)
        stats = {"dynamic/rounds": float(len(rounds)), "dynamic/dropped_share": len(dropped) / sampled,
                 "dynamic/filled_groups": float(max(0, self.prompts - len(informative)))}
        # every round's rows from every process, in global order (the identity with one process)
        prompt_width = max(r.rollout.prompt_ids.shape[1] for r in rounds)
        response_width = max(r.rollout.response_ids.shape[1] for r in rounds)
        names = sorted(rounds[0].rollout.train_batch())
        parts = []
        for r in rounds:
            local = r.rollout.train_batch()
            local = [_pad(local[k], r.rollout.prompt_ids.shape[1], prompt_width, response_width,
                          self.sampling.pad_id if k == "input_ids" else 0) for k in names]
            parts.append(dist.gather(*local, r.rewards))
        every = [np.concatenate(column) for column in zip(*parts)]  # [rounds x batch_prompts x n, ...]
        group = np.array([r * self.prompts + g for r, g in chosen])
        mine = group[self.mine]  # this process's block of the chosen groups
        take = (mine[:, None] * n + np.arange(n)).reshape(-1)
        batch = {k: every[i][take] for i, k in enumerate(names)}
        rewards = every[-1][take].astype(np.float32)
        group_ids = np.repeat(np.arange(self.mine.start, self.mine.stop, dtype=np.int32), n)
        batch = dist.global_rows(batch, self.mesh)
        rewards, group_ids = dist.global_rows((rewards, group_ids), self.mesh)
        return batch, rewards, group_ids, stats


def _pad(x: np.ndarray, prompt: int, prompt_width: int, response_width: int, value) -> np.ndarray:
    """A round's [rows, prompt + response] array -> [rows, prompt_width + response_width]: the
    prompt part padded on the left, the response part on the right (rounds' widths differ)."""
    response = x.shape[1] - prompt
    return np.pad(x, ((0, 0), (prompt_width - prompt, response_width - response)), constant_values=value)


class EpisodeCollector(Collector):
    """A ``Collector`` whose rounds are ``train.batch_prompts`` x ``rollout.n`` tool episodes
    (``config.env``: ``rollout/episodes.py`` on the device, ``rl/episode_host.py`` on the host), each
    rewarded by its environment; rounds, dynamic sampling, the overlong penalty and the ``StepBatch``
    are the ``Collector``'s. The batch's ``response_mask`` is the action mask: 1 on the policy's drawn
    tokens, 0 on the prompt and on every observation, whose ``old_logprobs`` are 0 (no pi_old); every
    consumer of the update reads that mask (``algos``). ``StepBatch.stats`` adds, over every episode
    of the step (all processes):

        episode/turns               turns per episode (each ended turn the environment answered)
        episode/tool_calls          tool calls per episode; tool_errors, tool_timeouts likewise
        episode/env_errors          episodes an environment failed (raised, overran: reward 0)
        episode/observation_tokens  observation tokens per episode; observations_cut: cut to the cap
        episode/action_share        the policy's share of the episodes' tokens after the prompt (the
                                    masked-in share; the rest are observations)
        time/tool_seconds           the tools' own seconds, summed over the step's calls
        time/environment            this process's wall seconds in the environments' resets and steps
    """

    def __init__(self, config, sampler, sampling, reward_fn, tokenizer, mesh, timer):
        super().__init__(config, sampler, sampling, reward_fn, tokenizer, mesh, timer)
        self.setup = EpisodeSetup.from_config(config, tokenizer, sampler.cfg.vocab_size)
        self.episodes = self.setup.sampler(sampler)
        self.pool = self.setup.pool()
        self._batches: list[tuple[EpisodeBatch, object, np.ndarray]] = []

    def _round(self, params, rows, key):
        """One round of episodes, scored (a generator, as ``Collector._round``)."""
        a = self.config.algo
        mine = rows[self.mine]
        batch = EpisodeBatch(self.setup, self.pool, [row for row in mine for _ in range(self.n)], self.tokenizer)
        with self.timer("rollout"):
            rollout, turns = yield from self.episodes.generate_steps(params, [r["prompt_ids"] for r in mine], self.n,
                                                                     key, self.sampling, batch)
        with self.timer("reward"):
            scored = score_episodes(self.config, self.tokenizer, mine, rollout, self.n, batch)
        self._batches.append((batch, rollout, turns))
        rewards = scores = scored.scores
        if a.overlong_buffer > 0:
            rewards = scores + overlong_penalty(rollout.lengths, self.sampling.max_response_len, a.overlong_buffer,
                                                a.overlong_penalty)
        return _Round(rows, rollout, scored.texts, scores, rewards, scored.correct, scored.info)

    def steps(self, params, iterator, step_key):
        self._batches = []
        out = yield from super().steps(params, iterator, step_key)
        out.stats.update(episode_stats(self._batches))
        return out


def episode_stats(batches) -> dict[str, float]:
    """``EpisodeCollector``'s metrics of one step's rounds (``(EpisodeBatch, Rollout, turns)`` each),
    gathered over the processes."""
    columns = []
    for batch, rollout, turns in batches:
        c = batch.counts
        columns.append(dist.gather(turns.astype(np.float64), c["tool_calls"], c["tool_errors"], c["tool_timeouts"],
                                   c["env_errors"], c["tool_seconds"], batch.observation_tokens.astype(np.float64),
                                   batch.observations_cut.astype(np.float64),
                                   rollout.response_mask.sum(1).astype(np.float64)))
    turns, calls, errors, timeouts, env_errors, seconds, observed, cut, actions = (
        np.concatenate(parts) for parts in zip(*columns))
    return {"episode/turns": float(turns.mean()), "episode/tool_calls": float(calls.mean()),
            "episode/tool_errors": float(errors.mean()), "episode/tool_timeouts": float(timeouts.mean()),
            "episode/env_errors": float(env_errors.sum()), "episode/observation_tokens": float(observed.mean()),
            "episode/observations_cut": float(cut.sum()),
            "episode/action_share": float(actions.sum() / max(actions.sum() + observed.sum(), 1.0)),
            "time/tool_seconds": float(seconds.sum()),
            "time/environment": float(sum(batch.seconds for batch, _, _ in batches))}


def make_collector(config, sampler, sampling, reward_fn, tokenizer, mesh, timer) -> Collector:
    """The run's collector: a ``Collector``, or with ``config.env.name`` set the tool episodes'
    ``EpisodeCollector`` (the same calls and ``StepBatch``)."""
    kind = EpisodeCollector if config.env.name else Collector
    return kind(config, sampler, sampling, reward_fn, tokenizer, mesh, timer)
