"""Tool episodes in the sampler (``rollout/episodes.py``): each turn ends where it must (the stop
marker in any tokenization, an EOS, the turn cap, the budget), the trained sequence is exactly the
drawn ids and the host's observation ids in order, the drawn tokens are the model's draws at their
own positions and their log-probs a teacher-forced pass's over the same ids, on one device and
eight, dense or length-aware; the schedule compiled ahead is every program a run of any number of
turns meets; an episode of one turn is the single-turn sampler's response."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlopti_jax.models import load_pretrained
from arlopti_jax.models import logits as _logits
from arlopti_jax.models import token_logprobs as _token_logprobs
from arlopti_jax.rollout import Sampler, SamplingConfig, sample_tokens
from arlopti_jax.rollout.episodes import EpisodeSpec, episode_sampler
from arlopti_jax.rollout.markers import advance, marker_table
from arlopti_jax.runtime import compiles
from arlopti_jax.runtime import sharding as shd
from episode_fixtures import ScriptedHost
from hf_fixtures import VOCAB, write_hf_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42, 43]]
N, R, EOS = 3, 40, 2
MARKER = "aba"
# every token's text, from a small alphabet so that the marker turns up, spelled many ways
TEXTS = ["" if i < 3 else "abc"[i % 3] + ("" if i % 4 else "abc"[i // 3 % 3]) for i in range(VOCAB)]
SPEC = EpisodeSpec(turn_tokens=7, observation_tokens=5, marker_length=len(MARKER))
token_logprobs = jax.jit(_token_logprobs, static_argnums=0, static_argnames="temperature")
full_logits = jax.jit(_logits, static_argnums=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("episodes") / "ckpt", kind="qwen2", tied=False)


def policy_on(folder, devices: int):
    mesh = shd.make_mesh({"fsdp": devices}, devices=jax.devices()[:devices])
    cfg, params = load_pretrained(folder, mesh=mesh)
    return cfg, params, Sampler(cfg, mesh)


def host_of(turns, first: bool = False, marker: str = MARKER) -> ScriptedHost:
    return ScriptedHost(marker_table(TEXTS, marker, VOCAB), lambda e: turns[e], first)


def text_of(ids):
    return "".join(TEXTS[i] for i in ids)


def generate(folder, devices, turns, *, length_aware=True, first=False, seed=0, **kw):
    cfg, params, sampler = policy_on(folder, devices)
    host = host_of(turns, first)
    sampling = SamplingConfig(max_response_len=R, eos_ids=(EOS,), length_aware=length_aware, phase_tokens=8,
                              min_rows=1, temperature=kw.pop("temperature", 1.3), **kw)
    rollout, counted = episode_sampler(sampler, SPEC).generate(params, PROMPTS, N, jax.random.key(seed), sampling,
                                                               host)
    return cfg, params, rollout, counted, host


TURNS = [1 + (e * 7) % 5 for e in range(len(PROMPTS) * N)]  # 1 to 5 turns


@pytest.fixture(scope="module")
def reference(folder):
    return generate(folder, 1, TURNS, first=True)


def test_turns_end_where_they_must_and_the_sequence_is_the_drawn_and_the_given_ids(reference):
    cfg, params, rollout, counted, host = reference
    by_episode = {}
    for end in host.ends:
        by_episode.setdefault(end.episode, []).append(end)
    reasons = set()
    for e in range(len(TURNS)):
        ends = by_episode[e]
        assert [end.turn for end in ends] == list(range(1, len(ends) + 1)) and counted[e] == len(ends)
        sequence, kinds = list(host.firsts[e]), [2] * len(host.firsts[e])
        for end in ends:
            reasons.add(end.reason)
            ids = end.tokens
            assert 1 <= len(ids) <= SPEC.turn_tokens
            drawn = text_of(ids)
            early = [i for i in range(len(ids) - 1) if ids[i] == EOS or MARKER in text_of(ids[:i + 1])]
            assert not early, (e, end)  # nothing ended the turn before its last token
            if end.reason == "eos":
                assert ids[-1] == EOS
            elif end.reason == "marker":
                assert MARKER in drawn and ids[-1] != EOS
            elif end.reason == "turn_cap":
                assert len(ids) == SPEC.turn_tokens and MARKER not in drawn
            else:
                assert end.reason == "budget" and end.length == R
            sequence += ids
            kinds += [1] * len(ids)
            reply = host.replies[(e, end.turn)]
            if reply is not None and end.length + len(reply) < R:
                sequence += reply
                kinds += [2] * len(reply)
        length = int(rollout.lengths[e])
        assert rollout.response_ids[e, :length].tolist() == sequence  # token in, token out
        kind = rollout.response_mask[e] + 2 * rollout.observation_mask[e]
        assert kind[:length].tolist() == kinds and not kind[length:].any()
        assert rollout.truncated[e] == (ends[-1].reason == "budget" or host.replies[(e, ends[-1].turn)] is not None)
    assert reasons >= {"marker", "turn_cap"}, reasons
    assert (rollout.observation_mask.sum(1) > 0).sum() > len(TURNS) // 2


def test_the_drawn_tokens_are_the_models_draws_and_their_logprobs_a_teacher_forced_pass(reference):
    cfg, params, rollout, _, _ = reference
    batch = rollout.train_batch()
    ids, attn, action = batch["input_ids"], batch["attention_mask"], batch["response_mask"].astype(bool)
    logp = np.asarray(token_logprobs(cfg, params, ids, attn, temperature=1.3)[0])
    np.testing.assert_allclose(batch["old_logprobs"][action], logp[action], atol=2e-5)
    assert np.all(batch["old_logprobs"][~action] == 0)
    logits = np.asarray(full_logits(cfg, params, ids, attn))
    p = rollout.prompt_ids.shape[1]
    for row in range(len(ids)):
        for t in np.flatnonzero(rollout.response_mask[row]):  # the draw at the row's own position t
            tok, _ = sample_tokens(jnp.asarray(logits[row:row + 1, p + t - 1]), jax.random.key(0), int(t),
                                   jnp.array([row], jnp.int32), jnp.float32(1.3), jnp.float32(1.0), top_k=0,
                                   use_top_p=False, greedy=False)
            assert int(tok[0]) == rollout.response_ids[row, t], (row, t)


@pytest.mark.parametrize("devices,length_aware", [(1, False), (8, True)], ids=["dense", "8-devices"])
def test_every_layout_gives_the_same_episodes(folder, reference, devices, length_aware):
    _, _, want, want_turns, _ = reference
    _, _, got, turns, _ = generate(folder, devices, TURNS, length_aware=length_aware, first=True)
    for name in ("response_ids", "response_mask", "observation_mask", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=2e-5)
    np.testing.assert_array_equal(turns, want_turns)
    if length_aware:
        assert len({rows for rows, _, _ in got.decode_loops}) > 1  # rows left the batch


def test_an_episode_of_one_turn_is_the_single_turn_response(folder):
    """No stop marker in the text, turns as long as the budget, and an environment that ends every
    episode at its first turn: the single-turn sampler's tokens and log-probs."""
    cfg, params, sampler = policy_on(folder, 1)
    host = host_of([1] * len(PROMPTS) * N, marker="zzz")
    sampling = SamplingConfig(max_response_len=R, eos_ids=(EOS, 7), phase_tokens=8, min_rows=1, temperature=1.1)
    key = jax.random.key(3)
    got, _ = episode_sampler(sampler, EpisodeSpec(R, 4, 3)).generate(params, PROMPTS, N, key, sampling, host)
    want = sampler.generate(params, PROMPTS, N, key, sampling)
    np.testing.assert_array_equal(got.response_ids, want.response_ids)
    np.testing.assert_array_equal(got.response_mask, want.response_mask)
    np.testing.assert_array_equal(got.truncated, want.truncated)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-6)
    assert not got.observation_mask.any()


def test_the_schedule_compiled_ahead_is_every_program_of_any_number_of_turns(folder):
    cfg, params, sampler = policy_on(folder, 1)
    episodes = episode_sampler(sampler, SPEC)
    sampling = SamplingConfig(max_response_len=R, eos_ids=(EOS,), phase_tokens=8, min_rows=4, temperature=0.9)
    keys = [jax.random.key(seed) for seed in range(3)]
    schedule = episodes.schedule(compiles.abstract(params), len(PROMPTS), max(map(len, PROMPTS)), N, sampling,
                                 key=compiles.abstract(keys[0]))
    log = compiles.watch()
    compiles.compile_all(schedule, context=lambda: shd.activate(sampler.mesh, sampler.rules))
    mark = log.programs
    loops = set()
    for key, turns in zip(keys, ([1] * 12, TURNS, [9] * 12)):  # no tool call, 1-5 turns, up to the budget
        rollout, _ = episodes.generate(params, PROMPTS, N, key, sampling, host_of(turns, first=True))
        loops.update(rollout.decode_loops)
    assert not log.since(mark), [(r.name, r.shapes[:160]) for r in log.since(mark)]
    assert len({rows for rows, _, _ in loops}) > 2 and len({slots for _, slots, _ in loops}) > 2


def test_the_marker_automaton_follows_the_text_in_any_tokenization():
    """The state after each token equals the longest marker prefix that ends the text so far (the
    marker once it has occurred), for random token strings over the marker's alphabet and beyond."""
    rng = np.random.default_rng(0)
    for marker in ("aba", "</tool_call>", "aaab", "<calc>"):
        pieces = sorted({marker[i:j] for i in range(len(marker)) for j in range(i + 1, len(marker) + 1)}
                        | {"x", "a\n", ">\n", "é", ""})
        table = marker_table(pieces, marker, len(pieces) + 3)
        np.testing.assert_array_equal(table[len(pieces):], np.broadcast_to(np.arange(len(marker) + 1),
                                                                           (3, len(marker) + 1)))  # no text: no move
        for _ in range(300):
            ids = rng.integers(0, len(pieces), rng.integers(1, 12))
            state, text = 0, ""
            for i in ids:
                state = int(table[i, state])
                text += pieces[i]
                ends = max(k for k in range(len(marker)) if text.endswith(marker[:k]))
                want = len(marker) if marker in text else ends
                assert state == want == advance(marker, 0, text), (marker, [pieces[i] for i in ids])
    with pytest.raises(ValueError, match="printable ASCII"):
        marker_table(pieces, "é>", 8)


@pytest.mark.slow  # two processes: minutes on 2 cores; CI runs the slow tests
@pytest.mark.xdist_group("two_processes")  # never beside another two-process test: 4 processes on 2 cores
def test_two_processes_equal_one(tmp_path):
    """2 processes x 4 devices (launch/local.sh): each process's host answers its own rows, the loop
    leaving, answering, compacting and growing on the global counts; the episodes equal one
    process's 8 devices, token for token."""
    import numpy as np

    import multiprocess_episodes as mp
    from two_processes import launch_two, logs_of

    proc = launch_two([f"--out={tmp_path}"], tmp_path / "logs", 400, module="multiprocess_episodes")
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{logs_of(tmp_path / 'logs')}"
    parts = [np.load(tmp_path / f"process_{i}.npz") for i in (0, 1)]
    want, turns = mp.episodes(shd.make_mesh({"fsdp": 8}))
    assert [int(p["start"]) for p in parts] == [0, 4]
    for name in ("response_ids", "response_mask", "observation_mask", "lengths"):
        np.testing.assert_array_equal(np.concatenate([p[name] for p in parts]), getattr(want, name), err_msg=name)
    np.testing.assert_allclose(np.concatenate([p["logprobs"] for p in parts]), want.logprobs, atol=1e-5)
    np.testing.assert_array_equal(np.concatenate([p["turns"] for p in parts]), turns)
    assert want.observation_mask.any() and turns.max() > 1
