"""Compiler figures for one decode step and one train micro-batch, against the hardware's limits.

    python bench/roofline.py decode                       # 1.5B, rows 64 and 256, prompt 512 + 4096, h100 and v5e-1
    python bench/roofline.py decode --targets h100 --rows 64 --slots 1536,2560,4608
    python bench/roofline.py train --target v5e-16 --shape 3b
    python bench/roofline.py decode --targets local --run  # on a lent GPU: also time the step (bench/gpu.sh calibrate)
    python bench/roofline.py decode --targets h100 --rows 64 --slots 1536 --json decode.json   # the figures as JSON

Everything here is compiled by the target's own compiler in compile-only mode
(``arlopti_jax.aot``): compiler figures, not runs.

decode: one decode step of the sampler (``rollout/programs.step``: the last token through every
layer with its KV cache, logits, the next token sampled) for ``--rows`` rows with a cache of
``--slots`` slots (default the whole prompt + response), in bfloat16 with the sampler's
bfloat16 weights (``Sampler.sampling_params``). The minimum traffic of a step is the weights
once (the tied embedding read once, as the output projection) plus the live KV cache once: the
step is at its memory roofline when it moves that and no more. Printed per target:

- bytes per step: XLA:TPU's cost analysis on the straight-line step (layers unrolled: its
  estimate needs a program without loops), or, on the H100, the optimized HLO's traffic
  (``aot.hlo.Module``), against the minimum;
- TPU: the compiler's time estimate against the roofline time (minimum bytes / HBM bandwidth),
  for the whole straight-line step and by the slope between 8- and 16-layer programs (the whole
  model unrolled can come near the chip's memory, where XLA rematerialises what the layer loop
  the sampler runs does not: the line says so when it happens);
- H100: the launches of the decode loop that runs (layers as a loop): per layer and per step,
  kernels outside command buffers and command buffers, from XLA:GPU's thunk sequence.

train: one packed micro-batch's forward and backward (``TrainStep._accumulate``) of a Qwen2.5
shape at the paper's sequence length (one 4544-token sequence per device), layers unrolled and
the vocabulary projection in one chunk so the program has no loop; model FLOPs (6 x parameters
x tokens + causal attention, the usual MFU count: no rematerialisation) over the compiler's
estimate and the chip's peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

QWEN25_SIZES = ("0.5b", "1.5b", "3b", "7b")  # arlopti_jax.aot.shapes.QWEN25, which imports jax


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    d = sub.add_parser("decode", help="one decode step")
    d.add_argument("--targets", default="h100,v5e-1")
    d.add_argument("--shape", default="1.5b", choices=QWEN25_SIZES, help="a Qwen2.5 size (arlopti_jax/aot/shapes.py)")
    d.add_argument("--rows", default="64,256", help="decode rows (prompts x samples)")
    d.add_argument("--prompt", type=int, default=512)
    d.add_argument("--response", type=int, default=4096)
    d.add_argument("--slots", default="", help="cache slots to compile (default prompt + response)")
    d.add_argument("--run", action="store_true", help="--targets local: also run and time the step (ms per step)")
    d.add_argument("--json", default="", help="also write the figures, one record per (target, rows, slots), here")
    d.add_argument("--profile", type=int, default=0,
                   help="--run: also trace N more steps with jax.profiler and print the kernels' time by family")
    d.add_argument("--skip-launches", action="store_true",
                   help="GPU: do not compile the decode loop again to count its kernels (a run's figures only)")
    d.add_argument("--decode-attention", default="auto",
                   help="ModelConfig.decode_attention values to compile, comma-separated (auto: the Pallas kernel on a "
                        "GPU; xla: XLA's ops; pallas)")
    d.add_argument("--decode-matmul", default="xla",
                   help="ModelConfig.decode_matmul values to compile, comma-separated (pallas: the products fused with "
                        "their norms and adds, models/decode_matmul.py; with the Pallas attention only)")
    d.add_argument("--xla-options", default="",
                   help="XLA compiler options to compile the step with, as sets separated by '/', each 'none' or "
                        "name=value,...; every set is compiled (and timed) on its own, e.g. "
                        "none/xla_gpu_enable_pdl=true")
    d.add_argument("--top-p", default="1.0",
                   help="the sampler's top_p, comma-separated to compile each (< 1: the nucleus, found without a sort)")
    d.add_argument("--lora-rank", type=int, default=0,
                   help="the step with LoRA adapters of this rank on every projection, applied unmerged as the "
                        "sampler applies them (0: the plain model, which merged adapters give)")
    t = sub.add_parser("train", help="one micro-batch's forward and backward")
    t.add_argument("--target", default="v5e-16")
    t.add_argument("--shape", default="3b", choices=QWEN25_SIZES)
    t.add_argument("--tokens", type=int, default=4544, help="tokens per device (one packed row)")
    t.add_argument("--prompt", type=int, default=448, help="prompt tokens of the sequence (no vocabulary projection)")
    t.add_argument("--remat", action="store_true", help="model.remat (the configs' setting; more FLOPs)")
    t.add_argument("--layers", default="",
                   help="compile an N-layer model of the shape's widths (the whole model does not fit one chip's "
                        "compile as straight-line code); two counts, e.g. 2,4: also the per-layer slope between "
                        "them and the whole model's estimate and MFU by that slope")
    t.add_argument("--top", type=int, default=12, help="TPU: the operations with the most estimated cycles to print")
    t.add_argument("--depth", type=int, default=3, help="TPU: op_name parts that name an operation")
    t.add_argument("--run", action="store_true",
                   help="--target local: also run and time the micro-batch (ms), beside the compiler's FLOPs and bytes")
    return ap.parse_args()


def setup():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from arlopti_jax.aot import targets

    targets.prepare_environment()


def spec(shape, dtype, sharding):
    import jax

    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def decode_state(cfg, mesh, rows: int, prompt: int, response: int, slots: int):
    """The decode loop's carry, abstract, with ``slots`` cache slots, replicated on a 1-device mesh."""
    import jax.numpy as jnp

    from arlopti_jax.runtime import sharding as shd
    from arlopti_jax.rollout.programs import DecodeState

    from arlopti_jax.rollout.programs import per_layer_cache

    rep = shd.replicated(mesh)
    layer = (rows, cfg.num_kv_heads, slots, cfg.head_dim)
    with shd.activate(mesh):
        listed = per_layer_cache()
    buffers = lambda: (tuple(spec(layer, cfg.compute_dtype, rep) for _ in range(cfg.num_layers)) if listed
                       else spec((cfg.num_layers,) + layer, cfg.compute_dtype, rep))
    cache = {"k": buffers(), "v": buffers()}
    i32 = lambda *s: spec(s, jnp.int32, rep)
    return DecodeState(cache=cache, kv_mask=i32(rows, slots), prompt_len=i32(rows), tokens=i32(rows, response),
                       logprobs=spec((rows, response), jnp.float32, rep), mask=i32(rows, response),
                       finished=spec((rows,), jnp.bool_, rep), rows=i32(rows), stop_at=i32(rows),
                       prompt_slots=i32(), step=i32())


def step_scalars(rep) -> tuple:
    """The decode step's key, temperature, top-p and EOS ids, abstract."""
    import jax
    import jax.numpy as jnp

    return (spec((), jax.eval_shape(lambda: jax.random.key(0)).dtype, rep), spec((), jnp.float32, rep),
            spec((), jnp.float32, rep), spec((8,), jnp.int32, rep))


def compile_step(cfg, mesh, params, state, sampling, options: dict | None = None):
    """One decode step (``programs.step``, layers straight-line) compiled for ``mesh``'s devices,
    its state donated (updated in place, as in the decode loop); ``options``: XLA's compiler options."""
    import jax

    from arlopti_jax.runtime import sharding as shd
    from arlopti_jax.rollout import programs

    with shd.activate(mesh):
        step = jax.jit(functools.partial(programs.step, cfg, kernel=sampling.kernel_key, unroll=True),
                       donate_argnums=(1,))
        return step.lower(params, state, *step_scalars(shd.replicated(mesh))).compile(compiler_options=options)


def min_decode_bytes(cfg, rows: int, live_slots: int) -> float:
    """Weights once (bfloat16; the tied embedding read once, as the output projection; an untied
    input embedding only at the rows' tokens) plus the live KV cache once."""
    weights = cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    kv = rows * live_slots * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    return 2.0 * (weights + kv)


def decode(args) -> None:
    setup()
    import itertools

    import jax

    from arlopti_jax.runtime import sharding as shd
    from arlopti_jax.aot import shapes, targets
    from arlopti_jax.models import ModelConfig, abstract_params
    from arlopti_jax.rollout import Sampler, SamplingConfig

    cfg = ModelConfig.from_hf_dict(shapes.qwen25(args.shape), dtype="bfloat16", param_dtype="bfloat16",
                                   lora_rank=args.lora_rank)
    print(f"jax {jax.__version__}; Qwen2.5-{args.shape.upper()} shape ({cfg.num_params() / 1e9:.2f}B), bfloat16, "
          + (f"LoRA rank {args.lora_rank} unmerged, " if args.lora_rank else "") +
          f"prompt {args.prompt} + response {args.response}; compiler figures (compile-only) unless measured\n")
    records = []
    split = lambda text, kind: [kind(v) for v in text.split(",") if v]
    for name, top_p, impl, matmul, options in itertools.product(
            args.targets.split(","), split(args.top_p, float), args.decode_attention.split(","),
            args.decode_matmul.split(","), [parse_options(o) for o in args.xla_options.split("/")]):
        if matmul == "pallas" and impl == "xla":
            continue  # the fused products run in the Pallas attention's steps only
        target = targets.get(name)
        mesh = shd.make_mesh({"fsdp": 1}, devices=list(targets.devices(target))[:1])
        rep = shd.replicated(mesh)
        icfg = cfg.replace(decode_attention=impl, decode_matmul=matmul)  # the step's attention and products
        sampling = SamplingConfig(max_response_len=args.response, temperature=0.7, eos_ids=(0,), top_p=top_p)
        params = jax.tree.map(lambda a: spec(a.shape, a.dtype, rep), abstract_params(cfg))
        sampler = Sampler(icfg, mesh)
        if sampler._cast is not None:  # the sampler's own weights (per layer on a GPU)
            with shd.activate(mesh):
                lowered = sampler._cast.lower(params)
                params = jax.tree.map(lambda i, sh: spec(i.shape, i.dtype, sh), lowered.out_info,
                                      lowered.compile().output_shardings)
        count = target.platform == "gpu" and not args.skip_launches  # a run counts the loop's launches once
        for rows, slots in itertools.product(split(args.rows, int), split(args.slots, int) or
                                             [args.prompt + args.response]):
            line, record = decode_figures(args, icfg, target, mesh, sampler, params, sampling, rows, slots, count,
                                          options)
            count = count and not args.run
            print(line + (f"  [options {options}]" if options else ""), flush=True)
            records.append({**record, "decode_attention": impl, "decode_matmul": matmul, "top_p": top_p,
                            "xla_options": options or {}})
    if args.json:
        Path(args.json).write_text(json.dumps({"jax": jax.__version__, "figures": "compiler's (compile-only) unless "
                                               "measured_ms", "records": records}, indent=1) + "\n")
        print(f"figures written to {args.json}")


def parse_options(text: str) -> dict | None:
    """``--xla-options``' set: None for 'none' or '', else {name: bool, int or string}."""
    if text.strip() in ("", "none"):
        return None
    out = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        low = value.strip().lower()
        out[name.strip()] = (low == "true" if low in ("true", "false") else
                             int(low) if low.lstrip("-").isdigit() else value.strip())
    return out


def decode_figures(args, cfg, target, mesh, sampler, params, sampling, rows: int, slots: int,
                   count: bool, options: dict | None = None) -> tuple[str, dict]:
    """One decode step of ``rows`` x ``slots`` compiled for ``target`` with XLA's compiler ``options``
    (and with ``--run`` timed there): its line and its record. ``count``: also the decode loop's
    launches (GPU)."""
    import jax

    from arlopti_jax.aot import hlo
    from arlopti_jax.runtime import sharding as shd

    rep = shd.replicated(mesh)
    scalars = step_scalars(rep)
    state = decode_state(cfg, mesh, rows, args.prompt, args.response, slots)
    line = (f"{target.name:6s} {cfg.decode_attention:6s} products {cfg.decode_matmul:6s} top_p {sampling.top_p:g} "
            f"rows {rows:4d} "
            f"slots {slots:5d}:")
    minimum = min_decode_bytes(cfg, rows, slots)
    start = time.perf_counter()
    compiled = compile_step(cfg, mesh, params, state, sampling, options)
    seconds = time.perf_counter() - start
    with shd.activate(mesh):
        cost, text = compiled.cost_analysis() or {}, compiled.as_text()
        # GPU: the optimized HLO's traffic, as the compile-only h100 figures count it (a real
        # device's cost analysis, where it gives one, is printed beside it)
        moved = (hlo.Module(text).bytes() if target.platform == "gpu" else
                 cost.get("bytes accessed") or hlo.Module(text).bytes())
        line += f" {moved / 1e9:6.2f} GB per step, minimum {minimum / 1e9:6.2f} GB ({moved / minimum:4.2f}x)"
        record = {"target": target.name, "shape": args.shape, "rows": rows, "slots": slots,
                  "layers": cfg.num_layers, "bytes_per_step": moved, "minimum_bytes": minimum,
                  "bytes_over_minimum": moved / minimum, "compile_s": seconds,
                  "cost_analysis_bytes": cost.get("bytes accessed"), "cost_analysis_flops": cost.get("flops")}
        if target.platform == "gpu" and cost.get("bytes accessed"):
            line += (f" [cost analysis: {cost['bytes accessed'] / 1e9:.2f} GB, "
                     f"{cost.get('flops', 0) / 1e9:.0f} GFLOP]")
        if "optimal_seconds" in cost and target.platform == "tpu":  # a GPU's (-56000 ms on an H200) is no estimate
            roof = minimum / target.hbm_bytes_per_s
            estimate = hlo.tpu_estimate(cost["optimal_seconds"], text)
            record.update(tpu_estimate_ms=estimate * 1e3 if estimate else None, roofline_ms=roof * 1e3)
            line += (f"; estimate {estimate * 1e3:6.2f} ms (raw {cost['optimal_seconds'] * 1e3:.2f}), "
                     f"roofline {roof * 1e3:6.2f} ms ({roof / estimate:.0%})" if estimate else
                     f"; estimate {cost['optimal_seconds'] * 1e3:.2f} ms: negative, unusable")
            remat = text.count(".remat")
            if remat:
                line += f"; XLA rematerialised {remat} ops near the chip's memory"
            line += "; " + layer_slope(cfg, mesh, rows, args, slots, sampling, target)
        if count:
            text, record["launches"] = gpu_launches(sampler, params, state, scalars, sampling, cfg, options)
            line += "; " + text
        if args.run and target.name == "local":
            ms = time_program(compiled, (params, state, *scalars), carry=1, steps=20,
                              fill=live_state(args.prompt, cfg.vocab_size), profile=args.profile)
            bw = target.hbm_bytes_per_s
            line += f"; measured {ms:.2f} ms per step ({moved / ms / 1e6:.0f} GB/s of the compiler's bytes"
            line += (f"; minimum-bytes roofline {minimum / bw * 1e3:.2f} ms: {minimum / bw * 1e3 / ms:.0%})" if bw
                     else ")")
            record.update(measured_ms=ms, device=str(jax.devices()[0].device_kind),
                          roofline_fraction=minimum / bw * 1e3 / ms if bw else None)
    return line + f"  [step compiled in {seconds:.0f} s]", record


def layer_slope(cfg, mesh, rows: int, args, slots: int, sampling, target, layers=(8, 16)) -> str:
    """The step by XLA:TPU's estimate of two shallower straight-line programs of the same widths:
    the per-layer cost is the slope between them, extrapolated to the model's depth. The whole
    model as straight-line code can come near the chip's memory, where XLA rematerialises (one
    layer's scores and cache update recomputed, the cache read again); the layer loop the sampler
    runs on a TPU holds one layer's temporaries and does not."""
    import dataclasses

    import jax

    from arlopti_jax.runtime import sharding as shd
    from arlopti_jax.aot import hlo
    from arlopti_jax.models import abstract_params

    rep = shd.replicated(mesh)
    figures = []
    for n in layers:
        part = dataclasses.replace(cfg, num_layers=n)
        params = jax.tree.map(lambda a: spec(a.shape, a.dtype, rep), abstract_params(part))
        compiled = compile_step(part, mesh, params, decode_state(part, mesh, rows, args.prompt, args.response, slots),
                                sampling)
        cost, text = compiled.cost_analysis() or {}, compiled.as_text()
        figures.append((hlo.tpu_estimate(cost.get("optimal_seconds"), text), cost.get("bytes accessed", 0.0),
                        text.count(".remat")))
    (e0, b0, r0), (e1, b1, r1) = figures
    if not (e0 and e1):
        return "layer slope: no positive estimate"
    more = cfg.num_layers - layers[1]
    estimate, moved = e1 + more * (e1 - e0) / (layers[1] - layers[0]), b1 + more * (b1 - b0) / (layers[1] - layers[0])
    minimum = min_decode_bytes(cfg, rows, slots)
    if moved < minimum:  # the two programs' fixed parts differ (a layout copy in one and not the other)
        return (f"{layers[0]}->{layers[1]}-layer slope unusable: it extrapolates to {moved / 1e9:.2f} GB, below the "
                f"{minimum / 1e9:.2f} GB minimum")
    roof = minimum / target.hbm_bytes_per_s
    return (f"by the {layers[0]}->{layers[1]}-layer slope{' (those rematerialise too)' if r0 or r1 else ''}: "
            f"{moved / 1e9:.2f} GB ({moved / minimum:.2f}x), estimate {estimate * 1e3:.2f} ms ({roof / estimate:.0%} "
            f"of the roofline)")


def time_program(compiled, args, carry: int, steps: int = 5, fill=None, profile: int = 0) -> float:
    """Milliseconds per call of a compiled program on random inputs of its abstract ``args`` (floats
    normal x 0.02, integers 0, a PRNG key: key 0; ``fill(real)`` then sets what the program reads as
    data, such as a decode state's live slots); its output replaces argument ``carry`` (donated) on the
    next call, as in the decode and accumulate loops. ``profile`` N > 0: also print the device's
    kernels over N more calls (``kernel_profile``)."""
    import jax
    import jax.numpy as jnp

    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(args))))

    def real(a):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            value = jax.random.key(0)
        elif jnp.issubdtype(a.dtype, jnp.floating):
            value = (0.02 * jax.random.normal(next(keys), a.shape, jnp.float32)).astype(a.dtype)
        else:
            value = jnp.zeros(a.shape, a.dtype)
        return jax.device_put(value, a.sharding)

    real = list(jax.tree.map(real, args))
    if fill is not None:
        real = fill(real)
    real[carry] = compiled(*real)  # warm up
    jax.block_until_ready(real[carry])
    start = time.perf_counter()
    for _ in range(steps):
        real[carry] = compiled(*real)
    jax.block_until_ready(real[carry])
    ms = (time.perf_counter() - start) / steps * 1e3
    if profile:
        print(kernel_profile(compiled, real, carry, profile, ms), flush=True)
    return ms


def kernel_profile(compiled, real: list, carry: int, calls: int, ms: float, top: int = 14) -> str:
    """The device's kernels over ``calls`` calls (``jax.profiler``'s trace, read from its Perfetto
    JSON): per call, time and count by kernel family (the fusion's name without its number), the
    largest first, and their sum against the call's wall time (the rest: gaps between kernels);
    then the largest kernels by their own names, with their mean time per launch."""
    import glob
    import gzip

    import jax

    from arlopti_jax.aot import hlo

    folder = tempfile.mkdtemp(prefix="profile_")
    try:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(calls):
                real[carry] = compiled(*real)
            jax.block_until_ready(real[carry])
        found = glob.glob(f"{folder}/**/perfetto_trace.json.gz", recursive=True)
        if not found:
            return "profile: no trace written"
        trace = json.load(gzip.open(found[0]))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in names.items() if "GPU" in name or "/device:" in name}
    if not device:  # a CPU: the host's XLA ops
        device = set(names)
    families: dict[str, list[float]] = {}
    kernels: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device and not str(e.get("name", "")).startswith(("$", "Thunk")):
            dur = float(e.get("dur", 0.0)) / 1e3  # ms
            families.setdefault(hlo.family(str(e["name"])), []).append(dur)
            kernels.setdefault(str(e["name"]), []).append(dur)
    if not families:
        return "profile: no device events in the trace"
    total = sum(sum(v) for v in families.values()) / calls
    lines = [f"profile over {calls} calls: kernels {total:.3f} ms of the {ms:.3f} ms call "
             f"({total / ms:.0%}); by family, per call:"]
    for family, durs in sorted(families.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"  {sum(durs) / calls:8.3f} ms  {len(durs) / calls:6.1f} kernels  {family}")
    # a layer's kernels keep their fusion's name in every layer (roofline's "one layer's" line): each
    # of a layer's products and fusions apart, with its mean time per launch
    lines.append("by kernel, per call (the largest):")
    for name, durs in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"  {sum(durs) / calls:8.3f} ms  {len(durs) / calls:6.1f} x {sum(durs) / len(durs) * 1e3:7.1f} us"
                     f"  {name}")
    return "\n".join(lines)


def live_state(prompt: int, vocab: int):
    """``time_program``'s ``fill`` for a decode step: every cache slot live (prompts of ``prompt``
    tokens, then responses up to the last slot, which this step writes), the cache random, no row
    finished, tokens drawn from the vocabulary."""
    import jax
    import jax.numpy as jnp

    def fill(real):
        state = real[1]
        rows, slots = state.kv_mask.shape
        put = lambda value, like: jax.device_put(jnp.asarray(value, like.dtype).reshape(like.shape), like.sharding)
        tokens = jax.random.randint(jax.random.key(2), state.tokens.shape, 0, vocab)
        cache = jax.tree.map(lambda c: put(jax.random.normal(jax.random.key(3), c.shape, jnp.float32), c), state.cache)
        real[1] = state._replace(
            cache=cache, kv_mask=put(jnp.ones((rows, slots)), state.kv_mask),
            prompt_len=put(jnp.full((rows,), prompt), state.prompt_len), tokens=put(tokens, state.tokens),
            finished=put(jnp.zeros(rows, bool), state.finished), rows=put(jnp.arange(rows), state.rows),
            stop_at=put(jnp.full((rows,), state.tokens.shape[1] + 1), state.stop_at),
            prompt_slots=put(prompt, state.prompt_slots), step=put(slots - prompt, state.step))
        return real

    return fill


def gpu_launches(sampler, params, state, scalars, sampling, cfg, options: dict | None = None) -> tuple[str, dict]:
    """Launches per layer and per step of the decode loop that runs, from the thunk sequence: the
    line, and the counts (``step``: outside the layer loop; ``layer``: one layer's, None when the
    layers are not a loop; ``kernels_per_layer``: all the step's kernels over the layers when they
    are not a loop; ``layer_kernels``: one layer's kernels in order, by fusion name)."""
    import jax.numpy as jnp

    from arlopti_jax.aot import hlo
    from arlopti_jax.runtime import sharding as shd

    folder = tempfile.mkdtemp(prefix="roofline_")
    try:
        compact = spec((), jnp.int32, shd.replicated(sampler.mesh))
        sampler._decode.lower(params, state, *scalars, compact, kernel=sampling.kernel_key).compile(
            compiler_options={**(options or {}), "xla_dump_to": folder, "xla_dump_hlo_pass_re": "^$"})
        text = hlo.read_dump(Path(folder), "decode")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    bodies = hlo.while_bodies(hlo.parse_thunks(text))
    step, layer = hlo.launches(bodies[0]), hlo.launches(bodies[1]) if len(bodies) > 1 else None
    fmt = lambda x: (f"{x['kernels']} kernels + {x['command_buffers']} command buffers "
                     f"({x['kernels_in_command_buffers']} kernels in them)")
    out = f"launches per step outside the layer loop: {fmt(step)}"
    counts = {"step": step, "layer": layer}
    if layer is not None:
        out += f"; per layer ({cfg.num_layers}): {fmt(layer)}"
        counts["layer_kernels"] = hlo.kernel_names(bodies[1])
    else:
        counts["kernels_per_layer"] = (step["kernels"] + step["kernels_in_command_buffers"]) / cfg.num_layers
        out += f" (about {counts['kernels_per_layer']:.1f} per layer)"
        counts["layer_kernels"] = hlo.layer_kernels(hlo.kernel_names(bodies[0]), cfg.num_layers)
    if counts["layer_kernels"]:
        out += f"; one layer's {len(counts['layer_kernels'])}: {', '.join(counts['layer_kernels'])}"
    return out, counts


def train(args) -> None:
    setup()
    from arlopti_jax.runtime import sharding as shd
    from arlopti_jax.aot import shapes, targets
    from arlopti_jax.models import ModelConfig

    target = targets.get(args.target)
    mesh = shd.make_mesh({"fsdp": -1}, devices=list(targets.devices(target)))
    devices = shd.batch_divisor(mesh)
    full = ModelConfig.from_hf_dict(shapes.qwen25(args.shape), dtype="bfloat16", param_dtype="float32",
                                    remat=args.remat, unroll_layers=True)
    counts = [int(n) for n in args.layers.split(",") if n] or [full.num_layers]
    if len(counts) > 2 or (len(counts) == 2 and counts[0] >= counts[1]):
        sys.exit(f"--layers {args.layers}: one count, or two increasing counts for the slope")
    results = [train_program(args, dataclasses.replace(full, num_layers=n), target, mesh, devices) for n in counts]
    if len(counts) == 2:
        (e0, m0), (e1, m1) = results
        slope, more = (e1 - e0) / (counts[1] - counts[0]), full.num_layers - counts[1]
        estimate, model = e1 + more * slope, m1 + more * (m1 - m0) / (counts[1] - counts[0])
        print(f"by the {counts[0]}->{counts[1]}-layer slope: {slope * 1e3:.1f} ms per layer; the whole "
              f"{full.num_layers}-layer model {estimate * 1e3:.0f} ms for {model / 1e12:.1f} TFLOP per device -> MFU "
              f"{model / (estimate * target.peak_flops):.1%} (compiler figures, extrapolated)")


def compile_accumulate(step, mesh, params, host: dict):
    """``step._accumulate`` (a ``TrainStep``) compiled for abstract ``params`` and the abstract
    micro-batch of ``host`` (``packing.gather``'s arrays, row-sharded): (compiled, its abstract
    arguments, compile seconds)."""
    import jax

    from arlopti_jax.runtime import sharding as shd

    mb = {k: spec(v.shape, v.dtype, step.row_sharding) for k, v in host.items()}
    with shd.activate(mesh):
        acc = jax.eval_shape(step._zeros, params)
        acc = jax.tree.map(lambda a, s: spec(a.shape, a.dtype, s), acc, step._zeros.lower(params).compile()
                           .output_shardings)
        start = time.perf_counter()
        compiled = step._accumulate.lower(params, {}, acc, mb).compile()  # no frozen part: no LoRA here
    return compiled, (params, {}, acc, mb), time.perf_counter() - start


def train_program(args, cfg, target, mesh, devices) -> tuple[float, float]:
    """Compile one micro-batch of ``cfg`` for ``target`` and print its figures; returns (the
    compiler's estimate in seconds or nan, model FLOPs per device)."""
    import jax
    import numpy as np

    from arlopti_jax import algos
    from arlopti_jax.algos import packing
    from arlopti_jax.aot import hlo
    from arlopti_jax.models import abstract_params, param_shardings
    from arlopti_jax.models import policy

    step = algos.make_train_step(cfg, algos.LossConfig(kl_coef=0.0), algos.make_optimizer(algos.OptimConfig()), mesh,
                                 tokens_per_device=args.tokens, chunk_size=args.tokens)
    params = jax.tree.map(lambda a, s: spec(a.shape, a.dtype, s), abstract_params(cfg), param_shardings(cfg, mesh))
    attention = np.ones((devices, args.tokens), np.int32)
    response = np.zeros_like(attention)
    response[:, args.prompt:] = 1
    plan = step.plan({"attention_mask": attention, "response_mask": response, "input_ids": attention},
                     np.arange(devices))
    floats = np.zeros(attention.shape, np.float32)
    host = packing.gather(plan[0], {"input_ids": attention}, {
        "old_logprobs": floats, "advantages": floats, "loss_mask": response, "response_mask": response,
        "agg_weight": floats, "target_ids": attention})
    old = policy.DIRECT_LOGITS_BYTES
    policy.DIRECT_LOGITS_BYTES = 1 << 62  # the vocabulary projection in one piece: a loop-free program
    try:
        compiled, (params, frozen, acc, mb), seconds = compile_accumulate(step, mesh, params, host)
    finally:
        policy.DIRECT_LOGITS_BYTES = old
    cost = compiled.cost_analysis() or {}
    tokens = args.tokens
    targets_per_device = tokens - args.prompt
    d, layers = cfg.hidden_size, cfg.num_layers
    body = cfg.num_params() - cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2)
    model = 6 * body * tokens + 6 * cfg.vocab_size * d * targets_per_device  # matmuls: 2 forward + 4 backward
    model += 6 * layers * cfg.num_heads * cfg.head_dim * tokens * tokens  # causal attention: half of 4 T^2 per head
    estimate = hlo.tpu_estimate(cost.get("optimal_seconds"), compiled.as_text())
    mfu = model / (estimate * target.peak_flops) if estimate else float("nan")
    print(f"jax {jax.__version__}; {target.label}; Qwen2.5-{args.shape.upper()} shape, fsdp={devices}, remat "
          f"{args.remat}; one {tokens}-token sequence per device ({targets_per_device} response targets); compiler "
          f"figures (compile-only), not a run")
    print(f"compiled in {seconds:.0f} s; compiler: {cost.get('flops', 0) / 1e12:.1f} TFLOP executed, "
          f"{cost.get('bytes accessed', 0) / 1e9:.1f} GB, estimate {(estimate or float('nan')) * 1e3:.0f} ms (raw "
          f"{cost.get('optimal_seconds', 0) * 1e3:.0f}); "
          f"model {model / 1e12:.1f} TFLOP per device -> MFU {mfu:.1%} of {target.peak_flops / 1e12:.0f} TFLOP/s")
    cycles = hlo.tpu_cycles_by_op(compiled.as_text(), depth=args.depth)
    if cycles:  # XLA:TPU's per-kernel cost model, by the operation that made each kernel
        total = sum(cycles.values())
        print("where the estimate goes (XLA:TPU's estimated cycles per kernel, by source operation):")
        for name, n in list(cycles.items())[:args.top]:
            print(f"  {n / total:6.1%}  {name}")
    if args.run and target.name == "local":
        counted = hlo.Module(compiled.as_text()).bytes()
        moved = cost.get("bytes accessed") or counted
        print(f"optimized HLO traffic {counted / 1e9:.1f} GB; cost analysis "
              f"{cost.get('bytes accessed', 0) / 1e9:.1f} GB")
        ms = time_program(compiled, (params, frozen, acc, mb), carry=2)
        peak = target.peak_flops or float("nan")
        bw = target.hbm_bytes_per_s
        floor = max(cost.get("flops", 0) / peak, moved / bw if bw else 0.0)
        print(f"measured {ms:.1f} ms per micro-batch on {target.topology}: model FLOPs -> MFU "
              f"{model / (ms / 1e3) / peak:.1%}; the compiler's {cost.get('flops', 0) / 1e12:.1f} TFLOP and "
              f"{moved / 1e9:.1f} GB at peak would take {floor * 1e3:.1f} ms (measured / that = "
              f"{ms / 1e3 / floor:.2f})")
    return estimate or float("nan"), model


def main():
    args = parse_args()
    {"decode": decode, "train": train}[args.what](args)


if __name__ == "__main__":
    main()
