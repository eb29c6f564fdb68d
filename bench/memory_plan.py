"""Per-device memory of one RL step (rollout, then the update) for a model shape on a mesh layout.

    python bench/memory_plan.py                                  # the docs/reference/memory.md tables
    python bench/memory_plan.py --model 7b --hardware v5e-16 --param-dtype bfloat16
    python bench/memory_plan.py --model 3b --layout fsdp=4,tensor=2 --devices 8 --hbm-gib 80

Parameters are sharded exactly as the trainer shards them (``sharding.DEFAULT_RULES`` on the
model's logical axes, an indivisible dimension replicated), evaluated on an abstract mesh: no
devices needed. Terms, bytes per device:

  params       policy weights, param_dtype (the trainer's default float32: master weights)
  reference    the frozen initial policy for the KL term, param_dtype (absent with kl_coef=0)
  adamw        mu and nu, param_dtype
  grads        the float32 accumulator + one micro-batch's gradient + optax's updates
  gathered     one layer's weights gathered over fsdp in the compute dtype, x2 (prefetch)
  kv_cache     sequences x (prompt + response) x layers x kv_heads x head_dim x 2 (k, v) x
               compute bytes; sequences over data x fsdp, kv heads over tensor (when divisible)
  act_remat    training activations with per-layer remat: every layer's input [b, T, D] plus one
               layer recomputed in full, plus a log-prob chunk [b, 256, V / tensor] x 3 (f32)
  act_full     without remat: every layer's activations kept for the backward pass
  batch        the rollout batch arrays on device (ids, masks, log-probs, advantages)
A layer's activations count q, k, v and the attention output, the attention scores
[b, heads, T, T] (float32 logits + probabilities: jax.nn.dot_product_attention's XLA path
materialises them), the MLP's gate/up/activation [b, T, F], norms and residuals.

Peaks: rollout = params + reference + adamw + kv_cache (+ decode logits, prefill scores);
update = params + reference + adamw + grads + gathered + activations + batch. A layout fits
when the larger peak is under 90% of the device memory (set XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
on GPUs: XLA preallocates 75% by default). Estimates: XLA's buffer assignment adds some
fragmentation and scratch space on top.
"""

from __future__ import annotations

import argparse
import math
import sys

GIB = 2 ** 30
BYTES = {"float32": 4, "bfloat16": 2}
HARDWARE = {
    "8xH100-80GB": dict(devices=8, hbm_gib=80, layouts=("fsdp=8", "fsdp=4,tensor=2", "data=2,fsdp=4")),
    "v5p-8": dict(devices=4, hbm_gib=95, layouts=("fsdp=4", "fsdp=2,tensor=2", "data=2,fsdp=2")),
    "v5e-16": dict(devices=16, hbm_gib=16, layouts=("fsdp=16", "fsdp=8,tensor=2", "data=2,fsdp=8",
                                                   "fsdp=4,tensor=4")),
}
HEADROOM = 0.9


def parse_layout(text: str) -> dict[str, int]:
    sizes = {"data": 1, "fsdp": 1, "tensor": 1}
    for part in text.split(","):
        axis, value = part.split("=")
        if axis not in sizes:
            raise ValueError(f"layout {text!r}: unknown axis {axis!r} (data, fsdp, tensor)")
        sizes[axis] = int(value)
    return sizes


def per_device_params(cfg, sizes: dict[str, int]) -> int:
    """Parameter elements one device holds under the trainer's shardings."""
    import jax

    from arlopti_jax.runtime import sharding as shd
    from arlopti_jax.models import abstract_params, param_logical_specs

    mesh = jax.sharding.AbstractMesh(tuple(sizes[a] for a in shd.MESH_AXES), shd.MESH_AXES,
                                     axis_types=(jax.sharding.AxisType.Auto,) * 3)
    shapes = abstract_params(cfg)
    shardings = shd.logical_to_shardings(param_logical_specs(cfg), mesh, shd.DEFAULT_RULES, shapes=shapes)
    return sum(math.prod(s.shard_shape(a.shape)) for s, a in zip(jax.tree.leaves(shardings), jax.tree.leaves(shapes)))


def layer_activations(cfg, b: int, t: int, tensor: int, cb: int) -> float:
    """Bytes of one decoder layer's activations for b sequences of t tokens, per device."""
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    heads = cfg.num_heads / tensor if cfg.num_heads % tensor == 0 else cfg.num_heads
    kv = cfg.num_kv_heads / tensor if cfg.num_kv_heads % tensor == 0 else cfg.num_kv_heads
    ff = f / tensor if f % tensor == 0 else f
    norms = t * d * (4 * cb + 2 * 4)  # two residual streams and two norms (float32 inside)
    qkv = t * (2 * heads + 2 * kv) * h * cb  # q, k, v, attention output
    scores = heads * t * t * (4 + cb)  # float32 logits + probabilities
    mlp = t * ff * (3 * cb + 4)  # gate, up, silu(gate) * up (+ float32 silu)
    return b * (norms + qkv + scores + mlp)


def plan(cfg, sizes: dict[str, int], *, batch_prompts=64, n=8, prompt_len=448, response_len=4096,
         micro_per_device=1, param_dtype="float32", compute_dtype="bfloat16", kl=True, chunk=256) -> dict:
    """Bytes per device of each term and of the two peaks (see the module docstring)."""
    bp, cb = BYTES[param_dtype], BYTES[compute_dtype]
    batch_shards, tensor = sizes["data"] * sizes["fsdp"], sizes["tensor"]
    p_dev = per_device_params(cfg, sizes)
    t = prompt_len + response_len
    seqs = batch_prompts * n / batch_shards
    kv = cfg.num_kv_heads / tensor if cfg.num_kv_heads % tensor == 0 else cfg.num_kv_heads
    vocab = cfg.vocab_size / tensor if cfg.vocab_size % tensor == 0 else cfg.vocab_size
    layer_params = cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    layer_params /= cfg.num_layers
    b = micro_per_device
    logits_chunk = b * chunk * vocab * 4 * 3
    out = {
        "params": p_dev * bp,
        "reference": p_dev * bp if kl else 0,
        "adamw": 2 * p_dev * bp,
        "grads": p_dev * (4 + 2 * bp),
        "gathered": 2 * layer_params / tensor * cb,
        "kv_cache": seqs * t * cfg.num_layers * kv * cfg.head_dim * 2 * cb,
        "act_remat": cfg.num_layers * b * t * cfg.hidden_size * cb
        + layer_activations(cfg, b, t, tensor, cb) + logits_chunk,
        "act_full": cfg.num_layers * layer_activations(cfg, b, t, tensor, cb) + logits_chunk,
        "batch": seqs * t * 4 * 8,
    }
    prompts_dev = max(1.0, batch_prompts / batch_shards)
    heads = cfg.num_heads / tensor if cfg.num_heads % tensor == 0 else cfg.num_heads
    rollout_tmp = seqs * vocab * 4 * 3 + prompts_dev * heads * prompt_len ** 2 * (4 + cb)
    states = out["params"] + out["reference"] + out["adamw"]
    out["rollout_peak"] = states + out["kv_cache"] + rollout_tmp
    update = states + out["grads"] + out["gathered"] + out["batch"]
    out["update_peak_remat"] = update + out["act_remat"]
    out["update_peak_full"] = update + out["act_full"]
    return out


def table(models, hardware, **kw) -> str:
    from common import model_config

    cols = ("params", "reference", "adamw", "grads", "kv_cache", "act_remat", "act_full", "rollout_peak",
            "update_peak_remat", "update_peak_full")
    lines = [f"| model | hardware | layout | {' | '.join(cols)} | fits (remat) | fits (no remat) |",
             "|" + "---|" * (len(cols) + 5)]
    for model in models:
        cfg = model_config(model)
        for hw_name, hw in hardware.items():
            usable = hw["hbm_gib"] * GIB * HEADROOM
            for layout in hw["layouts"]:
                sizes = parse_layout(layout)
                if math.prod(sizes.values()) != hw["devices"]:
                    raise ValueError(f"layout {layout} does not use the {hw['devices']} devices of {hw_name}")
                p = plan(cfg, sizes, **kw)
                fit = lambda peak: "yes" if max(p["rollout_peak"], p[peak]) <= usable else "no"
                cells = " | ".join(f"{p[c] / GIB:.1f}" for c in cols)
                lines.append(f"| {model} | {hw_name} ({hw['devices']} x {hw['hbm_gib']} GiB) | {layout} | {cells} | "
                             f"{fit('update_peak_remat')} | {fit('update_peak_full')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", choices=("0.5b", "1.5b", "3b", "7b"),
                    help="model shape (repeatable; default 3b and 7b)")
    ap.add_argument("--hardware", action="append", choices=sorted(HARDWARE), help="(repeatable; default all)")
    ap.add_argument("--layout", help="one layout instead, e.g. fsdp=4,tensor=2 (with --devices, --hbm-gib)")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--hbm-gib", type=float, default=80)
    ap.add_argument("--batch-prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8, help="responses per prompt")
    ap.add_argument("--prompt-len", type=int, default=448, help="bucketed prompt length (400 -> 448)")
    ap.add_argument("--response-len", type=int, default=4096)
    ap.add_argument("--micro-per-device", type=int, default=1, help="sequences per device per micro-batch")
    ap.add_argument("--param-dtype", choices=sorted(BYTES), default="float32")
    ap.add_argument("--no-kl", action="store_true", help="kl_coef=0: no reference policy")
    args = ap.parse_args(argv)
    hardware = {k: HARDWARE[k] for k in (args.hardware or HARDWARE)}
    if args.layout:
        hardware = {"custom": dict(devices=args.devices, hbm_gib=args.hbm_gib, layouts=(args.layout,))}
    kw = dict(batch_prompts=args.batch_prompts, n=args.n, prompt_len=args.prompt_len,
              response_len=args.response_len, micro_per_device=args.micro_per_device,
              param_dtype=args.param_dtype, kl=not args.no_kl)
    print(f"GiB per device; {args.batch_prompts} prompts x {args.n} responses, prompt {args.prompt_len} + "
          f"response {args.response_len} tokens, {args.micro_per_device} sequence(s) per device per micro-batch, "
          f"params/AdamW {args.param_dtype}, activations/KV bfloat16, reference policy "
          f"{'off' if args.no_kl else 'on'}; fits = both peaks under {HEADROOM:.0%} of memory\n")
    print(table(args.model or ["3b", "7b"], hardware, **kw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
