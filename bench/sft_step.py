"""The embedded default's SFT step (``supervised.make_sft_step``) with the layers in a scanned loop,
as ``start_point`` runs it, against the same step with the layers as straight-line code
(``model.unroll_layers``), interleaved in one run.

    python bench/sft_step.py                 # the cpu scale's rows, model and batch
    python bench/sft_step.py --batch 16 --rounds 5

Builds the cpu start point's SFT rows, tokenizer and model (``start_point``) in memory, draws
its length-grouped batches (``supervised.batch_schedule``), compiles both steps on every batch
width the schedule uses, then alternates ``--steps`` steps of each for ``--rounds`` rounds and
prints steps/s per round and the ratio. Both see the same batches in the same order.

The start point keeps the loop although the unrolled step is faster (1.16x on 2 cores,
2026-11-25): unrolling changes the float rounding of 600 SFT steps, and from the start point
built that way the reduced default of ``tests/rl/test_learning.py`` ended below its bar
(docs/measurements/journal.md).
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=None, help="rows per step (default: the cpu scale's)")
    ap.add_argument("--steps", type=int, default=40, help="steps per round and method")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import jax
    import numpy as np

    from arlopti_jax.runtime import sharding as shd
    from arlopti_jax.models import init_params
    from arlopti_jax.embedded.start_point import SCALES, compact_rows, model_config, sft_target, train_tokenizer
    from arlopti_jax.finetune.supervised import batch_schedule, make_optimizer, make_sft_step, tokenize_pairs

    s = SCALES["cpu"]
    batch = args.batch or s["sft_batch"]
    coin = np.random.default_rng(30)
    rows = [{"prompt": r["prompt"], "response": sft_target(r, coin.random() < s["sft_tagged_share"])}
            for n in s["people"] for r in compact_rows(n, s["sft_rows_per_size"], 20 + n)]
    tokenizer = train_tokenizer([r["prompt"][0]["content"] + r["response"] for r in rows], s["vocab_size"])
    cfg = model_config(s, -(-len(tokenizer) // 64) * 64)
    data = tokenize_pairs(rows, tokenizer, 1024)
    lengths = data["attention_mask"].sum(1)
    schedule = batch_schedule(lengths, batch, args.steps * args.rounds, seed=0)
    widths = [min(data["input_ids"].shape[1], -(-int(lengths[i].max()) // 16) * 16) for i in schedule]
    mesh = shd.make_mesh({"fsdp": -1})
    opt = make_optimizer(s["sft_lr"], len(schedule), s["sft_warmup"], 0.0, 1.0)
    sharding = shd.batch_sharding(mesh)
    batch_of = lambda i: jax.device_put({k: v[schedule[i], :widths[i]] for k, v in data.items()}, sharding)

    with shd.activate(mesh):
        steps = {"scanned": make_sft_step(cfg, opt, mesh),
                 "unrolled": make_sft_step(cfg.replace(unroll_layers=True), opt, mesh)}
        state = {}
        for name in steps:
            params = init_params(cfg, jax.random.key(0), mesh)
            state[name] = (params, jax.jit(opt.init)(params))
        print(f"model {cfg.num_layers} layers x {cfg.hidden_size}, vocabulary {cfg.vocab_size}; batch {batch}, "
              f"{len(set(widths))} widths (mean {np.mean(widths):.0f} tokens)")
        t0 = time.perf_counter()
        for name, step in steps.items():  # compile every width
            for w in sorted(set(widths)):
                p, o = state[name]
                p, o, loss = step(p, o, batch_of(widths.index(w)))
                state[name] = (p, o)
            jax.block_until_ready(state[name][0])
        print(f"compiled both steps on {len(set(widths))} widths in {time.perf_counter() - t0:.1f} s")
        rates = {name: [] for name in steps}
        for r in range(args.rounds):
            for name, step in steps.items():
                p, o = state[name]
                t0 = time.perf_counter()
                for i in range(r * args.steps, (r + 1) * args.steps):
                    p, o, loss = step(p, o, batch_of(i))
                    float(loss)  # as run_sft does: the loss is shown per step
                rates[name].append(args.steps / (time.perf_counter() - t0))
                state[name] = (p, o)
            print(f"round {r}: " + ", ".join(f"{n} {rates[n][-1]:.2f} steps/s" for n in steps))
        loop, straight = (float(np.median(rates[n])) for n in steps)
        print(f"median steps/s: scanned {loop:.2f}, unrolled {straight:.2f}: ratio {straight / loop:.2f}x")


if __name__ == "__main__":
    main()
