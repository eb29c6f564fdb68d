"""Sampling configuration, shape buckets and the per-step token sampler.

The log-prob recorded for a sampled token is always taken from the FULL
temperature-scaled distribution, ``log_softmax(logits / temperature)``, before any
top-k / top-p truncation: that is ``pi_old`` in docs/paper.md when sampler and trainer share
weights, and it is what ``arlopti_jax.models.token_logprobs(..., temperature=T)``
recomputes. Greedy decoding records the same quantity at the configured temperature
(the default 1.0 gives the model's plain log-probs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

from arlopti_jax.runtime import sharding as shd

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How responses are drawn.

    max_response_len  response tokens per sample (R), the EOS token included.
    temperature       logits are divided by it before sampling (and for the log-probs).
    top_p             nucleus sampling: keep the smallest set of most likely tokens whose
                      probability reaches top_p (1.0 = off).
    top_k             keep the k most likely tokens (0 = off). Applied before top_p.
    greedy            argmax decoding (top_p / top_k are then irrelevant); the recorded
                      log-probs are still log_softmax(logits / temperature). Data, not part of
                      ``kernel_key``: greedy and sampled decoding run the same compiled programs.
    eos_ids           a sample finishes at the first of these tokens (kept, mask 1);
                      () never stops early (fixed-length generation, for benchmarks).
    pad_id            written after a sample finishes (mask 0) and used for prompt padding.
    prompt_bucket     prompt length is padded to min(next power of two, next multiple
                      of prompt_bucket): one compiled shape per bucket, not per batch.
    prompt_width      every batch is padded as if its longest prompt had at least this many
                      tokens (a run passes its data's longest prompt: one prompt width, one
                      set of programs for the whole run, whatever each batch holds); 0: each
                      batch's own.
    batch_bucket      the number of prompts is padded likewise (then to a multiple of
                      the mesh's data x fsdp size); padding rows are dropped from the output.
    length_aware      decode cost follows the responses' real lengths: phases whose KV cache
                      grows (``phase_ends``), and finished rows dropped from the batch (see
                      ``arlopti_jax.rollout.sampler``). False: one phase over all P + R cache
                      slots and every row to the end, the reference it is tested against
                      (same tokens and log-probs).
    phase_tokens      response slots of the first phase (length_aware); each next phase
                      doubles them, up to max_response_len. 0: max_response_len / 4, rounded
                      up to a power of two (three phases: each phase is one more compiled
                      decode loop per row count; python -m arlopti_jax.aot lists them).
    min_rows          rows per device below which the batch is not compacted further
                      (length_aware): on accelerators a decode step over fewer rows costs
                      about the same, and every row count is one more compiled decode loop per phase.
    """

    max_response_len: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    prompt_bucket: int = 64
    prompt_width: int = 0
    batch_bucket: int = 8
    length_aware: bool = True
    phase_tokens: int = 0
    min_rows: int = 16

    def __post_init__(self):
        object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))
        checks = {
            "max_response_len": self.max_response_len >= 1,
            "temperature": self.temperature > 0,
            "top_p": 0 < self.top_p <= 1,
            "top_k": self.top_k >= 0,
            "pad_id": self.pad_id >= 0,
            "prompt_bucket": self.prompt_bucket >= 1,
            "prompt_width": self.prompt_width >= 0,
            "batch_bucket": self.batch_bucket >= 1,
            "phase_tokens": self.phase_tokens >= 0,
            "min_rows": self.min_rows >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"SamplingConfig.{name}={getattr(self, name)!r} is out of range")
        if any(e < 0 for e in self.eos_ids):
            raise ValueError(f"SamplingConfig.eos_ids={self.eos_ids!r}: token ids must be >= 0")

    @property
    def kernel_key(self) -> tuple:
        """The settings that change the compiled program (the rest, ``greedy`` included, are traced
        values: greedy evaluation and sampling share the sampler's programs)."""
        return (self.top_k, self.top_p < 1.0, self.pad_id)

    def width(self, longest: int) -> int:
        """The padded prompt width of a batch whose longest prompt has ``longest`` tokens."""
        return bucket(max(longest, self.prompt_width), self.prompt_bucket)

    def phase_ends(self) -> tuple[int, ...]:
        """Response slots of each decode phase's cache: phase_tokens, doubling while the
        cache would still grow by half or more, then max_response_len (one phase, all R
        slots, when not length_aware)."""
        r = self.max_response_len
        end = (self.phase_tokens or 1 << max(0, (r - 1) // 4).bit_length()) if self.length_aware else r
        ends = []
        while 2 * (r - end) >= end:
            ends.append(end)
            end *= 2
        return tuple(ends) + (r,)


def bucket(n: int, step: int) -> int:
    """min(next power of two >= n, next multiple of step >= n): few shapes at every scale."""
    pow2 = 1 << max(0, (n - 1).bit_length())
    return min(pow2, -(-n // step) * step)


def threefry2x32(k1: Array, k2: Array, x1: Array, x2: Array) -> tuple[Array, Array]:
    """Threefry-2x32, 20 rounds (Salmon et al., SC 2011), as straight-line elementwise operations:
    the bits of ``threefry2x32_p``, whose CPU lowering is a loop of 5 passes over the whole array,
    each read and written back; this one XLA:CPU fuses into the pass that consumes it."""
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for i in range(5):
        for r in ((13, 15, 26, 6), (17, 29, 16, 24))[i % 2]:
            x1 = x1 + x2
            x2 = x1 ^ ((x2 << np.uint32(r)) | (x2 >> np.uint32(32 - r)))
        x1, x2 = x1 + ks[(i + 1) % 3], x2 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x1, x2


def gumbel_noise(key: Array, step, rows: Array, width: int) -> Array:
    """Gumbel(0, 1) noise [N, width] for response position ``step`` of the rows whose global
    indices are ``rows`` [N]: entry (r, v) hashes the counter (r, v) with threefry2x32 under
    a key drawn from ``fold_in(key, step)``. A row's noise is a function of (key, step, its
    global index) only, so compacting, padding or re-sharding the batch never changes a
    sample. One hash per entry, the same work as ``jax.random.gumbel`` on the whole batch.
    ``step`` may be an [N] array, each row at its own position (a tool episode's rows, which
    the observations put at different positions: ``episode_programs``); a row's noise is then
    the same as with the scalar ``step`` equal to its entry.
    """
    shape = (rows.shape[0], width)
    if jnp.ndim(step):  # a key per row: [N, 1] halves, broadcast over the row's entries
        bits = jax.vmap(lambda s: jax.random.bits(jax.random.fold_in(key, s), (2,), jnp.uint32))(step)
        k1, k2 = (jnp.broadcast_to(bits[:, i:i + 1], shape) for i in (0, 1))
    else:
        k1, k2 = jax.random.bits(jax.random.fold_in(key, step), (2,), jnp.uint32)
    hi = jnp.broadcast_to(rows.astype(jnp.uint32)[:, None], shape)
    lo = jax.lax.broadcasted_iota(jnp.uint32, shape, 1)
    b1, b2 = (threefry2x32 if shd.platform() == "cpu" else threefry2x32_p.bind)(k1, k2, hi, lo)
    # 23 random bits -> a uniform in the open interval (0, 1), exactly representable
    u = (((b1 ^ b2) >> 9).astype(jnp.float32) + 0.5) * (2.0 ** -23)
    return -jnp.log(-jnp.log(u))


def first_argmax(x: Array) -> tuple[Array, Array]:
    """(argmax over the last axis (the first maximum), int32; the maximum). The same index as
    ``jnp.argmax``. On a GPU or TPU one value-and-index reduction, so ``x`` is read once and an
    elementwise producer (the Gumbel noise added to the logits) fuses into it; on the CPU a max
    then a min over indices, which avoids XLA:CPU's slow value-and-index reduction (3x faster on
    a [32, 4096] batch)."""
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    if shd.platform() == "cpu":
        top = jnp.max(x, axis=-1, keepdims=True)
        return jnp.min(jnp.where(x == top, index, x.shape[-1]), axis=-1), top[..., 0]

    def pick(a, b):  # the larger value; on a tie the lower index
        a_wins = (a[0] > b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))
        return jnp.where(a_wins, a[0], b[0]), jnp.where(a_wins, a[1], b[1])

    top, first = jax.lax.reduce((x, index), (jnp.array(-jnp.inf, x.dtype), jnp.int32(x.shape[-1])), pick,
                                (x.ndim - 1,))
    return first, top


def _ordered(x: Array) -> Array:
    """uint32 keys in the order of float32 ``x`` (larger float, larger key)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def nucleus_floor(scaled: Array, lse: Array, top_p: Array, digit_bits: int = 0) -> Array:
    """The nucleus of each row of ``scaled`` [N, V] (log-probs up to ``lse`` [N]) without sorting:
    the uint32 key (``_ordered``) T of its least likely member, so that the nucleus is the tokens
    whose key is >= T. A token is in the nucleus when the tokens strictly more likely than it hold
    less than ``top_p`` of the mass; that set is {key >= T} for the largest T whose mass
    g(T) = sum(p[key >= T]) reaches top_p (tied tokens are all in or all out). T is found digit by
    digit from the top, ``digit_bits`` bits a pass: each pass reads the row once and sums its mass
    above each of the next digit's 2^digit_bits - 1 settings in one reduction, and g never grows
    with T (sums of nested sets in one order round monotonically), so the count of settings that
    reach top_p is the digit. ``digit_bits`` 0: 1 on the CPU, whose time is the comparisons (32
    passes of one: 40 ms at [64, 49152], against 343 ms for 8 passes of 15 and 1,019 ms for the
    sort), 4 elsewhere, where it is the passes' reads (8 instead of 32). On an H200 the sort
    (CUB's segmented radix sort) took 1.18 ms of a 1.5B decode step at 64 rows
    (docs/measurements/gpu_2026-11-28, docs/measurements/cpu_2026-11-28_top_p)."""
    digit_bits = digit_bits or (1 if shd.platform() == "cpu" else 4)
    key = _ordered(scaled)
    p = jnp.exp(scaled - lse[:, None])
    floor = jnp.zeros(scaled.shape[:1], jnp.uint32)
    digits = jnp.arange(1, 1 << digit_bits, dtype=jnp.uint32)
    for shift in range(32 - digit_bits, -1, -digit_bits):
        settings = floor[:, None] | (digits << shift)[None, :]  # [N, 2^b - 1]
        mass = jnp.sum(jnp.where(key[:, :, None] >= settings[:, None, :], p[:, :, None], 0.0), axis=1)
        floor = floor | (jnp.sum(mass >= top_p, axis=-1).astype(jnp.uint32) << shift)
    return floor


def sample_tokens(logits: Array, key: Array, step, rows: Array, temperature: Array, top_p: Array, *,
                  top_k: int, use_top_p: bool, greedy: bool | Array,
                  forced: Array | None = None) -> tuple[Array, Array]:
    """Draw one token per row from float32 ``logits`` [N, V] at response position ``step``
    (Gumbel-max with ``gumbel_noise``: rows are the rows' global indices [N]).

    ``forced`` [N] int32, when given, replaces the draw where it is >= 0 (a forced EOS).
    Returns (tokens [N] int32, log_softmax(logits / temperature)[token] [N] float32).
    ``temperature`` and ``top_p`` are traced scalars; ``greedy`` is a Python bool (it then chooses
    the program: argmax only, or the draw only) or a traced bool scalar (one program serves both:
    the sampler's, so greedy evaluation and sampling compile once). On a GPU or TPU the traced flag
    selects the argmax's input elementwise (the logits, or the noisy scaled logits) inside the one
    reduction; with top_k it selects between the argmax of the logits and the truncated draw (the
    shift stays the top-k's maximum of the scaled logits, the same value). On the CPU it
    chooses between the two Python flags' programs with a conditional. The tokens are the
    Python flag's program's; in the sampler's programs the log-probs are too, bit for bit
    (tests/rollout/test_rollout.py; XLA may round ``logits / T`` differently in two separately
    compiled small programs, by an ulp of the largest scaled logit).

    The log-softmax's shift is the maximum the draw has found already, so the logits are read
    twice in all (the draw's maximum, then its index beside the normaliser's sum), not six times:
    in a decode step at 1.5B these [N, 151936] float32 passes were 4% of the bytes moved. With
    Gumbel noise that maximum lies within [-2.8, 16.7] of the scaled logits' own (the noise of a
    23-bit uniform), so no exp overflows and the largest term is at least exp(-16.7).

    top_k (with or without top_p): ``lax.top_k``, the draw over the k sorted values, the noise
    indexed by rank; top_p cuts the sorted values where the mass before them reaches it. top_p
    alone: the nucleus is found without a sort (``nucleus_floor``), and the draw is the plain one
    with the tokens outside it masked out, the noise indexed by token id.
    """
    if not isinstance(greedy, bool) and shd.platform() == "cpu":
        # XLA:CPU computes both operands of a select, so greedy evaluation would pay for the draw's
        # noise (3-6x the argmax's time at [64, 49152]); a conditional runs only the greedy program
        # when the flag is set (the other branch is the traced program itself: the same bits).
        def draw(flag):
            return lambda *a: _draw(*a, top_k=top_k, use_top_p=use_top_p, greedy=flag, forced=forced)
        return jax.lax.cond(greedy, draw(True), draw(greedy), logits, key, step, rows, temperature, top_p)
    return _draw(logits, key, step, rows, temperature, top_p, top_k=top_k, use_top_p=use_top_p, greedy=greedy,
                 forced=forced)


def _draw(logits: Array, key: Array, step, rows: Array, temperature: Array, top_p: Array, *,
          top_k: int, use_top_p: bool, greedy: bool | Array, forced: Array | None) -> tuple[Array, Array]:
    """``sample_tokens``'s draw, a traced ``greedy`` selecting elementwise."""
    traced = not isinstance(greedy, bool)
    scaled = logits.astype(jnp.float32) / temperature
    lse = None
    if greedy is True:
        tokens, top = first_argmax(logits)
        shift = top.astype(jnp.float32) / temperature  # the maximum of ``scaled`` (division keeps the order)
    elif use_top_p and not top_k:  # the nucleus by its floor, no sort; noise by token id, as without top_p
        lse = jax.nn.logsumexp(scaled, axis=-1)
        kept = _ordered(scaled) >= nucleus_floor(scaled, lse, top_p)[:, None]
        noisy = jnp.where(kept, scaled + gumbel_noise(key, step, rows, scaled.shape[-1]), -jnp.inf)
        tokens, _ = first_argmax(jnp.where(greedy, logits.astype(jnp.float32), noisy) if traced else noisy)
    elif top_k:
        vals, idx = jax.lax.top_k(scaled, top_k)  # sorted, most likely first
        shift = vals[:, 0]
        if use_top_p:
            probs = jax.nn.softmax(vals, axis=-1)
            mass_before = jnp.cumsum(probs, axis=-1) - probs
            vals = jnp.where(mass_before < top_p, vals, -jnp.inf)  # the first is always kept
        choice, _ = first_argmax(vals + gumbel_noise(key, step, rows, top_k))
        tokens = jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0]
        if traced:  # the greedy program's token where the flag is set; the shift is the same maximum
            tokens = jnp.where(greedy, first_argmax(logits)[0], tokens)
    elif traced:  # one reduction: the argmax of the logits (greedy) or of the noisy scaled logits
        noisy = scaled + gumbel_noise(key, step, rows, scaled.shape[-1])
        tokens, top = first_argmax(jnp.where(greedy, logits.astype(jnp.float32), noisy))
        shift = jnp.where(greedy, top / temperature, top)
    else:
        tokens, shift = first_argmax(scaled + gumbel_noise(key, step, rows, scaled.shape[-1]))
    tokens = tokens.astype(jnp.int32)
    if forced is not None:
        tokens = jnp.where(forced >= 0, forced, tokens)
    if lse is None:
        lse = shift + jnp.log(jnp.sum(jnp.exp(scaled - shift[:, None]), axis=-1))
    picked = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0]
    return tokens, picked - lse
