"""Evaluation on test sets: greedy accuracy, and pass@k / maj@k / mean@k from sampled responses.

For each test file, every prompt gets one greedy response and ``train.eval_n`` sampled ones
(at ``train.eval_temperature``, with the rollout's top_p / top_k). Per file (and averaged over
files as ``eval/avg/...``):

    greedy_acc, greedy_reward, sampled_acc, sampled_reward
    pass@k   the unbiased estimator of Chen et al. (2021) from all n = eval_n samples of a
             prompt, c of them correct: 1 - C(n - c, k) / C(n, k), averaged over prompts
    maj@k    whether the most frequent answer among the prompt's FIRST k samples is correct
    mean@k   the accuracy of the prompt's first k samples (mean@eval_n = sampled_acc)
    greedy_info/<key>, sampled_info/<key>   the mean of each other number a reward dict gives

What counts as correct is ``is_correct``: a score >= ``reward.correct_at`` when set, else the
reward's own ``acc`` where it returns one, else the task's full score (K&K 3, others 1); a
response whose scoring failed never is.

Samples are i.i.d., so the first k are a uniformly random k-subset: maj@k and mean@k are
unbiased too, only noisier than an average over every subset. "The answer" of a response
is ``tasks.answer_for(data_source)``: K&K's parsed assignment, math's normalised boxed
answer. Responses without a parseable answer do not vote; a prompt none of whose k samples
has one counts as wrong. A tie is won by the tied answer that appears first (with
exchangeable samples, a uniformly random choice among them). The winning answer is correct
when the first response giving it is. maj@k is not reported for a file holding a data
source without a built-in answer format (a custom reward function's).

Every evaluation can keep what it generated (``Evaluator.run(..., generations_dir=DIR)``):
one ``DIR/<test set>.jsonl`` per test file, a line per response with the prompt's row in its
file, the mode (greedy or sampled) and sample number, the response text (special tokens
kept), the extracted answer, the score, whether it counts as correct and the reward's
other numbers (``info``). With tool episodes (``env.name``: run as the training runs them,
``rl/episode_host.py``) the response is the whole episode after the prompt, ``info`` its reward
parts, and ``turns`` each turn: the policy's text (``action``), what stopped it (``stop``: eos,
marker, turn_cap, budget) and the observation fed after it as the model saw it (None for the
turn that ended the episode). With several
processes each writes its own responses to ``<test set>.process<i>.jsonl``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Hashable, Sequence
from pathlib import Path

import jax
import numpy as np

from arlopti_jax.rollout import apply_stops, cut_texts
from arlopti_jax.runtime import compiles
from arlopti_jax.runtime import distributed as dist
from arlopti_jax.runtime import faults
from arlopti_jax.tasks import Reward, answer_for, score_rewards


def is_correct(data_source: str, reward: Reward, correct_at: float | None = None) -> bool:
    """Whether a scored response counts as correct: never when its scoring failed; a score >=
    ``correct_at`` when that is set (``reward.correct_at``); else the reward's own ``acc`` where it
    gave one; else the task's full score: K&K 3 (format and answer right), other tasks 1."""
    if reward.failed:
        return False
    if correct_at is not None:
        return reward.score >= correct_at
    if reward.acc is not None:
        return reward.acc
    return reward.score >= (3.0 if data_source.startswith("kk_logic") else 1.0)


@dataclasses.dataclass
class Scored:
    """A rollout's responses scored: decoded solution strings, float32 scores, whether each is
    correct (``is_correct``), and the reward's other numbers per key (float32, NaN where a
    response's reward did not give that key)."""

    texts: list[str]
    scores: np.ndarray
    correct: np.ndarray
    info: dict[str, np.ndarray]


def decode_solutions(tokenizer, prompt_rows: list[dict], rollout, n: int) -> list[str]:
    """verl's ``solution_str``: the decoded prompt and response together, special tokens kept (less
    what a stop string cut: ``Rollout.text_cut``)."""
    seqs = [prompt_rows[i // n]["prompt_ids"] + resp for i, resp in enumerate(rollout.responses())]
    return cut_texts(tokenizer.batch_decode(seqs, skip_special_tokens=False), rollout)


def stopped(config, tokenizer, rollout, pad_id: int):
    """``rollout`` trimmed at ``rollout.stop``'s strings (``rollout/stop.py``); itself without them."""
    return apply_stops(rollout, tokenizer, tuple(config.rollout.stop), config.rollout.include_stop_str, pad_id)


SCORE_PARTS = 4  # a training batch is scored in this many parts, the sampling loop's turns between them


def score_rollout(config, reward_fn, tokenizer, rows: list[dict], rollout, n: int, parts: int = 1) -> Scored:
    """Every response of ``rollout`` scored; rows[i // n] is response i's prompt."""
    from arlopti_jax.rollout.sampler import drain

    return drain(score_rollout_steps(config, reward_fn, tokenizer, rows, rollout, n, parts))


def score_rollout_steps(config, reward_fn, tokenizer, rows: list[dict], rollout, n: int, parts: int = SCORE_PARTS):
    """``score_rollout`` as a generator that scores the responses in ``parts`` runs of whole groups
    (each part's in parallel, ``reward.workers``) and yields between them, so the sampling loop can
    dispatch the update's next programs while the host scores (``rl/pipeline.py``); returns the
    ``Scored``. The scores are the same in any number of parts: a reward is a function of its text."""
    texts = decode_solutions(tokenizer, rows, rollout, n)
    sources = [rows[i // n]["data_source"] for i in range(len(texts))]
    groups = -(-len(texts) // n) if n else 0
    bounds = sorted({min(len(texts), (groups * j // max(parts, 1)) * n) for j in range(max(parts, 1) + 1)})
    rewards = []
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        if i:
            yield  # the other task's turn: the host scores the rest afterwards
        rewards += score_rewards(reward_fn, sources[lo:hi], texts[lo:hi],
                                 [rows[j // n]["ground_truth"] for j in range(lo, hi)],
                                 [rows[j // n]["extra_info"] for j in range(lo, hi)],
                                 num_workers=config.reward.workers, timeout_s=config.reward.timeout_s)
    correct_at = config.reward.get("correct_at")
    keys = sorted({k for r in rewards for k in r.info})
    return Scored(texts, np.array([r.score for r in rewards], np.float32),
                  np.array([is_correct(s, r, correct_at) for s, r in zip(sources, rewards)], bool),
                  {k: np.array([r.info.get(k, np.nan) for r in rewards], np.float32) for k in keys})


def score_episodes(config, tokenizer, rows: list[dict], rollout, n: int, batch) -> Scored:
    """Every tool episode of ``rollout`` scored by its environment (``episode_host.EpisodeBatch``'s
    rewards: the sum of its parts, which ``info`` holds per part); the texts as ``score_rollout``'s,
    observations included."""
    texts = decode_solutions(tokenizer, rows, rollout, n)
    rewards = batch.rewards()
    correct_at = config.reward.get("correct_at")
    keys = sorted({k for r in rewards for k in r.info})
    correct = [is_correct(rows[i // n]["data_source"], r, correct_at) for i, r in enumerate(rewards)]
    return Scored(texts, np.array([r.score for r in rewards], np.float32), np.array(correct, bool),
                  {k: np.array([r.info.get(k, np.nan) for r in rewards], np.float32) for k in keys})


def gather_info(info: dict[str, np.ndarray], count: int) -> dict[str, np.ndarray]:
    """``Scored.info`` of every process's ``count`` responses, concatenated in process order, over
    the keys any process's rewards gave (NaN where one did not)."""
    keys = sorted(set().union(*dist.gather_json(sorted(info))))
    return {k: dist.gather(info.get(k, np.full(count, np.nan, np.float32)))[0] for k in keys}


def concat_info(infos: list[dict[str, np.ndarray]], counts: list[int]) -> dict[str, np.ndarray]:
    """Parts of ``Scored.info`` (``counts[i]`` responses in part i) as one, over every part's keys."""
    keys = sorted({k for info in infos for k in info})
    return {k: np.concatenate([info.get(k, np.full(c, np.nan, np.float32)) for info, c in zip(infos, counts)])
            for k in keys}


def info_means(info: dict[str, np.ndarray], prefix: str) -> dict[str, float]:
    """``prefix + key``: the mean of each key's values over the responses that have it."""
    return {f"{prefix}{k}": float(np.nanmean(v)) for k, v in info.items() if np.isfinite(v).any()}


# ---- estimators (one prompt) ----

def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of the n samples, drawn without replacement,
    hold a correct one (as a product, so large n cannot overflow)."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_correct(answers: Sequence[Hashable | None], correct: Sequence[bool]) -> bool:
    """Whether the most frequent non-None answer is correct (rules in the module docstring)."""
    counts: dict[Hashable, int] = {}
    first: dict[Hashable, int] = {}
    for i, answer in enumerate(answers):
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1
            first.setdefault(answer, i)
    if not counts:
        return False
    top = max(counts.values())
    winner = min((a for a in counts if counts[a] == top), key=first.__getitem__)
    return bool(correct[first[winner]])


def prompt_stats(correct: np.ndarray, answers: list | None, ks: Sequence[int]) -> np.ndarray:
    """[pass@k..., maj@k..., mean@k...] of one prompt's samples (maj@k NaN without answers)."""
    n, c = len(correct), int(np.sum(correct))
    passes = [pass_at_k(n, c, k) for k in ks]
    majs = [float(majority_correct(answers[:k], correct[:k])) if answers is not None else np.nan for k in ks]
    means = [float(np.mean(correct[:k])) for k in ks]
    return np.array(passes + majs + means, np.float64)


def stat_names(ks: Sequence[int]) -> list[str]:
    return [f"{kind}@{k}" for kind in ("pass", "maj", "mean") for k in ks]


class Evaluator:
    """Greedy and sampled metrics per test set. With several processes, each samples and scores
    its share of every chunk of prompts (a prompt's samples stay on one process); per-response
    scores and per-prompt statistics are gathered."""

    def __init__(self, config, run, tokenizer, test_sets: dict, reward_fn):
        """``run``: the ``run_setup.assemble`` of ``config`` (its sampler and sampling settings)."""
        self.config, self.sampler, self.tokenizer, self.sets, self.reward_fn = (config, run.sampler, tokenizer,
                                                                                test_sets, reward_fn)
        self.greedy = run.sampling(greedy=True)
        self.sampled = run.sampling(temperature=config.train.eval_temperature)
        self.ks = tuple(int(k) for k in config.train.eval_ks)
        self.episodes = None  # with env.name: tool episodes, run as the training's are
        if config.env.name and test_sets:
            from arlopti_jax.rl.episode_host import EpisodeSetup

            self.setup = EpisodeSetup.from_config(config, tokenizer, run.sampler.cfg.vocab_size)
            self.episodes, self.pool = self.setup.sampler(run.sampler), self.setup.pool()

    @property
    def settings(self) -> dict[str, float]:
        """How the sampled evaluation draws, for the records beside its results."""
        return {"eval_n": self.config.train.eval_n, "eval_temperature": self.sampled.temperature,
                "eval_top_p": self.sampled.top_p, "eval_top_k": self.sampled.top_k}

    def _chunk(self, params, key, rows, n, sampling, mode: str, records: list[dict] | None, pad_to: int = 0):
        """Scores, correctness and (sampled mode) per-prompt statistics of this process's share;
        appends this process's responses to ``records`` (unless None). ``pad_to``: the sampler's
        batch is laid out for that many prompts (padding rows, dropped: ``Sampler.generate``)."""
        cfg = self.config
        rows = rows[self.sampler.process_share(len(rows), sampling, pad_to)]
        prompts, turns = [r["prompt_ids"] for r in rows], None
        if self.episodes is None:
            rollout = self.sampler.generate(params, prompts, n, key, sampling, pad_to=pad_to)
            rollout = stopped(cfg, self.tokenizer, rollout, sampling.pad_id)
            scored = score_rollout(cfg, self.reward_fn, self.tokenizer, rows, rollout, n)
        else:
            from arlopti_jax.rl.episode_host import EpisodeBatch

            episodes = EpisodeBatch(self.setup, self.pool, [row for row in rows for _ in range(n)], self.tokenizer)
            rollout, _ = self.episodes.generate(params, prompts, n, key, sampling, episodes, pad_to=pad_to)
            scored, turns = score_episodes(cfg, self.tokenizer, rows, rollout, n, episodes), episodes.turns
        texts, scores, ok = scored.texts, scored.scores, scored.correct
        answers = [None] * len(texts)
        for i, text in enumerate(texts):
            extract = answer_for(rows[i // n]["data_source"])
            answers[i] = None if extract is None else extract(text, rows[i // n]["ground_truth"])
        stats = np.zeros((len(rows), 3 * len(self.ks) if mode == "sampled" else 0))
        for p, row in enumerate(rows if mode == "sampled" else ()):
            with_answers = answer_for(row["data_source"]) is not None
            stats[p] = prompt_stats(ok[p * n:(p + 1) * n], answers[p * n:(p + 1) * n] if with_answers else None,
                                    self.ks)
        if records is not None:
            responses = cut_texts(self.tokenizer.batch_decode(rollout.responses(), skip_special_tokens=False), rollout)
            records += [{"row": rows[i // n]["row"], "mode": mode, "sample": i % n, "response": responses[i],
                         "answer": answers[i], "score": float(scores[i]), "correct": bool(ok[i]),
                         "ground_truth": rows[i // n]["ground_truth"],
                         **({"info": {k: float(v[i]) for k, v in scored.info.items() if np.isfinite(v[i])}}
                            if scored.info else {}), **({"turns": turns[i]} if turns is not None else {})}
                        for i in range(len(texts))]
        return (*dist.gather(scores, ok, stats), gather_info(scored.info, len(texts)))

    def _rows(self, ds) -> list[dict]:
        cap = self.config.train.eval_max_prompts
        return ds.rows if cap < 0 else ds.rows[:cap]

    def _modes(self):
        """(mode, sampling, samples per prompt, prompts per generate call, prompts it is laid out for)
        of the greedy and the sampled evaluation."""
        cfg = self.config
        cap = cfg.train.batch_prompts * cfg.rollout.n  # responses per generate call
        largest = max((len(self._rows(ds)) for ds in self.sets.values()), default=0)
        for mode, sampling, n in (("greedy", self.greedy, 1), ("sampled", self.sampled, cfg.train.eval_n)):
            per = max(1, cap // n)
            # every chunk (a test set's last, a smaller test set's) is laid out as a full one: one
            # prompt-count bucket, one set of sampler programs, for the whole evaluation
            yield mode, sampling, n, per, min(per, largest)

    def schedules(self, params, key) -> list[list]:
        """The sampler's programs of ``run(params, key)`` (``Sampler.schedule``), greedy and sampled (none
        without test sets), at the run's prompt width (``SamplingConfig.prompt_width``, which ``train``
        sets: every chunk is padded to it): ``params`` abstract (``compiles.abstract``), ``key`` the one
        ``run`` is given. The chunks' keys are derived as ``run`` derives them, so its key split is
        compiled here too."""
        if not self.sets:
            return []
        _, sub = jax.random.split(key)
        programs = self.sampler if self.episodes is None else self.episodes
        return [programs.schedule(params, pad_to, sampling.prompt_width, n, sampling, key=compiles.abstract(sub))
                for _, sampling, n, _, pad_to in self._modes()]

    def run(self, params, key, generations_dir: str | Path | None = None) -> dict[str, float]:
        """Every metric of every test set; with ``generations_dir``, each response too (module
        docstring)."""
        from tqdm.auto import tqdm

        cfg = self.config
        out: dict[str, float] = {}
        for name, ds in self.sets.items():
            rows = self._rows(ds)
            records = [] if generations_dir is not None else None
            total = len(rows) * (1 + cfg.train.eval_n)
            bar = tqdm(total=total, desc=f"eval {name}", unit="response", leave=False,
                       disable=jax.process_index() != 0)
            for mode, sampling, n, per, pad_to in self._modes():
                scores, correct, stats, infos = [], [], [], []
                for start in range(0, len(rows), per):
                    key, sub = jax.random.split(key)
                    s, ok, st, info = self._chunk(params, sub, rows[start:start + per], n, sampling, mode, records,
                                                  pad_to)
                    scores.append(s)
                    correct.append(ok)
                    stats.append(st)
                    infos.append(info)
                    bar.update(len(s))
                    bar.set_postfix({f"{mode}_acc": f"{np.mean(np.concatenate(correct)):.3f}"})
                out[f"eval/{name}/{mode}_acc"] = float(np.mean(np.concatenate(correct)))
                out[f"eval/{name}/{mode}_reward"] = float(np.mean(np.concatenate(scores)))
                out.update(info_means(concat_info(infos, [len(s) for s in scores]), f"eval/{name}/{mode}_info/"))
                if mode == "sampled":
                    for stat, values in zip(stat_names(self.ks), np.concatenate(stats).T):
                        if not np.isnan(values).any():
                            out[f"eval/{name}/{stat}"] = float(values.mean())
            bar.close()
            if records is not None:
                write_generations(Path(generations_dir), name, records)
        for metric in ["greedy_acc", "sampled_acc", *stat_names(self.ks)]:
            values = [v for k, v in out.items() if k.endswith(f"/{metric}")]
            if values:
                out[f"eval/avg/{metric}"] = float(np.mean(values))
        return out


def write_generations(folder: Path, name: str, records: list[dict]) -> Path:
    """This process's responses to one test set as jsonl (answers such as K&K's tuples as lists)."""
    suffix = f".process{jax.process_index()}" if jax.process_count() > 1 else ""
    path = folder / f"{name}{suffix}.jsonl"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")  # a crash mid-write leaves no cut file under the name
    with open(tmp, "w") as f:
        faults.write(f, "".join(json.dumps(record, default=str) + "\n" for record in records), "generations")
    tmp.replace(path)
    return path


def trim_jsonl(path: Path, last_step: int) -> int:
    """Keep the records of ``path`` up to ``last_step`` (-1: none of the training's): a run resumed
    from the checkpoint of ``last_step`` (or restarted) writes the later steps again, once each.
    The records taken out are appended to ``<path>.replaced``, so nothing a run wrote is lost;
    returns how many. Records without a step (standalone ``eval``'s) are kept; a line that is not
    a JSON object (the half-written last line of a killed run) is moved out with them."""
    if jax.process_index() != 0 or not path.exists():
        return 0
    text = path.read_text()
    lines = text.splitlines()
    keep, out = [], []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        fits = isinstance(record, dict) and record.get("step", last_step) <= last_step
        (keep if fits else out).append(line)
    if out or text and not text.endswith("\n"):
        with open(path.with_name(path.name + ".replaced"), "a") as f:
            f.write("".join(line + "\n" for line in out))
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)
    return len(out)


def append_jsonl(path: Path, record: dict) -> None:
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            faults.write(f, json.dumps(record) + "\n", "eval")


def _columns(results: dict[str, float], with_reward: bool) -> list[str]:
    stats = sorted({k.split("/")[2] for k in results if "@" in k},
                   key=lambda s: (("pass", "maj", "mean").index(s.split("@")[0]), int(s.split("@")[1])))
    return ["greedy_acc", "sampled_acc", *(["greedy_reward"] if with_reward else []), *stats]


def _table(results: dict[str, float], columns: list[str], cell, width: int, settings: dict | None,
           chance: dict[str, float | None] | None = None) -> str:
    names = sorted({k.split("/")[1] for k in results if k.startswith("eval/")})
    if chance is not None:  # a last column: the accuracy of guessing ('-' where unknown)
        known = [v for v in chance.values() if v is not None]
        levels = {**chance, "avg": float(np.mean(known)) if known and len(known) == len(chance) else None}
        shown = {name: f"{levels[name]:.3f}" if levels.get(name) is not None else "-" for name in names}
    lines = [f"{'test set':<24}" + "".join(f"{c.replace('_', ' '):>{width}}" for c in columns)
             + (f"{'chance':>8}" if chance is not None else "")]
    lines += [f"{name:<24}" + "".join(f"{cell(name, c):>{width}}" for c in columns)
              + (f"{shown[name]:>8}" if chance is not None else "") for name in names]
    if settings:
        lines.append(f"sampled: {settings['eval_n']} per prompt at temperature {settings['eval_temperature']:g} "
                     f"(top_p {settings['eval_top_p']:g}, top_k {settings['eval_top_k']})")
    return "\n".join(lines)


def format_table(results: dict[str, float], settings: dict | None = None) -> str:
    """One row per test set: greedy and sampled accuracy, greedy reward, then every pass@k,
    maj@k and mean@k present; ``settings`` (``Evaluator.settings``) as a last line."""
    fmt = lambda v: f"{v:.3f}" if v is not None else "-"
    return _table(results, _columns(results, True), lambda name, c: fmt(results.get(f"eval/{name}/{c}")), 15,
                  settings)


def compare_table(before: dict[str, float], after: dict[str, float], settings: dict | None = None,
                  chance: dict[str, float | None] | None = None) -> str:
    """``format_table``'s accuracies as 'before -> after' cells; with ``chance`` (per test set,
    the accuracy of guessing, or None) a last column of it."""
    fmt = lambda v: f"{v:.3f}" if v is not None else "  -  "
    cell = lambda name, c: f"{fmt(before.get(f'eval/{name}/{c}'))} -> {fmt(after.get(f'eval/{name}/{c}'))}"
    return _table(after, _columns(after, False), cell, 16, settings, chance)
