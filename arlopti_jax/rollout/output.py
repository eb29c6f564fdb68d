"""What the sampler returns: host numpy arrays, one row per response."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Rollout:
    """N = num_prompts * n responses, grouped: rows [i*n, (i+1)*n) answer prompt i.

    prompt_ids     [N, P] int32  left-padded prompt (P is the bucketed prompt length)
    prompt_mask    [N, P] int32  1 on prompt tokens
    response_ids   [N, R] int32  right-padded response; pad_id after the end (a tool episode's:
                                 the drawn and the observation tokens in order)
    response_mask  [N, R] int32  1 on generated tokens, the EOS token included: the policy's own
                                 (a tool episode's action mask, 0 on its observations)
    logprobs       [N, R] float32 log_softmax(logits / temperature) of each sampled
                                  token under the full distribution (pi_old); 0 on padding
    lengths        [N] int32     response_mask.sum(-1) (+ observation_mask.sum(-1))
    truncated      [N] bool      reached R tokens without an EOS (or a stop string)
    group_ids      [N] int32     index of the prompt each row answers
    decode_steps   int           response positions the decode loop produced (< R when
                                 every sample finished early)
    decode_loops   tuple         (rows of the global batch, cache slots, step reached) of each
                                 decode loop run, the first from step 0 (the prefill's token)
    text_cut       [N] int32 or None  characters to drop from the end of each response's decoded
                                 text: the stop string that ended it (unless kept) and what its
                                 last token decodes to after it (``stop.apply_stops``); None
                                 without stop strings
    observation_mask [N, R] int32 or None  a tool episode's observation tokens (given by the host,
                                 not drawn: ``episodes.py``); None for single-turn responses
    """

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    truncated: np.ndarray
    group_ids: np.ndarray
    decode_steps: int
    decode_loops: tuple = ()
    text_cut: np.ndarray | None = None
    observation_mask: np.ndarray | None = None

    @property
    def decode_row_steps(self) -> int:
        """Row x step slots the sampler ran (padding and finished rows included): its cost,
        against ``lengths.sum()`` real tokens."""
        steps = [0] + [step for _, _, step in self.decode_loops]
        return sum(rows * (steps[i + 1] - steps[i]) for i, (rows, _, _) in enumerate(self.decode_loops))

    @property
    def decode_attended_keys(self) -> int:
        """Cache slots read over all row steps (each step attends over its loop's whole cache)."""
        steps = [0] + [step for _, _, step in self.decode_loops]
        return sum(rows * slots * (steps[i + 1] - steps[i]) for i, (rows, slots, _) in enumerate(self.decode_loops))

    def responses(self) -> list[list[int]]:
        """Each response's token ids without padding (for decoding to text)."""
        return [row[: int(n)].tolist() for row, n in zip(self.response_ids, self.lengths)]

    def train_batch(self) -> dict[str, np.ndarray]:
        """The trainer's sequence batch, [N, P + R], every array aligned with input_ids.

        input_ids       concat(left-padded prompt, right-padded response)
        attention_mask  concat(prompt_mask, response_mask (+ observation_mask))
        response_mask   zeros over the prompt part (and a tool episode's observations: the
                        action mask, which every consumer of the update reads)
        old_logprobs    old_logprobs[:, t] = log pi_old(input_ids[:, t] | input_ids[:, :t]),
                        the convention of ``arlopti_jax.models.token_logprobs``; zeros over
                        the prompt part and padding
        """
        zeros_p = np.zeros_like(self.prompt_mask)
        attended = self.response_mask if self.observation_mask is None else self.response_mask + self.observation_mask
        return {
            "input_ids": np.concatenate([self.prompt_ids, self.response_ids], axis=1),
            "attention_mask": np.concatenate([self.prompt_mask, attended], axis=1),
            "response_mask": np.concatenate([zeros_p, self.response_mask], axis=1),
            "old_logprobs": np.concatenate([zeros_p.astype(np.float32), self.logprobs], axis=1),
        }
