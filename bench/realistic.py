"""A realistic-length RL step, by phase: this checkout against an earlier commit (the dense path),
interleaved in one run, plus the tiny-shape comparison with transformers.

    python bench/realistic.py                          # before = 7530733 (the last dense commit)
    python bench/realistic.py --before none --rounds 1 # this checkout only
    python bench/realistic.py --skip-tiny              # without bench/tiny_vs_hf.py
    python bench/realistic.py --compare-shared --skip-tiny  # train.shared_prefix off against on, this checkout
    JAX_PLATFORMS=cuda python bench/realistic.py --before none --skip-tiny --shape 0.5b --dtype bfloat16 \
        --prompts 8 --n 8 --prompt-len 256 --gen-len 1024 --mini-batch 32 --micro 8      # GPU

Workload (fixed seed): a tiny Qwen2 (vocabulary 4096, hidden 256, 4 layers, 4 heads / 2 KV heads,
ffn 1024, tied; or ``--shape``, a Qwen2.5 preset of ``bench/shapes.py``), ``--prompts`` x ``--n``
responses, prompts of ``--prompt-min`` (default ``--prompt-len`` / 2) to ``--prompt-len`` tokens
(left-padded to the bucket),
response lengths log-normal with median ``--median`` x ``--gen-len`` (sigma 0.8), clipped to [8,
gen-len], and ``--at-max`` of the rows at exactly gen-len; every response ends with an EOS at its
length.
The phases are train.py's step (GRPO + AR + Lopti, KL on): rollout, reference log-probs,
advantages, update (two Lopti passes over ``--mini-batch`` mini-batches; dense micro-batches of
``--micro`` rows, which also set the packed token budget).

The earlier commit's sampler cannot force an EOS; it stops only when every row has finished,
and rows at gen-len finish last, so its rollout cost is that of generating gen-len tokens for
every row: it runs exactly that (no EOS). Its update and log-prob passes run on the dense
[N, P + R] batch whatever the mask, so the same lengths give the same cost.

Each round runs the earlier commit's code and this checkout's in separate processes (its
package extracted with ``git archive``), one after the other; the script prints every round and
the medians per phase, and, per phase, the padding share of the token slots processed and the
model FLOP per real token (forward: 2 per body weight per processed slot, 2 per vocabulary
weight per slot projected onto the vocabulary, plus attention over the keys each query sees;
3 x that for forward + backward). The new path's compilations after its warm-up
step are counted: none are allowed beyond its documented buckets (asserted).

``--compare-shared`` runs this checkout twice per round instead, with the shared-prefix update and
log-prob passes off ("unshared") and on ("shared", ``algos/packing.py``), and reports each side's
peak resident memory (``ru_maxrss``) beside the times. Attention FLOP count the keys each packed
query sees (its position + 1), so a shared prompt's attention is counted once.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DIMS = dict(hidden=256, intermediate=1024, layers=4, heads=4, kv_heads=2, vocab=4096, tied=True)
PHASES = ("rollout", "ref_logprobs", "advantages", "update")
EOS = 2


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="7530733", help="git commit of the dense path ('none' to skip)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="timed RL steps per round (after a warm-up step)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128, help="longest prompt (tokens)")
    ap.add_argument("--prompt-min", type=int, default=0,
                    help="shortest prompt (default: half --prompt-len); the paper's K&K prompts are 235-344 tokens "
                         "(SmolLM2's tokenizer, 3 to 7 people)")
    ap.add_argument("--gen-len", type=int, default=512)
    ap.add_argument("--median", type=float, default=0.15, help="median response length / gen-len")
    ap.add_argument("--at-max", type=float, default=0.06, help="share of responses at gen-len")
    ap.add_argument("--mini-batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=8, help="rows of a dense micro-batch")
    ap.add_argument("--shape", default="bench", help="'bench' (the tiny Qwen2 above) or a bench/shapes.py preset")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    ap.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="parameter dtype (the trainer's default: float32 master weights)")
    ap.add_argument("--skip-tiny", action="store_true", help="skip the tiny-shape comparison with transformers")
    ap.add_argument("--compare-shared", action="store_true",
                    help="this checkout with train.shared_prefix off against on (instead of --before)")
    ap.add_argument("--shared-prefix", choices=("on", "off"), default="on", help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=("run",), help=argparse.SUPPRESS)
    ap.add_argument("--label", default="", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def model_dims(args) -> dict:
    """The workload's model dimensions: ``DIMS`` or a ``bench/shapes.py`` preset."""
    if args.shape == "bench":
        return DIMS
    sys.path.insert(0, str(HERE))
    from shapes import dims

    return dims(args.shape)


def workload(args):
    """(prompts: list of token lists, response lengths [N]) from a fixed seed."""
    import numpy as np

    rng = np.random.default_rng(0)
    plens = rng.integers(args.prompt_min or args.prompt_len // 2, args.prompt_len + 1, args.prompts)
    vocab = model_dims(args)["vocab"]
    prompts = [rng.integers(3, vocab, int(p)).tolist() for p in plens]
    rows = args.prompts * args.n
    lengths = np.clip(np.round(rng.lognormal(np.log(args.median * args.gen_len), 0.8, rows)), 8, args.gen_len)
    lengths[rng.permutation(rows)[:max(1, round(args.at_max * rows))]] = args.gen_len
    return prompts, lengths.astype(np.int32)


def attention_keys(mask_rows) -> float:
    """Sum over the processed queries of the keys each attends to in a dense causal pass."""
    return float(sum(t * (t + 1) / 2 for t in mask_rows))


def run_worker(args) -> dict:
    """One process: a warm-up step and ``--steps`` timed steps; prints a JSON record."""
    import logging

    import jax
    import numpy as np

    sys.path.insert(0, str(HERE))
    from arlopti_jax import algos
    from arlopti_jax.runtime import sharding as shd
    from arlopti_jax.models import init_params
    from arlopti_jax.rollout import Sampler, SamplingConfig
    from shapes import model_config

    compiles = []
    handler = logging.Handler()
    handler.emit = lambda record: compiles.append(record.getMessage()) if record.getMessage().startswith(
        "Finished XLA compilation") else None
    jax.config.update("jax_log_compiles", True)
    logging.getLogger("jax").addHandler(handler)
    logging.getLogger("jax").propagate = False

    prompts, lengths = workload(args)
    mesh = shd.make_mesh({"fsdp": -1})
    packed = "tokens_per_device" in inspect.signature(algos.make_train_step).parameters
    overrides = {"unroll_layers": True} if packed and args.shape == "bench" else {}  # short stacks only
    cfg = model_config(model_dims(args), dtype=args.dtype, param_dtype=args.param_dtype).replace(
        eos_token_id=EOS, **overrides)
    params = init_params(cfg, jax.random.key(0), mesh)
    ref_params = jax.tree.map(lambda x: x.copy(), params)
    optimizer = algos.make_optimizer(algos.OptimConfig(lr=1e-6))
    opt_state = algos.init_opt_state(optimizer, cfg, params, mesh)
    loss_cfg = algos.LossConfig(kl_coef=0.001)
    width = args.prompt_len + args.gen_len
    # the shared-prefix flag, where this checkout has it
    share = "shared_prefix" in inspect.signature(algos.make_train_step).parameters
    shared = {"shared_prefix": args.shared_prefix == "on"} if share else {}
    if packed:
        tokens = -(-args.micro * width // 64) * 64
        step_fn = algos.make_train_step(cfg, loss_cfg, optimizer, mesh, tokens_per_device=tokens, **shared)
        logprobs_fn = algos.make_compute_logprobs(cfg, mesh, tokens_per_device=tokens, **shared)
    else:
        step_fn = algos.make_train_step(cfg, loss_cfg, optimizer, mesh, num_micro_batches=args.mini_batch // args.micro)
        logprobs_fn = algos.make_compute_logprobs(cfg, mesh, num_micro_batches=args.mini_batch // args.micro)
    sampler = Sampler(cfg, mesh)
    forced = "stop_at" in inspect.signature(sampler.generate).parameters
    sampling = SamplingConfig(max_response_len=args.gen_len, temperature=1.0, eos_ids=(EOS,) if forced else (),
                              prompt_bucket=args.prompt_len, batch_bucket=args.prompts)
    adv_cfg, weights, lopti = algos.AdvantageConfig("grpo"), algos.TokenWeightConfig("ar", alpha=0.3), \
        algos.LoptiConfig(True, 0.5)
    rewards = np.random.default_rng(1).choice([-1.0, 3.0], len(lengths)).astype(np.float32)
    times = {p: [] for p in PHASES}
    stats = {}
    warm_compiles = 0
    pads, rollout_pads = [], []  # per timed step: the update's and the decode loops' padding
    for step in range(args.steps + 1):
        key = jax.random.fold_in(jax.random.key(0), step)
        t = {}
        start = time.perf_counter()
        extra = {"stop_at": lengths} if forced else {}
        rollout = sampler.generate(params, prompts, args.n, key, sampling, **extra)
        t["rollout"] = time.perf_counter() - start
        batch = rollout.train_batch()
        if not forced:  # the dense path generated gen-len tokens per row: give it the workload's masks
            keep = (np.arange(args.gen_len)[None] < lengths[:, None]).astype(batch["response_mask"].dtype)
            p = batch["input_ids"].shape[1] - args.gen_len
            batch["response_mask"][:, p:] *= keep
            batch["attention_mask"][:, p:] *= keep.astype(batch["attention_mask"].dtype)
            batch["old_logprobs"][:, p:] *= keep
        got = batch["response_mask"].sum(1)
        # a random policy also samples the EOS id by chance (about 1 token in 4096): such a row ends
        # before its forced length (a few may, none may run longer); the passes below then get the
        # workload's masks, as the dense path does, so every step processes the same lengths
        early = int((got < lengths).sum())
        assert (got <= lengths).all() and early <= max(2, len(lengths) // 10), \
            f"the rollout's lengths are not the workload's ({early} rows ended early)"
        if early:
            p = batch["input_ids"].shape[1] - args.gen_len
            keep = (np.arange(args.gen_len)[None] < lengths[:, None]).astype(batch["response_mask"].dtype)
            batch["response_mask"][:, p:] = keep
            batch["attention_mask"][:, p:] = keep.astype(batch["attention_mask"].dtype)
        start = time.perf_counter()
        batch["ref_logprobs"] = np.asarray(jax.block_until_ready(logprobs_fn(ref_params, batch)))
        t["ref_logprobs"] = time.perf_counter() - start
        start = time.perf_counter()
        passes = jax.block_until_ready(algos.prepare_updates(adv_cfg, weights, lopti, rewards, rollout.group_ids,
                                                             batch["response_mask"], batch["old_logprobs"]))
        t["advantages"] = time.perf_counter() - start
        start = time.perf_counter()
        mark = len(getattr(step_fn, "processed", getattr(step_fn, "padding", [])))
        params, opt_state, _ = algos.update_on_batch(step_fn, params, opt_state, batch, passes, args.mini_batch)
        t["update"] = time.perf_counter() - start
        if step == 0:
            warm_compiles = len(compiles)
        else:
            for ph in PHASES:
                times[ph].append(t[ph])
        real = int(batch["attention_mask"].sum())
        slots = batch["input_ids"].size
        # slots and vocabulary-projected target slots, per pass: the update's calls summed (or, for
        # the dense path, every slot of the batch once per Lopti pass), the reference pass's plan
        if hasattr(step_fn, "processed"):
            done = step_fn.processed_since(mark)
            update = dict(padding=done.padding, slots=done.slots, targets=done.target_slots)
        elif packed:  # a packed commit before the per-call summaries: padding only
            update = dict(padding=float(np.mean(step_fn.padding[mark:])), slots=None, targets=None)
        else:
            update = dict(padding=1 - real / slots, slots=slots * len(passes), targets=slots * len(passes))
        if packed:  # the plan's arrays directly (packing.summary is newer than some --before commits)
            from arlopti_jax.algos import packing

            ids = {"input_ids": batch["input_ids"]} if shared.get("shared_prefix") else {}
            plan = packing.plan_micro_batches(batch["attention_mask"], batch["response_mask"],
                                              np.arange(len(lengths)), tokens_per_device=tokens,
                                              num_devices=shd.batch_divisor(mesh),
                                              attention_cost=cfg.attention_cost_per_key(), **ids)
            ref = dict(slots=sum(mb.token_src.size for mb in plan), targets=sum(mb.target_src.size for mb in plan),
                       keys=float(sum(int((mb.positions + 1)[mb.token_src >= 0].sum()) for mb in plan)))
        else:
            ref = dict(slots=slots, targets=slots)
        if step:  # padding over the timed steps
            pads.append(update["padding"])
            decode_slots = getattr(rollout, "decode_row_steps", 0) or len(lengths) * args.gen_len
            rollout_pads.append(1 - int(got.sum()) / decode_slots)
        rows = batch["attention_mask"].sum(1)
        stats = {"real_tokens": real, "dense_slots": slots, "update_padding": float(np.mean(pads or [0.0])),
                 "rollout_padding": float(np.mean(rollout_pads or [0.0])),
                 "generated": int(got.sum()), "ended_early": early, "passes": len(passes),
                 "update_slots": update["slots"], "update_target_slots": update["targets"],
                 "ref_slots": ref["slots"], "ref_target_slots": ref["targets"],
                 "decode_row_steps": getattr(rollout, "decode_row_steps", 0),
                 "decode_attended_keys": getattr(rollout, "decode_attended_keys", 0),
                 "dense_attention_keys": attention_keys([batch["input_ids"].shape[1]] * len(rows)),
                 "real_attention_keys": ref.get("keys", attention_keys(rows))}
    import resource

    record = {"label": args.label, "packed": packed, "forced_eos": forced, "num_params": cfg.num_params(),
              "times": times, "stats": stats, "compiles_after_warmup": len(compiles) - warm_compiles,
              "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # KiB on Linux
    print("RESULT " + json.dumps(record))
    return record


def spawn(args, label: str, pythonpath: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "run", "--label", label] + [
        a for a in sys.argv[1:] if a not in ("--skip-tiny", "--compare-shared")]
    if args.compare_shared:
        cmd += ["--shared-prefix", "on" if label == "shared" else "off"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=pythonpath)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{label} worker failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def flop_per_real_token(rec: dict, args) -> dict[str, float]:
    """Model FLOP per real (prompt + response) token, per phase, from what each path processed:
    2 per body weight per token slot and 2 per vocabulary-projection weight per projected target
    slot (forward; x 3 with the backward), plus attention over the keys each query sees. The
    update's slots and targets are summed over its calls (both Lopti passes); a record without
    them (an older packed commit) gets None for the update and the reference pass."""
    s, n = rec["stats"], rec["num_params"]
    d = model_dims(args)
    L, heads, hd = d["layers"], d["heads"], d["hidden"] // d["heads"]
    vocab = d["vocab"] * d["hidden"]
    body = n - vocab * (1 if d["tied"] else 2)  # the embedding lookup does no arithmetic
    attn = 4 * L * heads * hd  # FLOP per (query, key) pair, forward
    keys = s["real_attention_keys"] if rec["packed"] else s["dense_attention_keys"]
    real = s["real_tokens"]
    decode_slots = s.get("decode_row_steps") or (args.prompts * args.n) * args.gen_len
    decode_keys = s.get("decode_attended_keys") or (args.prompts * args.n) * sum(
        args.prompt_len + t for t in range(args.gen_len))
    out = {"rollout": (2 * (body + vocab) * decode_slots + attn * decode_keys) / real}
    if s.get("update_slots") is not None:
        out["ref_logprobs"] = (2 * body * s["ref_slots"] + 2 * vocab * s["ref_target_slots"] + attn * keys) / real
        out["update"] = 3 * (2 * body * s["update_slots"] + 2 * vocab * s["update_target_slots"]
                             + s["passes"] * attn * keys) / real
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    import numpy as np

    prompts, lengths = workload(args)
    print(f"workload: {args.prompts} prompts x {args.n}, prompt {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens, responses median {int(np.median(lengths))} / mean {lengths.mean():.0f} / max {lengths.max()} "
          f"of {args.gen_len} ({(lengths == args.gen_len).sum()} at the max); mini-batch {args.mini_batch}, dense "
          f"micro-batch {args.micro} rows; Qwen2 {model_dims(args)}, compute {args.dtype}, params "
          f"{args.param_dtype}")
    sides = {"after": str(ROOT)}
    tmp = None
    if args.compare_shared:
        sides = {"unshared": str(ROOT), "shared": str(ROOT)}
    elif args.before != "none":
        tmp = tempfile.mkdtemp(prefix="before_")
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before, "arlopti_jax", "bench"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        (Path(tmp) / "bench" / "realistic.py").write_text(Path(__file__).read_text())
        sides = {"before": tmp, **sides}
    records = {side: [] for side in sides}
    for r in range(args.rounds):
        for side, path in sides.items():
            rec = spawn(args, side, path)
            records[side].append(rec)
            med = {p: statistics.median(rec["times"][p]) for p in PHASES}
            print(f"round {r + 1} {side}: step {sum(med.values()):.2f}s (" +
                  ", ".join(f"{p} {v:.2f}s" for p, v in med.items()) + ")", flush=True)
    print("\nmedians over rounds (seconds per RL step), padding share of processed slots, model FLOP per real token:")
    print("| phase | " + " | ".join(f"{s} s | {s} padding | {s} FLOP/real token" for s in sides) + " |")
    print("|---" * (1 + 3 * len(sides)) + "|")
    summary = {}
    for side, recs in records.items():
        med = {p: statistics.median(statistics.median(r["times"][p]) for r in recs) for p in PHASES}
        summary[side] = med
    for p in PHASES + ("step",):
        cells = []
        for side, recs in records.items():
            rec = recs[-1]
            seconds = sum(summary[side].values()) if p == "step" else summary[side][p]
            if p in ("update", "ref_logprobs"):
                pad = f"{rec['stats']['update_padding']:.1%}"
            elif p == "rollout":
                pad = f"{rec['stats']['rollout_padding']:.1%}"
            else:
                pad = "-"
            flop = flop_per_real_token(rec, args).get(p)
            cells.append(f"{seconds:.2f} | {pad} | {flop / 1e6:.1f}M" if flop else f"{seconds:.2f} | {pad} | -")
        print(f"| {p} | " + " | ".join(cells) + " |")
    if "before" in summary:
        before, after = sum(summary["before"].values()), sum(summary["after"].values())
        print(f"\nwhole RL step: before {before:.2f}s, after {after:.2f}s: {before / after:.2f}x faster")
    if args.compare_shared:
        ratio = lambda p: (sum(summary["unshared"].values()) / sum(summary["shared"].values()) if p == "step"
                           else summary["unshared"][p] / summary["shared"][p])
        print("\nshared prefix, faster by: " + ", ".join(f"{p} {ratio(p):.2f}x" for p in ("step", "update",
                                                                                            "ref_logprobs")))
        for side in sides:
            print(f"peak RSS per round, {side}: " + ", ".join(f"{r['peak_rss'] / 2**30:.2f} GiB" for r in records[side]))
    for side in (s for s in sides if s != "before"):
        early = [r["stats"].get("ended_early", 0) for r in records[side]]
        print(f"rows that sampled the EOS id before their forced length ({side}, last step of each round): {early}")
        compiles = [r["compiles_after_warmup"] for r in records[side]]
        print(f"compilations after the warm-up step ({side}): {compiles}")
        assert all(c == 0 for c in compiles), f"{side} recompiled after its warm-up step"
    if not args.skip_tiny:
        print("\n--- tiny-shape comparison with transformers (bench/tiny_vs_hf.py) ---", flush=True)
        sys.path.insert(0, str(HERE))
        import tiny_vs_hf

        tiny_vs_hf.main(["--rounds", str(args.rounds)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
