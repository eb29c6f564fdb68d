"""Which tokens does the 80/20 rule train on SmolLM2's start point? A probe of the matched sweep.

    python analysis/entropy_probe.py OUT [--seeds 0,1,2] [--batches 4]

OUT is a matched sweep's folder (its start point and data split). For each seed the probe samples,
from the start point, ``--batches`` rollout batches with the prompts and sampling keys of the
``top_entropy`` run's first steps (its config and data order). The first is that run's own step 1
batch, whose mean reward the probe checks against the run's record when OUT holds it; the later
ones are not the run's, whose policy has moved by then. It takes pi_old's entropy at every
response token, marks the batch's top 20% with the rule's own selection (``entropy_top_mask``), and sorts
the tokens into parts of the answer template ('... The answer is \\boxed{N}.<|im_end|>'):

  boxed    the tokens of '\\boxed{'          answer   the boxed number and its '}'
  end      '<|im_end|>'                      text     every other response token

It prints, per part, the tokens' share of the batch, their mean entropy, the share of them the
rule selects, and the share of the advantage mass sum |A_t| it keeps, for all responses and for
the rewarded ones. Nothing here trains.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

from arlopti_jax import algos
from arlopti_jax.rl import run_setup
from arlopti_jax.experiments import sweep
from arlopti_jax.rl.collect import Collector
from arlopti_jax.experiments.matched import split_train
from arlopti_jax.store.metrics import Timer
from arlopti_jax.tasks import load_reward_fn

PARTS = ("boxed", "answer", "end", "text")


def parts_of(tokenizer, ids: list[int]) -> list[str]:
    """The template part of each response token (by the character span its piece covers)."""
    pieces = [tokenizer.decode([i]) for i in ids]
    text = "".join(pieces)
    spans, at = [], 0
    for p in pieces:
        spans.append((at, at + len(p)))
        at += len(p)
    box = text.find("\\boxed{")
    close = text.find("}", box) if box >= 0 else -1
    out = []
    for (a, b), piece in zip(spans, pieces):
        if piece == "<|im_end|>":
            out.append("end")
        elif box >= 0 and a < box + len("\\boxed{") and b > box:
            out.append("boxed")
        elif box >= 0 and a >= box + len("\\boxed{") and (close < 0 or a <= close):
            out.append("answer")
        else:
            out.append("text")
    return out


def probe(out: Path, seed: int, batches: int, fraction: float) -> dict:
    folder = out / "start_point"
    train, _ = split_train(folder, out / "matched_data", 128)
    tests = ",".join(str(p) for p in sorted((folder / "data").glob("test_*.parquet")))
    base = sweep.base_config("smollm2")
    with tempfile.TemporaryDirectory() as tmp:
        c = sweep.run_config(base, "top_entropy", seed, Path(tmp), folder, 8, 0, 0, False, "smollm2",
                             optimizer_steps=4, lr=1e-5, data=(str(train), tests))
        mesh = run_setup.make_mesh(c)
        policy = run_setup.load_policy(c, mesh, folder / "model")
        iterator = run_setup.train_iterator(c, run_setup.prompt_dataset(c, [train], policy.tokenizer))
        run = run_setup.assemble(c, mesh, policy.model_cfg, eos_ids=run_setup.eos_ids(policy),
                                 pad_id=run_setup.pad_id(policy), total_steps=8)
        collect = Collector(c, run.sampler, run.sampling(), load_reward_fn(None), policy.tokenizer, mesh, Timer())
        key = jax.random.key(c.seed)
        tally = {(who, p): np.zeros(4) for who in ("all", "rewarded") for p in PARTS}  # tokens, H, picked, |A| kept/all
        mass = {(who, p): np.zeros(2) for who in ("all", "rewarded") for p in PARTS}
        first_reward = None
        for step in range(batches):
            sampled = collect(policy.params, iterator, jax.random.fold_in(key, step))
            batch = {k: np.asarray(v) for k, v in sampled.batch.items()}
            _, entropy = run.logprobs(policy.params, batch, with_entropy=True)
            entropy = np.asarray(entropy)
            mask = batch["response_mask"].astype(bool)
            selected = np.asarray(algos.entropy_top_mask(fraction, entropy, batch["response_mask"])) > 0
            adv = np.asarray(algos.compute_advantages(run.adv_cfg, np.asarray(sampled.rewards),
                                                      np.asarray(sampled.group_ids), batch["response_mask"]))
            first_reward = float(sampled.scores.mean()) if first_reward is None else first_reward
            for row in range(len(mask)):
                cols = np.flatnonzero(mask[row])
                names = parts_of(policy.tokenizer, batch["input_ids"][row, cols].tolist())
                rewarded = sampled.rewards[row] > 0
                for col, name in zip(cols, names):
                    for who in ("all", "rewarded") if rewarded else ("all",):
                        h, picked = entropy[row, col], selected[row, col]
                        tally[who, name] += (1, h, picked, 0)
                        mass[who, name] += (abs(adv[row, col]) * picked, abs(adv[row, col]))
    return {"tally": tally, "mass": mass, "first_reward": first_reward}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--fraction", type=float, default=0.2)
    args = ap.parse_args(argv)
    import json

    record = json.loads((args.out / "results.json").read_text()) if (args.out / "results.json").is_file() else {}
    total = {k: np.zeros(4) for k in [(w, p) for w in ("all", "rewarded") for p in PARTS]}
    kept = {k: np.zeros(2) for k in total}
    for seed in (int(s) for s in args.seeds.split(",")):
        got = probe(args.out, seed, args.batches, args.fraction)
        ran = record.get("runs", {}).get(f"top_entropy/seed{seed}", {}).get("rewards")
        check = f" (the run's record: {ran[0]:.4f})" if ran else ""
        print(f"seed {seed}: step 1 mean reward {got['first_reward']:.4f}{check}")
        for k in total:
            total[k] += got["tally"][k]
            kept[k] += got["mass"][k]
    for who in ("all", "rewarded"):
        n = sum(total[who, p][0] for p in PARTS)
        print(f"\n{who} responses ({int(n)} tokens; seeds {args.seeds}, {args.batches} batches each)")
        print("| part | share of tokens | mean entropy | share selected | share of sum abs(A) kept |")
        print("|---|---|---|---|---|")
        for p in PARTS:
            t, m = total[who, p], kept[who, p]
            if t[0]:
                print(f"| {p} | {t[0] / n:.3f} | {t[1] / t[0]:.2f} | {t[2] / t[0]:.3f} | "
                      f"{m[0] / m[1] if m[1] else float('nan'):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
