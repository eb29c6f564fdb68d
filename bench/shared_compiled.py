"""Compiler figures of one pass of the update over a ``bench/realistic.py`` workload on a real
model's widths, ``train.shared_prefix`` off against on: every packed micro-batch's forward and
backward (``TrainStep._accumulate``) compiled for a target in compile-only mode and the compiler's
time estimates summed over the pass, at two layer counts; the slope between them gives the whole
model's estimate (what ``bench/roofline.py train --layers`` does for one micro-batch). Compiler
figures, not runs.

    python bench/shared_compiled.py --target v5e-1 --shape 3b --layers 2,4 \\
        --prompt-min 235 --prompt-len 344 --gen-len 1024 --median 0.4     # K&K prompt lengths
    python bench/shared_compiled.py --target h100 ...                      # the same for an H100

On a TPU the figure is XLA:TPU's time estimate; XLA:GPU reports no cost, so on an H100 it is
the roofline floor of each program's matrix FLOPs and memory traffic counted from its optimized
HLO (``hlo.Module.flops`` and ``bytes``): cuDNN's fused attention with the packed rows' mask, as
``train`` runs it.

The CPU benchmarks' tiny model (hidden 256) makes attention dear next to the matrix products, so
its packing keeps rows short and repeats a group's prompt in each row that holds its responses;
at a real model's widths attention is cheap next to them, rows grow to hold a whole group, and
its prompt is forwarded about once. This shows that side.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import numpy as np  # noqa: E402


def main() -> int:
    import realistic
    import roofline

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="v5e-1")
    ap.add_argument("--shape", default="3b", help="a Qwen2.5 size of arlopti_jax/aot/shapes.py")
    ap.add_argument("--layers", default="2,4", help="two layer counts of the shape's widths (the slope)")
    args, rest = ap.parse_known_args()
    work = realistic.parse_args(rest)
    counts = [int(n) for n in args.layers.split(",")]
    if len(counts) != 2 or counts[0] >= counts[1]:
        sys.exit(f"--layers {args.layers}: two increasing layer counts")
    roofline.setup()
    import jax

    from arlopti_jax import algos
    from arlopti_jax.runtime import sharding as shd
    from arlopti_jax.algos import packing
    from arlopti_jax.aot import shapes, targets
    from arlopti_jax.models import ModelConfig, abstract_params, param_shardings, policy
    from shared_packing import dense_batch

    target = targets.get(args.target)
    mesh = shd.make_mesh({"fsdp": -1}, devices=list(targets.devices(target)))
    full = ModelConfig.from_hf_dict(shapes.qwen25(args.shape), dtype="bfloat16", param_dtype="float32",
                                    unroll_layers=True)
    prompts, lengths, ids, attention, response = dense_batch(work)
    tokens = work.micro * (work.prompt_len + work.gen_len)
    floats = np.zeros(ids.shape, np.float32)
    targets_of = {"old_logprobs": floats, "advantages": floats, "loss_mask": response, "response_mask": response,
                  "agg_weight": floats, "target_ids": ids}
    policy.DIRECT_LOGITS_BYTES = 1 << 62  # the vocabulary projection in one piece: a loop-free program
    print(f"jax {jax.__version__}; {target.label}; Qwen2.5-{args.shape.upper()} widths; {work.prompts} prompts x "
          f"{work.n}, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, responses median "
          f"{int(np.median(lengths))} / mean {lengths.mean():.0f}; mini-batch {work.mini_batch}, {tokens} tokens per "
          "micro-batch; compiler figures (compile-only), not runs", flush=True)
    what = "estimate" if target.platform == "tpu" else "roofline floor"
    passes = {}
    for shared in (False, True):
        name = "shared" if shared else "unshared"
        for layers in counts:
            cfg = dataclasses.replace(full, num_layers=layers)
            step = algos.make_train_step(cfg, algos.LossConfig(kl_coef=0.0),
                                         algos.make_optimizer(algos.OptimConfig()), mesh, tokens_per_device=tokens,
                                         chunk_size=tokens, shared_prefix=shared)
            params = jax.tree.map(lambda a, s: roofline.spec(a.shape, a.dtype, s), abstract_params(cfg),
                                  param_shardings(cfg, mesh))
            compiled_by_shape: dict = {}
            total, slots, real = 0.0, 0, 0
            for rows in np.split(np.arange(len(lengths)), len(lengths) // work.mini_batch):
                for mb in step.plan({"input_ids": ids, "attention_mask": attention, "response_mask": response}, rows):
                    host = packing.gather(mb, {"input_ids": ids}, targets_of)
                    key = tuple(sorted((k, v.shape) for k, v in host.items()))
                    if key not in compiled_by_shape:
                        compiled = roofline.compile_accumulate(step, mesh, params, host)[0]
                        compiled_by_shape[key] = program_seconds(compiled, target)
                    total += compiled_by_shape[key]
                    slots, real = slots + mb.token_src.size, real + mb.real_tokens
            passes[(name, layers)] = total
            print(f"{name}, {layers} layers: {len(compiled_by_shape)} micro-batch shapes, {slots} slots ({real} real "
                  f"tokens), {what} {total * 1e3:.0f} ms per pass", flush=True)
    whole = {}
    for name in ("unshared", "shared"):
        slope = (passes[(name, counts[1])] - passes[(name, counts[0])]) / (counts[1] - counts[0])
        whole[name] = passes[(name, counts[1])] + (full.num_layers - counts[1]) * slope
        print(f"{name}: {slope * 1e3:.1f} ms per layer, the whole {full.num_layers}-layer model {whole[name]:.2f} s "
              "per pass (extrapolated)")
    print(f"shared prefix, faster by: {whole['unshared'] / whole['shared']:.2f}x per pass ({what}s; compiler figures)")
    return 0


def program_seconds(compiled, target) -> float:
    """A compiled micro-batch's time by the compiler: XLA:TPU's estimate; on a GPU, which reports
    no cost, the roofline floor of the optimized HLO's matrix FLOPs and memory traffic
    (``hlo.Module``), max(FLOPs / peak, bytes / bandwidth): what the program cannot beat."""
    from arlopti_jax.aot import hlo

    text = compiled.as_text()
    if target.platform == "tpu":
        return hlo.tpu_estimate((compiled.cost_analysis() or {}).get("optimal_seconds"), text) or float("nan")
    module = hlo.Module(text)
    return max(module.flops() / target.peak_flops, module.bytes() / target.hbm_bytes_per_s)


if __name__ == "__main__":
    sys.exit(main())
