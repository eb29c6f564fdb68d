"""Stop strings (``rollout.stop``): what matching them at the host costs, and what stopping rows
earlier in the decode loop would save.

    python bench/stop_strings.py [--rows 256 --gen-len 256 --stop-share 0.5]

The sampler decodes on to EOS or max_response_length and the host trims each response once
(``rollout/stop.py``). Two other places could stop a row: on device, at the token completing the
stop string (an incremental detokenizer inside the loop), or at the length-aware schedule's host
reads (between decode loops, where the host already reads two numbers). This measures, on a small
random model whose responses end at chosen lengths (``stop_at``; log-normal around gen-len / 4, 5%
running to the end):

1. the host's trimming (``apply_stops``) of the rollout's responses, against the batch decode the
   rewards do anyway, with a byte-level BPE tokenizer (the embedded default's kind) and a share
   ``--stop-share`` of the responses holding ``</answer>`` at a uniform point of their length,
   rambling on after it to their EOS (the worst case: a model that stops right after its stop
   string gains nothing from any of this);
2. the decode loop's cost, as row x step slots (``Rollout.decode_row_steps``) and wall time: as
   today (rows end at EOS), stopped on device (rows end at the stop string's token: run with
   ``stop_at`` at those lengths, the ideal), and stopped at the host reads (simulated: after each
   decode loop, rows whose stop string is behind the step count as finished; the simulator is
   checked against the sampler's own loops for the first two). The random model draws its EOS id
   now and then, so "today"'s lengths are the ones its run reached, and the stop strings are placed
   in those.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from arlopti_jax.embedded.start_point import compact_rows, sft_target, train_tokenizer
from arlopti_jax.models import ModelConfig, init_params
from arlopti_jax.rollout import Rollout, Sampler, SamplingConfig, apply_stops
from arlopti_jax.rollout.sampler import _half
from arlopti_jax.runtime import sharding as shd

STOP = "</answer>"


def simulate(ends: np.ndarray, sampling: SamplingConfig, devices: int, stops: np.ndarray | None = None):
    """``Sampler.decode``'s loops (rows per device, cache slots less the prompt's, step reached) for
    rows that finish after ``ends`` tokens; with ``stops``, a row also finishes at the first host read
    at or after its stop length."""
    ends = np.asarray(ends).copy()
    per, phases, r, phase, step = len(ends) // devices, sampling.phase_ends(), sampling.max_response_len, 0, 1
    rows, loops = per, []
    busiest = lambda t: max(int((ends[d * per:(d + 1) * per] > t).sum()) for d in range(devices))
    while True:
        compacts = sampling.length_aware and sampling.min_rows <= _half(rows) < rows
        at = _half(rows) if compacts else 0
        limit = min(r, phases[phase])
        while step < limit and busiest(step) > at:
            step += 1
        if stops is not None:
            ends = np.where(stops <= step, np.minimum(ends, step), ends)
        loops.append((rows, phases[phase], step))
        live = busiest(step)
        if step >= r or live == 0:
            return loops
        while rows > min(rows, max(sampling.min_rows, 1 << max(0, live - 1).bit_length())):
            rows = _half(rows)
        if step >= phases[phase]:
            phase += 1


def row_steps(loops) -> int:
    steps = [0] + [s for _, _, s in loops]
    return sum(rows * (steps[i + 1] - steps[i]) for i, (rows, _, _) in enumerate(loops))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=256, help="responses per rollout (prompts x n, n = 4)")
    p.add_argument("--gen-len", type=int, default=256, help="max_response_length")
    p.add_argument("--stop-share", type=float, default=0.5, help="share of responses holding the stop string")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    r, n = args.gen_len, 4
    # EOS lengths (log-normal around r / 4, 5% never forced) and stop lengths (a uniform point before them)
    lengths = np.clip(np.rint(rng.lognormal(np.log(r / 4), 0.6, args.rows)), 2, r).astype(np.int32)
    lengths[rng.random(args.rows) < 0.05] = r
    has_stop = rng.random(args.rows) < args.stop_share
    frac = rng.random(args.rows)  # where the stop string ends, as a share of the response
    stop_len = np.where(has_stop, 1 + (frac * (lengths - 1)).astype(np.int32), r + 1)

    rows = compact_rows(3, 200, 0)
    tok = train_tokenizer([row["prompt"][0]["content"] + sft_target(row) for row in rows], 512)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    filler = tok.encode(" ".join(sft_target(row).replace(STOP, "") for row in rows[:40]))
    stop_ids = tok.encode(STOP)

    # 1. the host's trimming, on responses of these lengths holding the stop string at stop_len
    responses = []
    for i in range(args.rows):
        start = int(rng.integers(0, len(filler) - r))
        ids = filler[start:start + lengths[i] - 1]
        if has_stop[i]:
            at = max(0, min(stop_len[i], len(ids)) - len(stop_ids))
            ids = ids[:at] + stop_ids + ids[at + len(stop_ids):]
        responses.append((ids + [eos])[: lengths[i]])
    width = r
    ids = np.zeros((args.rows, width), np.int32)
    for i, resp in enumerate(responses):
        ids[i, :len(resp)] = resp
    mask = (np.arange(width) < np.array([len(x) for x in responses])[:, None]).astype(np.int32)
    rollout = Rollout(np.ones((args.rows, 1), np.int32), np.ones((args.rows, 1), np.int32), ids, mask,
                      np.zeros(mask.shape, np.float32), mask.sum(1).astype(np.int32), np.zeros(args.rows, bool),
                      np.arange(args.rows, dtype=np.int32), width)
    times = {"batch_decode (the rewards' own)": [], "apply_stops": []}
    for _ in range(args.repeats):
        t = time.perf_counter()
        tok.batch_decode(rollout.responses(), skip_special_tokens=False)
        times["batch_decode (the rewards' own)"].append(time.perf_counter() - t)
        t = time.perf_counter()
        out = apply_stops(rollout, tok, (STOP,), False, 0)
        times["apply_stops"].append(time.perf_counter() - t)
    print(f"host, {args.rows} responses (mean {mask.sum(1).mean():.0f} tokens, {has_stop.mean():.0%} holding "
          f"{STOP!r}): " + ", ".join(f"{k} {1e3 * min(v):.1f} ms" for k, v in times.items())
          + f"; tokens kept {out.lengths.sum() / rollout.lengths.sum():.1%}")

    # 2. the decode loop: today, stopped on device (ideal), stopped at the host reads (simulated)
    # the EOS id: one past the tokenizer's, which the random model draws rarely; stop_at ends the rows
    cfg = ModelConfig(vocab_size=len(tok) + 8, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=32)
    mesh = shd.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    sampling = SamplingConfig(max_response_len=r, temperature=1.0, eos_ids=(len(tok) + 7,), pad_id=0)
    params = init_params(cfg, jax.random.key(0), mesh)
    sampler = Sampler(cfg, mesh)
    prompts = [rng.integers(3, len(tok), 16).tolist() for _ in range(args.rows // n)]
    results, eos_len, ended = {}, lengths, None
    for name in ("today (EOS)", "on device (ideal)"):
        walls = []
        for rep in range(args.repeats + 1):  # the first compiles
            t = time.perf_counter()
            got = sampler.generate(params, prompts, n, jax.random.key(1), sampling,
                                   stop_at=eos_len if ended is None else ended)
            walls.append(time.perf_counter() - t)
        if ended is None:  # the random model draws the EOS id now and then: the lengths it reached
            eos_len = got.lengths
            stop_len = np.where(has_stop, 1 + (frac * (eos_len - 1)).astype(np.int32), r + 1)
            ended = np.minimum(eos_len, stop_len)
        sim = simulate(got.lengths, sampling, 1)
        real = [(rows, slots - got.prompt_ids.shape[1], step) for rows, slots, step in got.decode_loops]
        assert real == sim, (name, real, sim)
        results[name] = (got.decode_row_steps, min(walls[1:]), len(sim))
    assert (got.lengths == ended).all()
    lengths = eos_len
    sim = simulate(lengths, sampling, 1, stop_len)
    results["at host reads (simulated)"] = (row_steps(sim), float("nan"), len(sim))
    base = results["today (EOS)"][0]
    print(f"decode, {args.rows} rows, max_response_length {r}, tokens {lengths.sum()} to EOS, {ended.sum()} to the "
          f"stop string:")
    for name, (steps, wall, loops) in results.items():
        print(f"  {name:<28} row-steps {steps:>7} ({steps / base:.0%})  decode loops {loops}"
              + (f"  wall {wall:.2f} s" if wall == wall else ""))


if __name__ == "__main__":
    main()
