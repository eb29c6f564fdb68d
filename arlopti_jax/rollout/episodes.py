"""Tool episodes in the sampler: the rows decode turn after turn, the host answering each turn.

    episodes = EpisodeSampler(sampler, EpisodeSpec(turn_tokens=256, observation_tokens=128, marker_length=12))
    rollout = episodes.generate(params, prompt_token_lists, n, key, sampling, host)

Each turn a row decodes until its stop marker (a tool call's close, ``markers.py``), an EOS id, the
turn's token cap (``turn_tokens``) or the episode's budget (``max_response_len`` tokens after the
prompt, observations included). The host (``EpisodeHost``: the environments, ``rl/episode_host.py``)
gets the turn's token ids and answers with the observation's token ids, or with None to end the
episode; the row then decodes on from its KV cache, the observation fed as forced tokens
(``episode_programs.py``: no re-tokenization, no prefill of what the cache holds). The trained
sequence is the prompt, then exactly the ids the rows drew and the ids the host gave, in order:
``Rollout.response_mask`` marks the drawn ones (the action mask), ``Rollout.observation_mask``
the given ones, and the log-probs are the drawn tokens' (0 on observations, which have no pi_old).

The loop is the length-aware sampler's (``sampler.py``): phases whose cache grows, rows that leave
the batch once their episode is over (compaction), the host reading a few numbers after each loop.
A loop also ends when half of the rows in play wait for the host, who answers all of them at once
(the environments' steps run in parallel), so a slow tool holds up at most the rows waiting beside
it. Rows that finish early free their place, and the batch never waits for its longest episode.

Compiled programs: the sampler's cast and prefill, then ``start``, and per (rows per device,
cache slots) pair one decode loop and one ``resume``, one compaction, one growth, one scatter,
as the sampler's schedule; none depends on the number of turns, an observation's length or the
turn it arrives at. ``schedule`` lists them all for the warm-up and ``python -m arlopti_jax.aot``.

Several processes: each process's host answers its own rows (it holds their prompts); the
decisions the loop takes (leave, answer, compact, grow) read global counts the device computed,
so every process dispatches the same programs in the same order.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from arlopti_jax.runtime import compiles
from arlopti_jax.runtime import distributed as dist
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.rollout import episode_programs as ep
from arlopti_jax.rollout.output import Rollout
from arlopti_jax.rollout.sampler import SAMPLING_WEIGHTS, Sampler, _half, batch_rows, drain, in_context
from arlopti_jax.rollout.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class EpisodeSpec:
    """What shapes the episode programs: a turn's most tokens, an observation's most tokens (the
    feed buffer's width), and the stop marker's length in characters (the automaton's width - 1;
    ``markers.marker_table``)."""

    turn_tokens: int
    observation_tokens: int
    marker_length: int

    def __post_init__(self):
        for name in ("turn_tokens", "observation_tokens", "marker_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"EpisodeSpec.{name}={getattr(self, name)} must be >= 1")

    def table_shape(self, vocab_size: int) -> tuple[int, int]:
        return vocab_size, self.marker_length + 1

    @property
    def table_dtype(self):
        return np.int8 if self.marker_length < 127 else np.int32


@dataclasses.dataclass(frozen=True)
class TurnEnd:
    """A turn the host answers. ``episode``: this process's index of the episode (prompt i, sample j:
    i * n + j); ``tokens``: the turn's drawn ids; ``reason``: eos, marker, turn_cap or budget;
    ``length``: the episode's tokens so far; ``turn``: 1 for the first."""

    episode: int
    tokens: list[int]
    reason: str
    length: int
    turn: int


class EpisodeHost(Protocol):
    table: np.ndarray  # the stop marker's automaton ([vocab, marker_length + 1], ``markers.marker_table``)

    def first(self, count: int) -> list[list[int]]:
        """Each of this process's ``count`` episodes' first observation (ids fed before the first
        draw; [] for none)."""

    def answer(self, ends: list[TurnEnd]) -> list[list[int] | None]:
        """Each ended turn's observation ids (at most ``observation_tokens``), or None: the episode ends."""


def _outputs(state: ep.EpisodeState) -> dict:
    """A state's outputs as they are, outside a program: ``ep.outputs`` constrains their sharding, which
    run eagerly is a program of its own per array (compiled after the warm-up, and on aot's compile-only
    devices not at all); the programs' output shardings put them in the rows' sharding already."""
    return {name: getattr(state, name) for name in ep.OUTPUTS}


def episode_sampler(sampler: Sampler, spec: EpisodeSpec) -> "EpisodeSampler":
    """``sampler``'s one ``EpisodeSampler`` for ``spec``: the warm-up, the rollouts and the evaluations
    share its jitted programs, so each compiles once."""
    made = sampler.__dict__.setdefault("_episode_samplers", {})
    if spec not in made:
        made[spec] = EpisodeSampler(sampler, spec)
    return made[spec]


class EpisodeSampler:
    """Episodes on ``sampler``'s mesh, with its weights' copy and its prefill (``module docstring``)."""

    def __init__(self, sampler: Sampler, spec: EpisodeSpec):
        self.sampler, self.spec = sampler, spec
        self.devices = d = sampler.devices
        state, out = self._shardings()
        rep = shd.replicated(sampler.mesh)
        self._start = jax.jit(ep.start, static_argnames=("n", "max_len", "slots", "kernel"), out_shardings=state)
        self._decode = jax.jit(functools.partial(ep.decode, sampler.cfg, devices=d), static_argnames=("kernel",),
                               donate_argnames=("state",), out_shardings=(state, rep))
        self._resume = jax.jit(functools.partial(ep.resume, devices=d), donate_argnames=("state",),
                               out_shardings=(state, rep))
        self._compact = jax.jit(functools.partial(ep.compact, devices=d), static_argnames=("rows",),
                                donate_argnames=("out",), out_shardings=(state, out))
        self._grow = jax.jit(ep.grow, static_argnames=("slots",), out_shardings=state)
        self._scatter = jax.jit(functools.partial(ep.scatter, devices=d), donate_argnames=("out",), out_shardings=out)
        self._tables: dict[int, jax.Array] = {}

    def _shardings(self):
        s = self.sampler
        decode_state, _, rep = s._state_shardings(ep.per_layer_cache(s.mesh.devices.flat[0].platform))
        row = lambda ndim: shd.logical_to_shardings(jax.sharding.PartitionSpec("act_batch", *[None] * (ndim - 1)),
                                                    s.mesh, s.rules)
        ndims = {"kv_mask": 2, "tokens": 2, "logprobs": 2, "kind": 2, "feed": 2}
        state = ep.EpisodeState(cache=decode_state.cache, cursor=rep,
                                **{f: row(ndims.get(f, 1)) for f in ep.ROW_FIELDS})
        return state, {name: getattr(state, name) for name in ep.OUTPUTS}

    def _settings(self, sampling: SamplingConfig):
        return (*self.sampler._traced_settings(sampling), np.int32(self.spec.turn_tokens))

    def _table(self, table: np.ndarray) -> jax.Array:
        want = self.spec.table_shape(self.sampler.cfg.vocab_size)
        if table.shape != want or table.dtype != self.spec.table_dtype:
            raise ValueError(f"the stop marker's table is {table.dtype} {table.shape}, the episodes' programs take "
                             f"{np.dtype(self.spec.table_dtype)} {want}")
        key = id(table)
        if key not in self._tables:
            self._tables = {key: shd.put(table, shd.replicated(self.sampler.mesh))}
        return self._tables[key]

    def generate(self, params, prompts: Sequence[Sequence[int]], n: int, key, sampling: SamplingConfig,
                 host: EpisodeHost, pad_to: int = 0) -> tuple[Rollout, np.ndarray]:
        """Every prompt's n episodes (this process's prompts, as ``Sampler.generate``). Returns the
        rollout (``Rollout.observation_mask`` set; ``truncated``: ended by the budget) and each
        episode's turn count."""
        return drain(self.generate_steps(params, prompts, n, key, sampling, host, pad_to))

    def generate_steps(self, params, prompts: Sequence[Sequence[int]], n: int, key, sampling: SamplingConfig,
                       host: EpisodeHost, pad_to: int = 0):
        """``generate`` as a generator that yields where the host would wait for the devices (after
        dispatching a decode loop or a resume, before reading its numbers), as
        ``Sampler.generate_steps``; returns what ``generate`` returns. The sampler's mesh and rules are
        in force during its turns alone (``sampler.in_context``), never across a yield."""
        return (yield from in_context(self._episode_loops(params, prompts, n, key, sampling, host, pad_to),
                                      lambda: shd.activate(self.sampler.mesh, self.sampler.rules)))

    def _episode_loops(self, params, prompts, n: int, key, sampling: SamplingConfig, host: EpisodeHost, pad_to: int):
        sampler, spec = self.sampler, self.spec
        batch = sampler.pad_prompts(prompts, sampling, pad_to)
        weights = sampler.sampling_params(params)
        temperature, top_p, eos, greedy, turn_tokens = self._settings(sampling)
        table = self._table(host.table)
        count, local = batch.num_prompts * n, batch.ids.shape[0] * n
        width = spec.observation_tokens
        feed, feed_len = np.zeros((local, width), np.int32), np.zeros(local, np.int32)
        for e, ids in enumerate(host.first(count)):
            self._check(ids, f"the first observation of episode {e}")
            feed[e, :len(ids)], feed_len[e] = ids, len(ids)
        r = sampling.max_response_len
        rows1, rows2 = shd.batch_sharding(sampler.mesh, 1), shd.batch_sharding(sampler.mesh, 2)
        global_episodes = (batch.global_rows or batch.ids.shape[0]) * n
        ends, kernel = sampling.phase_ends(), sampling.kernel_key
        turns, cut = np.zeros(local, np.int32), np.zeros(local, bool)
        ids = shd.put(batch.ids, rows2, batch.global_rows)
        mask = shd.put(batch.mask, rows2, batch.global_rows)
        cache, logits = sampler._prefill(weights, ids, mask)
        live = shd.put(np.arange(batch.ids.shape[0]) < batch.num_prompts, rows1, batch.global_rows)
        state = self._start(cache, logits, mask, live, shd.put(feed, rows2, global_episodes),
                            shd.put(feed_len, rows1, global_episodes), key, temperature, top_p, eos, table,
                            turn_tokens, n=n, max_len=r, slots=batch.ids.shape[1] + ends[0], kernel=kernel,
                            greedy=greedy)
        offset = int(dist.local_rows(state.rows)[0])  # this process's first global row
        phase, out, loops, ran, cursor = 0, None, [], 0, batch.ids.shape[1]
        while True:
            rows = state.status.shape[0] // self.devices
            compacts = sampling.length_aware and sampling.min_rows <= _half(rows) < rows
            before = cursor
            state, status = self._decode(weights, state, key, temperature, top_p, eos, table, turn_tokens,
                                         np.int32(_half(rows) if compacts else 0), kernel=kernel, greedy=greedy)
            yield
            cursor, busiest, waiting, playing = (int(v) for v in dist.to_host(status))
            slots = state.kv_mask.shape[1]
            ran += cursor - before
            loops.append((rows, slots, ran))
            if waiting or cursor >= slots:  # answer the waiting rows; realign the cache
                finish, feed, feed_len = self._answers(state, host, offset, turns, cut, r)
                state, status = self._resume(state, shd.put(finish, rows1, state.status.shape[0]),
                                             shd.put(feed, rows2, state.status.shape[0]),
                                             shd.put(feed_len, rows1, state.status.shape[0]))
                yield
                cursor, busiest, waiting, playing = (int(v) for v in dist.to_host(status))
            if playing == 0:
                break
            while rows > sampler._row_bucket(busiest, rows, sampling) and sampling.length_aware:
                rows = _half(rows)
                state, out = self._compact(state, out, rows=rows)
            if phase + 1 < len(ends) and slots - cursor < max(1, ends[phase] // 4):
                phase += 1
                state = self._grow(state, slots=batch.ids.shape[1] + ends[phase])
        final = _outputs(state) if out is None else self._scatter(out, ep.row_part(state))
        fetch = lambda x: dist.local_rows(x)[:count]
        kind = fetch(final["kind"])
        rollout = Rollout(
            prompt_ids=np.repeat(batch.ids[: batch.num_prompts], n, axis=0),
            prompt_mask=np.repeat(batch.mask[: batch.num_prompts], n, axis=0),
            response_ids=fetch(final["tokens"]), response_mask=(kind == ep.ACTION).astype(np.int32),
            logprobs=fetch(final["logprobs"]), lengths=fetch(final["length"]).astype(np.int32),
            truncated=cut[:count].copy(), group_ids=np.repeat(np.arange(batch.num_prompts, dtype=np.int32), n),
            decode_steps=ran, decode_loops=tuple((rows * self.devices, slots, step) for rows, slots, step in loops),
            observation_mask=(kind == ep.OBSERVATION).astype(np.int32))
        return rollout, turns[:count].copy()

    def _check(self, ids, what: str) -> None:
        if len(ids) > self.spec.observation_tokens:
            raise ValueError(f"{what} has {len(ids)} tokens, more than the observation cap "
                             f"({self.spec.observation_tokens})")

    def _answers(self, state: ep.EpisodeState, host: EpisodeHost, offset: int, turns: np.ndarray, cut: np.ndarray,
                 budget: int):
        """This process's answers to its waiting rows (``resume``'s finish, feed and feed_len, in
        the state's row order); ``turns`` and ``cut`` (per episode) updated."""
        get = {f: dist.local_rows(getattr(state, f)) for f in ("rows", "status", "reason", "length", "turn_start")}
        count = len(get["rows"])
        finish, feed_len = np.zeros(count, bool), np.zeros(count, np.int32)
        feed = np.zeros((count, self.spec.observation_tokens), np.int32)
        waiting = np.flatnonzero(get["status"] == ep.WAITING)
        if not len(waiting):
            return finish, feed, feed_len
        tokens = dist.local_rows(state.tokens)
        ends = []
        for k in waiting:
            e, length = int(get["rows"][k]) - offset, int(get["length"][k])
            turns[e] += 1
            ends.append(TurnEnd(e, tokens[k, int(get["turn_start"][k]):length].tolist(),
                                ep.REASONS[int(get["reason"][k])], length, int(turns[e])))
        replies = host.answer(ends)
        for k, end, reply in zip(waiting, ends, replies):
            if reply is not None:
                self._check(reply, f"the observation after turn {end.turn} of episode {end.episode}")
            if end.reason == "budget" or reply is not None and end.length + len(reply) >= budget:
                cut[end.episode] = True  # no room for the observation and a draw after it
                finish[k] = True
            elif reply is None:
                finish[k] = True
            else:
                feed[k, :len(reply)], feed_len[k] = reply, len(reply)
        return finish, feed, feed_len

    def schedule(self, params, prompts: int, longest: int, n: int, sampling: SamplingConfig,
                 key=None) -> list[compiles.Program]:
        """Every program a ``generate`` of ``prompts`` prompts (the longest ``longest`` tokens) x ``n``
        can run (``Sampler.schedule``'s conventions), on abstract arguments; nothing is allocated."""
        s = self.sampler
        div = self.devices
        b = batch_rows(prompts, sampling, div)
        p, r = sampling.width(longest), sampling.max_response_len
        rows2, rows1, rep = shd.batch_sharding(s.mesh, 2), shd.batch_sharding(s.mesh, 1), shd.replicated(s.mesh)
        spec = lambda shape, dtype, sharding: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        key = spec((), jax.eval_shape(lambda: jax.random.key(0)).dtype, rep) if key is None else key
        settings = tuple(jax.ShapeDtypeStruct(np.shape(v), v.dtype) for v in self._settings(sampling))
        temperature, top_p, eos_ids, greedy, turn_tokens = settings
        table = spec(self.spec.table_shape(s.cfg.vocab_size), self.spec.table_dtype, rep)
        width, ends, kernel = self.spec.observation_tokens, sampling.phase_ends(), sampling.kernel_key
        out: list[compiles.Program] = []

        def add(name, jitted, *args, **kwargs) -> compiles.Output:
            out.append(compiles.Program(name, jitted, args, kwargs))
            return compiles.Output(name)

        weights = params if s._cast is None else add(SAMPLING_WEIGHTS, s._cast, params)
        ids, live = spec((b, p), jnp.int32, rows2), spec((b,), jnp.bool_, rows1)
        prefill = add("prefill", s._prefill, weights, ids, ids)
        start = add("episode start", self._start, prefill.part(lambda o: o[0]), prefill.part(lambda o: o[1]), ids,
                    live, spec((b * n, width), jnp.int32, rows2), spec((b * n,), jnp.int32, rows1), key, temperature,
                    top_p, eos_ids, table, turn_tokens, n=n, max_len=r, slots=p + ends[0], kernel=kernel,
                    greedy=greedy)
        first = b * n // div
        buckets = [first] + ([1 << i for i in reversed(range((first - 1).bit_length())) if 1 << i >= sampling.min_rows]
                             if sampling.length_aware else [])
        full = start.part(_outputs)
        states = {(first, 0): start}
        for phase, end in enumerate(ends):
            for i, rows in enumerate(buckets):
                state = states.get((rows, phase))
                if state is None:
                    continue
                slots, count = p + end, rows * div
                loop = add(f"episode decode rows={rows} slots={slots}", self._decode, weights, state, key,
                           temperature, top_p, eos_ids, table, turn_tokens, jax.ShapeDtypeStruct((), jnp.int32),
                           kernel=kernel, greedy=greedy)
                resumed = add(f"episode resume rows={rows} slots={slots}", self._resume, loop.part(lambda o: o[0]),
                              spec((count,), jnp.bool_, rows1), spec((count, width), jnp.int32, rows2),
                              spec((count,), jnp.int32, rows1)).part(lambda o: o[0])
                if rows != first and phase == 0:
                    add(f"episode scatter rows={rows}", self._scatter, full, resumed.part(ep.row_part))
                if i + 1 < len(buckets):
                    states[(buckets[i + 1], phase)] = add(
                        f"episode compact rows={rows} slots={slots}", self._compact, resumed,
                        None if rows == first else full, rows=buckets[i + 1]).part(lambda o: o[0])
                if phase + 1 < len(ends):
                    states[(rows, phase + 1)] = add(f"episode grow rows={rows} slots={slots}", self._grow, resumed,
                                                    slots=p + ends[phase + 1])
        return out

    def programs(self, params, prompts: int, longest: int, n: int, sampling: SamplingConfig, compile,
                 key=None) -> None:
        """``schedule``'s programs, each to ``compile(name, jitted, *args, **kwargs)`` in turn (``aot``)."""
        with shd.activate(self.sampler.mesh, self.sampler.rules):
            compiles.run_in_order(self.schedule(params, prompts, longest, n, sampling, key), compile)
