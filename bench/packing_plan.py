"""Padding of the update's packed micro-batches, from the packing plan alone (numpy, seconds).

    python bench/packing_plan.py [--shuffles 200]

For each workload and each setting of the packed shape set (``train.pack_row_lengths`` x
``train.pack_fills``: the programs each packed pass compiles before its first step), over random
shuffles of the rollout into mini-batches (the update shuffles before each pass): the shapes the
plans used, the share of the processed slots that hold no real token, and the cost per real token
by the packer's own model (a slot costs 1 + attention_cost x its row length; the programs are
paid once, compiling, the cost every step):

  realistic  ``bench/realistic.py``'s lengths and budget (32 sequences, mini-batches of 16,
             5,120 tokens per micro-batch, its tiny Qwen2's attention cost);
  default    the embedded default's shape: 64 sequences of a 105-147-token prompt and a
             8-48-token response (a fixed-seed draw), mini-batches of 32, 9,728 tokens, the start
             point's model.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def dense_masks(prompt_lengths, response_lengths, prompt_width: int, response_width: int):
    """Left-padded prompts, right-padded responses: (attention_mask, response_mask) [N, P + R]."""
    n = len(response_lengths)
    attention = np.zeros((n, prompt_width + response_width), np.int32)
    response = np.zeros_like(attention)
    for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        attention[i, prompt_width - p:prompt_width + r] = 1
        response[i, prompt_width:prompt_width + r] = 1
    return attention, response


def simulate(name, attention, response, mini_batch: int, budget: int, attention_cost: float, shuffles: int,
             ids=None, settings=((1, 1), (1, 4), (2, 2), (2, 3), (2, 4), (2, 5), (3, 4))):
    """For each (row lengths, fills) setting: programs per pass, padding, and the packed cost per real
    token (slots weighted by 1 + attention_cost x row length, the packer's own cost model)."""
    from arlopti_jax.algos import packing

    longest = attention.shape[1]
    for row_lengths, fills in settings:
        shapes = packing.shapes_for(budget, longest, row_lengths, fills)
        rng = np.random.default_rng(0)
        pads, used, cost, real = [], set(), 0.0, 0
        for _ in range(shuffles):
            order = rng.permutation(len(attention))
            plans = [mb for s in range(0, len(order), mini_batch) for mb in packing.plan_micro_batches(
                attention, response, order[s:s + mini_batch], tokens_per_device=budget, num_devices=1,
                attention_cost=attention_cost, input_ids=ids, shapes=shapes)]
            done = packing.summary(plans)
            pads.append(done.padding)
            used.update(mb.token_src.shape for mb in plans)
            cost += sum(mb.token_src.size * (1 + attention_cost * mb.row_length) for mb in plans)
            real += done.real_tokens
        pads = np.asarray(pads)
        print(f"| {name} | {row_lengths} x {fills} | {len(shapes.all())} | {len(used)} | {pads.mean():.1%} | "
              f"{np.quantile(pads, 0.9):.1%} | {cost / real:.2f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shuffles", type=int, default=50)
    args = ap.parse_args(argv)

    import realistic
    from common import model_config

    from arlopti_jax.embedded.start_point import tiny_model_config

    print("| workload | row lengths x fills | programs per pass | shapes used | mean padding | 90th percentile | "
          "cost per real token |")
    print("|---|---|---|---|---|---|---|")
    r = realistic.parse_args([])
    prompts, lengths = realistic.workload(r)
    attention, response = dense_masks(np.repeat([len(p) for p in prompts], r.n), lengths, r.prompt_len, r.gen_len)
    ids = np.repeat(np.arange(1, len(prompts) + 1), r.n)[:, None] * (attention - response)  # a prompt per group
    for tag, shared in (("realistic", None), ("realistic, shared prefix", ids)):
        simulate(tag, attention, response, r.mini_batch, -(-r.micro * (r.prompt_len + r.gen_len) // 64) * 64,
                 model_config(realistic.model_dims(r)).attention_cost_per_key(), args.shuffles, shared)
    rng = np.random.default_rng(1)
    attention, response = dense_masks(np.repeat(rng.integers(105, 148, 8), 8), rng.integers(8, 49, 64), 256, 48)
    ids = np.repeat(np.arange(1, 9), 8)[:, None] * (attention - response)
    simulate("default (shared prefix)", attention, response, 32, 9728, tiny_model_config(1024).attention_cost_per_key(),
             args.shuffles, ids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
