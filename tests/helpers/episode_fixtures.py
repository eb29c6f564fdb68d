"""A scripted environment for the tool-episode tests: any model plays it, tool call or not.

``ScriptedEnv`` answers every turn with an observation in multi-byte text (accents, a dash, a
check mark, CJK) naming the turn and the action's length, until its ``turns``-th turn (default 3;
a list: ``turns[len(first action) % len(turns)]``, by the policy's first draws, so the episodes of
one prompt end at different turns), which ends the episode; the reward part ``answer`` is 1 when
the episode's actions hold an even number of characters in all, else 0, and ``length`` is -0.01
per character: rewards that vary within a group, from the text alone (deterministic, so a resumed
run replays them). Each instance keeps what it saw (``actions``) and said (``observations``)."""

from arlopti_jax.tasks.envs import Step

OBSERVATION = "turn {turn}: ça fait {n} caractères – ✓ π 漢字"


class ScriptedEnv:
    stop_strings = ("</call>",)
    tools: list = []
    instructions = None

    def __init__(self, turns: int | list[int] = 3, fail_on: str = ""):
        self.turns, self.fail_on = turns, fail_on
        self.actions, self.observations = [], []

    def reset(self, problem):
        self.problem = problem
        return None

    def step(self, action):
        self.actions.append(action)
        if isinstance(self.turns, list):
            self.turns = self.turns[len(action) % len(self.turns)]
        if self.fail_on and self.fail_on in action:
            raise RuntimeError("scripted failure")
        info = {"tool_calls": 1, "tool_seconds": 0.001}
        if len(self.actions) >= self.turns:
            chars = sum(len(a) for a in self.actions)
            return Step(None, {"answer": float(chars % 2 == 0), "length": -0.01 * chars}, True, {})
        self.observations.append(OBSERVATION.format(turn=len(self.actions), n=len(action)))
        return Step(self.observations[-1], {}, False, info)


class ScriptedHost:
    """A host for ``rollout.episodes.EpisodeSampler`` (no environment): answers turn k of episode e
    with ``k + e % 3`` observation ids, at most 5 (60 + k, then 70 + e % 20), until the episode's
    ``turns(e)``-th turn, which ends it; with ``first``, odd episodes get a first observation. ``e``
    counts from ``offset`` (a process's first episode of the global batch), so every process answers
    a global episode alike. Records every turn end and reply, by global episode."""

    def __init__(self, table, turns, first: bool = False, offset: int = 0):
        self.table, self.turns, self.with_first, self.offset = table, turns, first, offset
        self.ends, self.replies, self.firsts = [], {}, []

    def first(self, count):
        self.firsts = [[80 + e % 5] * (e % 2) if self.with_first else [] for e in range(self.offset,
                                                                                       self.offset + count)]
        return self.firsts

    def answer(self, ends):
        out = []
        for end in ends:
            e = self.offset + end.episode
            self.ends.append(end)
            more = min(end.turn + e % 3 - 1, 4)
            reply = None if end.turn >= self.turns(e) else [60 + end.turn] + [70 + e % 20] * more
            self.replies[(e, end.turn)] = reply
            out.append(reply)
        return out
