"""Tool episodes on the host: the environments of a batch of episodes answering the sampler's turns.

    setup = EpisodeSetup.from_config(config, tokenizer, vocab_size)       # once per run
    batch = EpisodeBatch(setup, pool, problems, tokenizer)                # one environment per episode
    rollout, turns = setup.sampler(sampler).generate(params, prompts, n, key, sampling, batch)
    batch.rewards(), batch.counts, batch.turns                            # per episode

``config.env`` names the environment (``tasks.envs.load_environment``: a built-in or an import
path, its parameters ``env.params``) and the caps: ``env.max_turns`` turns, ``env.turn_tokens``
tokens a turn, ``env.observation_tokens`` an observation (``rollout.max_response_length`` in all
after the prompt). Each episode gets its own environment, reset with its problem (a
``PromptDataset`` row); each ended turn's text (its drawn ids decoded, special tokens kept, as the
rewards read text) goes to its ``step``, all the waiting episodes' steps at once in a
``tasks.envs.StepPool`` (``env.workers`` threads, ``env.step_timeout_s``). A Step's observation
is formatted and tokenized by ``rollout.observations.ObservationFormat`` and fed; a done Step, the
last turn, or no room left ends the episode. An environment that raises or overruns ends its
episode with reward 0 (the runner logs one line naming it, the problem and the turn, and counts
``env_errors``); the run goes on.

The prompts tell the policy about the tools: with ``env.template_tools`` and a chat template that
supports tools (Qwen2.5's, Qwen3's) they are rendered with the template's own tools section from
the environment's JSON schemas (``prompt_tools``: ``apply_chat_template(tools=...)``, as a Hub
model was tuned to read them); with a template without (SmolLM2's) the data's own messages say it
(the warm start's system message holds the environment's ``instructions``). ``check_episodes``
runs at start-up, before anything is written: an observation format the template cannot give
(``env.observation_format`` empty with a template without tools) or a tools section that does
not teach the environment's call format stops the command in one line.

The episode's reward is the sum of its Steps' reward parts (``reward_info/<part>`` logs each
part's mean). It counts as correct when its ``answer`` part is at least 1 (the built-ins' graded
answer), else by ``evaluation.is_correct`` on its total.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import numpy as np

from arlopti_jax.rollout.episodes import EpisodeSampler, EpisodeSpec, TurnEnd, episode_sampler
from arlopti_jax.rollout.markers import marker_table, token_texts
from arlopti_jax.rollout.observations import ObservationFormat, template_supports_tools, tools_section_problem
from arlopti_jax.runtime import faults
from arlopti_jax.tasks import Reward
from arlopti_jax.tasks.envs import INFO_COUNTS, EnvironmentFactory, StepPool, load_environment

log = logging.getLogger(__name__)


def env_params(config) -> dict:
    """``env.params`` (a JSON object) as a dict; ValueError naming the field."""
    text = config.env.params or "{}"
    try:
        params = json.loads(text)
    except ValueError as err:
        raise ValueError(f"config.env.params={text!r} is not JSON ({err})") from None
    if not isinstance(params, dict):
        raise ValueError(f"config.env.params={text!r} must be a JSON object of the environment's parameters")
    return params


def env_factory(config) -> EnvironmentFactory:
    """The environment ``config.env.name`` names (``EnvironmentLoadError``, one line, when it cannot be made)."""
    return load_environment(config.env.name, env_params(config), field="config.env.name")


def stop_marker(factory: EnvironmentFactory) -> str:
    """The environment's one stop string: the text that ends a turn that calls a tool."""
    if len(factory.stop_strings) != 1:
        raise ValueError(f"config.env.name={factory.name!r}: the environment's stop_strings {factory.stop_strings!r} "
                         "must be one string (the close of a tool call, where the sampler ends a turn)")
    return factory.stop_strings[0]


def episode_spec(config, factory: EnvironmentFactory | None = None) -> EpisodeSpec:
    """The shapes of the run's episode programs (no tokenizer needed: ``aot`` and the warm-up)."""
    factory = env_factory(config) if factory is None else factory
    return EpisodeSpec(turn_tokens=config.env.turn_tokens, observation_tokens=config.env.observation_tokens,
                       marker_length=len(stop_marker(factory)))


def observation_format(config, tokenizer) -> ObservationFormat:
    """The run's observations as ids (``env.observation_format``, or the chat template's tool message);
    ValueError, naming the field, where the template cannot give one and the field is empty."""
    return ObservationFormat(tokenizer, config.env.observation_format, config.env.observation_tokens,
                             where="config.env.observation_format")


def prompt_tools(config, tokenizer, factory: EnvironmentFactory | None = None) -> list[dict] | None:
    """The JSON schemas the run's prompts are rendered with (``tasks.data.render_prompt``'s ``tools``):
    the environment's, with ``env.name`` and ``env.template_tools`` set and a chat template that
    supports tools (``template_supports_tools``); else None. ValueError, naming the field, where
    such a template cannot write them: it raises on them, writes nothing for them, or teaches
    another call format than the environment's (its stop string, a call's close, is not in what the
    template writes: Qwen's ``</tool_call>`` against an environment's ``</calc>``)."""
    if not (config.env.name and config.env.template_tools and template_supports_tools(tokenizer)):
        return None
    factory = env_factory(config) if factory is None else factory
    if not factory.tools:
        return None
    problem = tools_section_problem(tokenizer, factory.tools, stop_marker(factory))
    if problem is not None:
        raise ValueError(f"config.env.template_tools=True (config.env.name={config.env.name!r}): {problem}; use the "
                         "template's call format in config.env.params (the built-ins' default: JSON in "
                         "<tool_call>...</tool_call>), or set config.env.template_tools=False and let the prompts' "
                         "messages say how to call the tools")
    return factory.tools


def check_episodes(config, tokenizer) -> None:
    """What a run's episodes need from the tokenizer, checked at start-up (module docstring): the
    observation format, and the prompts' tools section where the template writes one."""
    observation_format(config, tokenizer)
    factory = env_factory(config)
    tools = prompt_tools(config, tokenizer, factory)
    if tools:
        names = ", ".join(str((t.get("function") or t).get("name", "?")) for t in tools)
        log.info("tool episodes: the prompts are rendered with the chat template's tools section (%s)", names)
        return
    why = ("env.template_tools=False" if not config.env.template_tools else "the environment gives no tool schemas"
           if not factory.tools else "the chat template has no tool support")
    log.info("tool episodes: the prompts are rendered without a tools section (%s): their messages must say how to "
             "call the tools", why)


@dataclasses.dataclass
class EpisodeSetup:
    """What every batch of a run's episodes shares (module docstring)."""

    name: str
    factory: EnvironmentFactory
    spec: EpisodeSpec
    format: ObservationFormat
    table: np.ndarray
    max_turns: int
    timeout_s: float
    workers: int

    @classmethod
    def from_config(cls, config, tokenizer, vocab_size: int) -> "EpisodeSetup":
        factory = env_factory(config)
        spec = episode_spec(config, factory)
        fmt = observation_format(config, tokenizer)
        table = marker_table(token_texts(tokenizer), stop_marker(factory), vocab_size)
        return cls(config.env.name, factory, spec, fmt, table, config.env.max_turns, config.env.step_timeout_s,
                   config.env.workers)

    def sampler(self, sampler) -> EpisodeSampler:
        return episode_sampler(sampler, self.spec)

    def pool(self) -> StepPool:
        return StepPool(self.name, max_workers=self.workers)


def rollout_programs(config, sampler):
    """What lists the programs of ``config``'s rollouts on ``sampler``: the sampler, or with
    ``config.env.name`` its ``EpisodeSampler`` (the warm-up and ``aot`` call its ``schedule``)."""
    return episode_sampler(sampler, episode_spec(config)) if config.env.name else sampler


def problem_id(row: dict) -> str:
    return f"{row.get('source', '?')}:{row.get('row', '?')}"


class EpisodeBatch:
    """The environments of one batch of this process's episodes (episode e answers ``problems[e]``),
    as ``rollout.episodes.EpisodeHost``."""

    def __init__(self, setup: EpisodeSetup, pool: StepPool, problems: list[dict], tokenizer):
        self.setup, self.pool, self.problems, self.tokenizer = setup, pool, problems, tokenizer
        self.table = setup.table
        self.envs = [setup.factory() for _ in problems]
        count = len(problems)
        self.parts: list[dict[str, float]] = [{} for _ in range(count)]
        self.counts = {k: np.zeros(count, np.float64) for k in INFO_COUNTS}
        self.observation_tokens = np.zeros(count, np.int64)
        self.observations_cut = np.zeros(count, np.int64)
        self.turns: list[list[dict]] = [[] for _ in range(count)]  # per turn: action, observation (None: the end)
        self.ended = np.zeros(count, bool)
        self.seconds = 0.0  # wall time in the environments' resets and steps

    def _add(self, e: int, step) -> None:
        for key, value in step.reward.items():
            self.parts[e][key] = self.parts[e].get(key, 0.0) + value
        for key in INFO_COUNTS:
            self.counts[key][e] += float(step.info.get(key, 0) or 0)

    def first(self, count: int) -> list[list[int]]:
        began = time.perf_counter()
        steps = self.pool.resets([(env, p, problem_id(p)) for env, p in zip(self.envs, self.problems)],
                                 self.setup.timeout_s)
        self.seconds += time.perf_counter() - began
        out = []
        for e, step in enumerate(steps):
            self._add(e, step)
            ids: list[int] = []
            if step.done:  # the reset failed: the episode's first turn is answered with its end
                self.ended[e] = True
            elif step.observation:
                ids, cut = self.setup.format(step.observation)
                self.observation_tokens[e] += len(ids)
                self.observations_cut[e] += cut
                self.turns[e].append({"action": "", "observation": self.tokenizer.decode(ids)})
            out.append(ids)
        return out[:count]

    def answer(self, ends: list[TurnEnd]) -> list[list[int] | None]:
        faults.point("episode")  # a crash with episodes in flight: a resumed run samples the step again
        texts = self.tokenizer.batch_decode([end.tokens for end in ends], skip_special_tokens=False)
        live = [i for i, end in enumerate(ends) if not self.ended[end.episode]]
        began = time.perf_counter()
        steps = self.pool.steps([(self.envs[ends[i].episode], texts[i], problem_id(self.problems[ends[i].episode]),
                                  ends[i].turn) for i in live], self.setup.timeout_s)
        self.seconds += time.perf_counter() - began
        replies: list[list[int] | None] = [None] * len(ends)
        for i, step in zip(live, steps):
            end = ends[i]
            e = end.episode
            self._add(e, step)
            record = {"action": texts[i], "observation": None, "stop": end.reason}
            self.turns[e].append(record)
            if step.done or step.observation is None or end.turn >= self.setup.max_turns or end.reason == "budget":
                self.ended[e] = True
                continue
            ids, cut = self.setup.format(step.observation, after=end.tokens[-1] if end.tokens else None)
            self.observation_tokens[e] += len(ids)
            self.observations_cut[e] += cut
            record["observation"] = self.tokenizer.decode(ids)
            replies[i] = ids
        for i in set(range(len(ends))) - set(live):  # a failed reset: its first turn ends it
            self.turns[ends[i].episode].append({"action": texts[i], "observation": None, "stop": ends[i].reason})
        return replies

    def rewards(self) -> list[Reward]:
        """Each episode's reward: the sum of its parts, ``acc`` from its 'answer' part (module
        docstring), failed where an environment raised or overran."""
        out = []
        for e, parts in enumerate(self.parts):
            acc = bool(parts["answer"] >= 1.0) if "answer" in parts else None
            failed = bool(self.counts["env_errors"][e] > 0)  # scores 0, whatever its earlier turns gave
            out.append(Reward(0.0 if failed else float(sum(parts.values())), acc, dict(parts), failed))
        return out
