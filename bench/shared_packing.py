"""How the update packs a ``bench/realistic.py`` workload, with and without the shared prefix: each
micro-batch's rows x row length, real tokens, and the prompt copies it holds, against the ideal
(every group's prompt once: P + n x R tokens). Host-side planning only (``algos/packing.py``), no
model runs, so it takes a second and shows why the shared prefix saves what it saves.

    python bench/shared_packing.py                                         # realistic.py's default
    python bench/shared_packing.py --prompt-min 235 --prompt-len 344 --gen-len 1024 --median 0.4  # K&K prompts

The flags are ``bench/realistic.py``'s (the same workload from the same seed); mini-batches are
taken in row order, as its update takes them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import realistic  # noqa: E402
from packing_plan import dense_masks  # noqa: E402
from shapes import model_config  # noqa: E402

from arlopti_jax.algos import packing  # noqa: E402


def dense_batch(args):
    """(prompts, response lengths, input_ids, attention_mask, response_mask) of the workload, the
    arrays [B, P + G] as ``packing_plan.dense_masks`` lays them out: left-padded prompts,
    right-padded responses, each group's n rows with one prompt."""
    prompts, lengths = realistic.workload(args)
    attention, response = dense_masks(np.repeat([len(p) for p in prompts], args.n), lengths, args.prompt_len,
                                      args.gen_len)
    ids = np.zeros(attention.shape, np.int64)
    for b, prompt in enumerate(np.repeat(np.arange(len(prompts)), args.n)):
        ids[b, args.prompt_len - len(prompts[prompt]):args.prompt_len] = prompts[prompt]
    ids[response > 0] = 3 + np.nonzero(response)[0]  # response tokens: any ids (a row's own)
    return prompts, lengths, ids, attention, response


def main(argv=None) -> int:
    args = realistic.parse_args(argv)
    prompts, lengths, ids, attention, response = dense_batch(args)
    cost_per_key = model_config(realistic.model_dims(args)).attention_cost_per_key()
    tokens_per_device = args.micro * (args.prompt_len + args.gen_len)
    prompt_tokens = sum(len(p) for p in prompts)
    print(f"workload: {args.prompts} prompts x {args.n}, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens, responses median {int(np.median(lengths))} / mean {lengths.mean():.0f} / max {lengths.max()}; "
          f"mini-batch {args.mini_batch}, {tokens_per_device} tokens per micro-batch")
    totals = {}
    for shared in (False, True):
        real = cost = copies = 0
        for rows in np.split(np.arange(len(lengths)), len(lengths) // args.mini_batch):
            plan = packing.plan_micro_batches(attention, response, rows, tokens_per_device=tokens_per_device,
                                              num_devices=1, attention_cost=cost_per_key,
                                              input_ids=ids if shared else None)
            for mb in plan:
                r, s = mb.token_src.shape
                held = sum(len(np.unique(row[row > 0])) for row in mb.prefix_ids)  # shared prompt segments
                real, cost, copies = real + mb.real_tokens, cost + r * s * (1 + cost_per_key * s), copies + held
                print(f"  {'shared' if shared else 'unshared'}: {r} x {s}, {mb.real_tokens} real tokens, "
                      f"{mb.sequences} sequences, {held} shared prompt segments")
        totals[shared] = (real, cost, copies)
    ideal = prompt_tokens + int(lengths.sum())
    full = args.n * prompt_tokens + int(lengths.sum())  # every prompt repeated
    (u_real, u_cost, _), (s_real, s_cost, s_copies) = totals[False], totals[True]
    responses = int(lengths.sum())
    print(f"real tokens: unshared {u_real}, shared {s_real}, ideal {ideal} (each prompt once); prompt copies per "
          f"prompt: unshared {(u_real - responses) / prompt_tokens:.1f}, shared {(s_real - responses) / prompt_tokens:.1f} "
          f"({s_copies} of them shared prompt segments), ideal 1")
    print(f"unshared / shared: real tokens {u_real / s_real:.2f}x (ideal {full / ideal:.2f}x), packing cost "
          f"(slots x (1 + attention per key x row length)) {u_cost / s_cost:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
