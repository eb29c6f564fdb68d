"""Padding of the update's packed micro-batches, from the packing plan alone (numpy, seconds).

    python bench/packing_plan.py [--shuffles 200]

For two workloads, the share of the processed slots that hold no real token, over random
shuffles of the rollout into mini-batches (the update shuffles before each pass), the
distinct micro-batch shapes the plans use (token rows x row length x target width: each
compiles once), and the vocabulary projection's work per real target (target-list slots per
response token; 1 would be no waste):

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


def simulate(name, attention, response, mini_batch: int, budget: int, attention_cost: float, shuffles: int):
    from arlopti_jax.algos import packing

    rng = np.random.default_rng(0)
    pads, shapes, listed, needed = [], set(), 0, 0
    for _ in range(shuffles):
        order = rng.permutation(len(attention))
        plans = [mb for s in range(0, len(order), mini_batch) for mb in packing.plan_micro_batches(
            attention, response, order[s:s + mini_batch], tokens_per_device=budget, num_devices=1,
            attention_cost=attention_cost)]
        done = packing.summary(plans)
        pads.append(done.padding)
        shapes.update(mb.token_src.shape + mb.target_pos.shape[1:] for mb in plans)
        listed += done.target_slots
        needed += sum(mb.target_count for mb in plans)
    pads = np.asarray(pads)
    print(f"| {name} | {pads.mean():.1%} | {np.quantile(pads, 0.9):.1%} | {pads.max():.1%} | {len(shapes)} | "
          f"{listed / needed:.2f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shuffles", type=int, default=200)
    args = ap.parse_args(argv)

    import realistic
    from common import model_config

    from arlopti_jax.embedded.start_point import tiny_model_config

    print("| workload | mean padding | 90th percentile | worst | micro-batch shapes | target slots per target |")
    print("|---|---|---|---|---|---|")
    r = realistic.parse_args([])
    prompts, lengths = realistic.workload(r)
    attention, response = dense_masks(np.repeat([len(p) for p in prompts], r.n), lengths, r.prompt_len, r.gen_len)
    simulate("realistic", attention, response, r.mini_batch, -(-r.micro * (r.prompt_len + r.gen_len) // 64) * 64,
             model_config(realistic.model_dims(r)).attention_cost_per_key(), args.shuffles)
    rng = np.random.default_rng(1)
    attention, response = dense_masks(np.repeat(rng.integers(105, 148, 8), 8), rng.integers(8, 49, 64), 256, 48)
    simulate("default", attention, response, 32, 9728, tiny_model_config(1024).attention_cost_per_key(),
             args.shuffles)
    return 0


if __name__ == "__main__":
    sys.exit(main())
