"""The packed plans of bench/realistic.py's 1.5B GPU workload under two shape sets (numpy only).

    PYTHONPATH=. python docs/measurements/cpu_2026-11-29_bench_shapes/plans.py

"budget": ``packing.shapes_for(tokens)``, what the bench built before this change (rows as long as
the micro-batch's whole budget); "trainer": ``packing.shapes_for(tokens, width)``, the set
``rl/run_setup.pack_shapes`` builds (rows up to twice the longest sequence). For the update's
mini-batches (in row order, as the bench runs them) and the reference pass (the whole batch):
micro-batches and their shapes, slots and padding, and the model FLOPs, the attention's counted
over every (query, key) pair of a packed row, as an attention given a dense [T, T] mask computes
them.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import common  # noqa: E402
import realistic  # noqa: E402
from packing_plan import dense_masks  # noqa: E402

from arlopti_jax.algos import packing  # noqa: E402

ARGS = ("--shape 1.5b --dtype bfloat16 --prompts 8 --n 8 --prompt-min 235 --prompt-len 344 --gen-len 1024 "
        "--mini-batch 32 --micro 8").split()


def flops(cfg, plans, factor):
    """(matmul, attention) model FLOPs of the plans' micro-batches, x ``factor`` (3: forward + backward)."""
    d = cfg.hidden_size
    body = cfg.num_params() - cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2)
    matmul = sum(2 * body * mb.token_src.size + 2 * cfg.vocab_size * d * mb.target_src.size for mb in plans)
    pairs = sum(mb.token_src.shape[0] * mb.row_length ** 2 for mb in plans)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs
    return factor * matmul, factor * attention, pairs


def main():
    r = realistic.parse_args(ARGS)
    cfg = common.model_config(realistic.model_dims(r))
    prompts, lengths = realistic.workload(r)
    width = r.prompt_len + r.gen_len
    attention, response = dense_masks(np.repeat([len(p) for p in prompts], r.n), lengths, r.prompt_len, r.gen_len)
    ids = np.repeat(np.arange(1, len(prompts) + 1), r.n)[:, None] * (attention - response)  # a prompt per group
    tokens = common.packed_budget(r.micro, width)
    print(f"workload: {len(lengths)} rows, prompts {min(map(len, prompts))}-{max(map(len, prompts))}, responses "
          f"median {int(np.median(lengths))} / max {lengths.max()}; {int(attention.sum())} real tokens "
          f"(shared prompts counted per row); budget {tokens} tokens per micro-batch; Qwen2.5-1.5B widths")
    print("| shape set | row lengths | pass | micro-batches (rows x length) | slots | padding | attention pairs | "
          "matmul TFLOP | attention TFLOP |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, shapes in (("budget", packing.shapes_for(tokens)), ("trainer", packing.shapes_for(tokens, width))):
        kw = dict(tokens_per_device=tokens, num_devices=1, attention_cost=cfg.attention_cost_per_key(),
                  input_ids=ids, shapes=shapes)
        minis = [np.arange(s, s + r.mini_batch) for s in range(0, len(lengths), r.mini_batch)]
        update = [packing.plan_micro_batches(attention, response, rows, **kw) for rows in minis]
        ref = packing.plan_micro_batches(attention, response, np.arange(len(lengths)), **kw)
        # two Lopti passes over the same mini-batch plans (update_on_batch packs each mini-batch once)
        for label, plans, factor in (("update (2 passes)", [mb for p in update for mb in p] * 2, 3),
                                     ("reference", ref, 1)):
            matmul, attn, pairs = flops(cfg, plans, factor)
            done = packing.summary(plans)
            listed = plans[:len(plans) // 2] if factor == 3 else plans  # the update's second pass repeats the first
            shapes_used = ", ".join(f"{mb.token_src.shape[0]}x{mb.row_length}" for mb in listed)
            repeat = " (x2)" if factor == 3 else ""
            print(f"| {name} | {shapes.row_lengths} | {label} | {len(plans)}: {shapes_used}{repeat} | "
                  f"{done.slots:,} | {done.padding:.1%} | {pairs / 1e6:,.0f}M | {matmul / 1e12:.1f} | "
                  f"{attn / 1e12:.1f} |")

if __name__ == "__main__":
    main()
