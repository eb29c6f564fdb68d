"""Rollout throughput: our sampler vs transformers' ``generate``, and the dense vs the
length-aware sampler, each pair timed in interleaved rounds of one run.

    python bench/rollout.py --vocab 4096          # the tiny shape: 32 prompts x 64 tokens, 128 new, T=1
    python bench/rollout.py --lengths lognormal --batch 64 --group 8 --prompt-len 128 --gen-len 1024
    python bench/rollout.py --shape 1.5b --batch 64 --prompt-len 256 --gen-len 512 --dtype bfloat16

--lengths fixed (default): both sides generate exactly --gen-len tokens per sequence (ours:
no EOS ids; transformers: min_new_tokens = max_new_tokens), sampling at temperature 1 from the
full distribution (or --greedy). Each round times ours, then transformers; the script prints
every round, the medians and ours / transformers. Tokens/s counts generated tokens, the
prompts' prefill included in the time. On a GPU it also prints the decode steps' fraction of
the memory-bandwidth roofline: bytes per decode step = parameter bytes + the KV cache bytes a
step must read (the average context, prompt + gen/2, per sequence), over the decode-step time.

--lengths lognormal: a realistic-length workload on the random model. Responses end with an
EOS forced (``Sampler.generate``'s ``stop_at``) at lengths drawn by ``response_lengths``
(log-normal around --median-len, a share --at-max running to --gen-len); a sampled EOS may
end one sooner. Each round times the dense sampler (``length_aware=False``) and the
length-aware one on the same rollout (same key), and checks that their tokens agree. Tokens/s
counts the responses' real tokens.

Compilation: our first call's time (trace + compile) is printed, the script asserts that no
program compiles after the warm-up calls, and that the decode loops compiled stay within the
documented buckets (cache phases x rows-per-device buckets).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory for torch
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch's spinning threads starve XLA's on a shared CPU

import jax  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
from arlopti_jax.models import load_pretrained  # noqa: E402
from arlopti_jax.rollout import Sampler, SamplingConfig  # noqa: E402
from arlopti_jax.runtime import sharding as shd  # noqa: E402
from common import interleaved, timed  # noqa: E402

EOS = 2  # the random model's EOS id (common.hf_model)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shape_flags(p)
    p.add_argument("--batch", type=int, default=32, help="generated sequences per call")
    p.add_argument("--group", type=int, default=1, help="samples per prompt (batch / group prompts)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=128, help="response tokens (the maximum with --lengths lognormal)")
    p.add_argument("--lengths", choices=("fixed", "lognormal"), default="fixed")
    p.add_argument("--median-len", type=int, help="lognormal: median response length (default gen-len / 4)")
    p.add_argument("--sigma", type=float, default=0.6, help="lognormal: sigma of log(length)")
    p.add_argument("--at-max", type=float, default=0.05, help="lognormal: share of responses running to gen-len")
    p.add_argument("--phase-tokens", type=int, default=SamplingConfig.phase_tokens,
                   help="length-aware: response slots of the first phase (0: gen-len / 4)")
    p.add_argument("--min-rows", type=int, default=SamplingConfig.min_rows,
                   help="length-aware: rows per device below which no compaction")
    p.add_argument("--dense", action="store_true", help="fixed lengths: time the dense sampler (length_aware=False)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="auto: float32 on CPU, bfloat16 on accelerators")
    p.add_argument("--greedy", action="store_true", help="argmax decoding on both sides")
    p.add_argument("--rounds", "--iters", type=int, default=3,
                   help="timed rounds (after one warm-up call per side); --iters: its older name")
    p.add_argument("--peak-bw", type=float, help="peak memory bandwidth in GB/s (default: table by device)")
    p.add_argument("--skip-hf", action="store_true", help="fixed lengths: time ours only")
    p.add_argument("--decode-attention", default="auto",
                   help="fixed lengths: ModelConfig.decode_attention of ours, comma-separated to time each in the same "
                        "interleaved rounds (e.g. xla,pallas)")
    p.add_argument("--hf-device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.batch % args.group:
        p.error(f"--batch={args.batch} must be a multiple of --group={args.group}")
    try:
        dims = common.shape_dims(args)
    except ValueError as err:
        p.error(str(err))
    on_cpu = jax.default_backend() == "cpu"
    args.dtype = ("float32" if on_cpu else "bfloat16") if args.dtype == "auto" else args.dtype
    args.median_len = args.median_len or max(1, args.gen_len // 4)
    return args, dims


def response_lengths(rng: np.random.Generator, rows: int, max_len: int, median: int, sigma: float = 0.6,
                     at_max: float = 0.05) -> np.ndarray:
    """``stop_at`` for ``Sampler.generate``: log-normal response lengths (EOS included) around
    ``median``, clipped to [1, max_len], with a share ``at_max`` of the rows never forced
    (value max_len + 1: they run to max_len, truncated, unless they sample an EOS)."""
    lengths = np.clip(np.rint(rng.lognormal(np.log(median), sigma, rows)), 1, max_len).astype(np.int32)
    lengths[rng.random(rows) < at_max] = max_len + 1
    return lengths


class Ours:
    def __init__(self, folder: Path, args, decode_attention: str = "auto"):
        self.mesh = shd.make_mesh({"fsdp": -1})
        self.cfg, self.params = load_pretrained(folder, mesh=self.mesh, dtype=args.dtype, param_dtype=args.dtype,
                                                decode_attention=decode_attention)
        self.sampler = Sampler(self.cfg, self.mesh)
        self.key = jax.random.key(args.seed)

    def sampling(self, args, length_aware: bool) -> SamplingConfig:
        return SamplingConfig(max_response_len=args.gen_len, greedy=args.greedy,
                              eos_ids=(EOS,) if args.lengths == "lognormal" else (),
                              prompt_bucket=max(64, args.prompt_len), batch_bucket=args.batch // args.group,
                              length_aware=length_aware, phase_tokens=args.phase_tokens, min_rows=args.min_rows)

    def generate(self, prompts, group: int, sampling: SamplingConfig, stop_at=None):
        return self.sampler.generate(self.params, prompts, group, self.key, sampling, stop_at=stop_at)

    def split(self, prompts, group: int, sampling: SamplingConfig) -> tuple[float, float]:
        """(prefill + first token, the rest) seconds of one call, with the weights ``generate``
        gives its programs (``sampling_params``: per layer on a GPU), made before the clock starts."""
        batch = self.sampler.pad_prompts(prompts, sampling)
        params = jax.block_until_ready(self.sampler.sampling_params(self.params))
        t0 = time.perf_counter()
        state = jax.block_until_ready(self.sampler.start(params, batch, group, self.key, sampling))
        t1 = time.perf_counter()
        np.asarray(self.sampler.decode(params, state, self.key, sampling).tokens)
        return t1 - t0, time.perf_counter() - t1

    def decode_bound(self, sampling: SamplingConfig, rows_per_device: int) -> int:
        """Decode loops the sampler may compile: cache phases x rows-per-device buckets (the
        batch's own, then powers of two down to min_rows)."""
        buckets, rows = 1, rows_per_device
        while sampling.length_aware and rows > 1:
            rows = 1 << ((rows - 1).bit_length() - 1)
            if rows < sampling.min_rows:
                break
            buckets += 1
        return len(sampling.phase_ends()) * buckets


class Transformers:
    def __init__(self, model, args, prompts):
        import torch

        self.device = args.hf_device if args.hf_device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = model.to(self.device).eval()
        self.ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        self.kw = dict(attention_mask=torch.ones_like(self.ids), max_new_tokens=args.gen_len,
                       min_new_tokens=args.gen_len, pad_token_id=0, eos_token_id=EOS, num_return_sequences=args.group)
        self.kw.update(dict(do_sample=False) if args.greedy else dict(do_sample=True, temperature=1.0, top_k=0,
                                                                      top_p=1.0))

    def generate(self):
        import torch

        with torch.no_grad():
            out = self.model.generate(self.ids, **self.kw)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return out


def peak_bandwidth(device, flag_gbs):
    if flag_gbs:
        return flag_gbs * 1e9
    from arlopti_jax.aot.targets import hbm_bandwidth

    return hbm_bandwidth(getattr(device, "device_kind", ""))


def main(argv=None):
    args, dims = parse_args(argv)
    compiles = common.count_compiles()
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(3, dims["vocab"], size=(args.batch // args.group, args.prompt_len)).tolist()
    model = common.hf_model(dims, args.dtype, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        impls = args.decode_attention.split(",")
        versions = {impl: Ours(Path(tmp), args, impl) for impl in impls}
        ours = versions[impls[0]]
    dev = jax.devices()[0]
    print(f"model: hidden={dims['hidden']} layers={dims['layers']} heads={dims['heads']} "
          f"kv_heads={dims['kv_heads']} intermediate={dims['intermediate']} vocab={dims['vocab']} "
          f"params={ours.cfg.num_params() / 1e6:.1f}M dtype={args.dtype}")
    print(f"run: batch={args.batch} ({args.batch // args.group} prompts x {args.group}) prompt_len={args.prompt_len} "
          f"gen_len={args.gen_len} lengths={args.lengths} {'greedy' if args.greedy else 'sampling T=1'} "
          f"device={dev.device_kind} x{jax.device_count()}; jax {jax.__version__}")
    rows_per_device = args.batch // shd.batch_divisor(ours.mesh)

    if args.lengths == "lognormal":
        stop_at = response_lengths(rng, args.batch, args.gen_len, args.median_len, args.sigma, args.at_max)
        configs = {"dense": ours.sampling(args, False), "length-aware": ours.sampling(args, True)}
        for name, sampling in configs.items():
            before = compiles.count
            t, roll = timed(ours.generate, prompts, args.group, sampling, stop_at)
            print(f"{name}: first call (trace + compile) {t:.1f}s, {compiles.count - before} compilations", flush=True)
        real = int(roll.lengths.sum())
        print(f"responses: {real} real tokens of {args.batch * args.gen_len} slots "
              f"({real / (args.batch * args.gen_len):.0%}); lengths median {int(np.median(roll.lengths))}, "
              f"max {roll.lengths.max()}, {roll.truncated.sum()} truncated")
        batch = ours.sampler.pad_prompts(prompts, configs["length-aware"])
        params = ours.sampler.sampling_params(ours.params)  # generate's weights: its compiled programs serve
        done = ours.sampler.decode(params, ours.sampler.start(params, batch, args.group, ours.key,
                                                              configs["length-aware"], stop_at),
                                   ours.key, configs["length-aware"])
        print("length-aware loops (rows per device, cache slots, step reached): " +
              " ".join(f"({r}, {s}, {t})" for r, s, t in done.loops))
        warm = compiles.count
        results = {}

        def side(name):
            def run():
                results[name] = ours.generate(prompts, args.group, configs[name], stop_at)
                return results[name]
            return run

        times = interleaved({name: side(name) for name in configs}, args.rounds, lambda out: out.lengths.sum())
        a, b = results["dense"], results["length-aware"]
        same = np.array_equal(a.response_ids, b.response_ids) and np.allclose(a.logprobs, b.logprobs, atol=1e-4)
        print(f"dense and length-aware tokens and log-probs agree: {same}")
        assert compiles.count == warm, f"{compiles.count - warm} compilations after the warm-up"
        bound = ours.decode_bound(configs["length-aware"], rows_per_device)
        assert ours.sampler._decode._cache_size() <= bound + 1, (ours.sampler._decode._cache_size(), bound)
        med = {name: statistics.median(t) for name, t in times.items()}
        print("\nmedians (one interleaved run):\n| sampler | s/rollout | real tokens/s |\n|---|---|---|")
        for name, t in med.items():
            print(f"| {name} | {t:.2f} | {real / t:,.0f} |")
        print(f"length-aware / dense speed: {med['dense'] / med['length-aware']:.2f}x; no compilation after "
              f"the warm-up; decode programs {ours.sampler._decode._cache_size()} (bound: {bound} + the dense one)")
        return

    sampling = ours.sampling(args, not args.dense)
    names = {impl: "ours" if len(versions) == 1 else f"ours ({impl})" for impl in versions}
    sides, step = {}, None
    for impl, version in versions.items():
        before = compiles.count
        t, roll = timed(version.generate, prompts, args.group, sampling)
        assert roll.response_ids.shape == (args.batch, args.gen_len) and roll.lengths.min() == args.gen_len
        print(f"{names[impl]}: first call (trace + compile) {t:.1f}s, {compiles.count - before} compilations",
              flush=True)
        prefill, decode = version.split(prompts, args.group, sampling)
        step = step or decode / max(1, args.gen_len - 1)  # the first version's, for the roofline line
        print(f"{names[impl]}: prefill + first token {prefill * 1e3:.1f} ms, decode step "
              f"{decode / max(1, args.gen_len - 1) * 1e3:.2f} ms", flush=True)
        sides[names[impl]] = lambda version=version: version.generate(prompts, args.group, sampling)
    if not args.skip_hf:
        hf = Transformers(model, args, prompts)
        hf.generate()  # warm-up
        sides["transformers"] = hf.generate
    warm = compiles.count
    times = interleaved(sides, args.rounds, lambda out: args.batch * args.gen_len)
    assert compiles.count == warm, f"{compiles.count - warm} compilations after the warm-up"
    programs, bound = ours.sampler._decode._cache_size(), ours.decode_bound(sampling, rows_per_device)
    assert programs <= bound, f"{programs} decode programs compiled, more than the {bound} the sampler may make"
    generated = args.batch * args.gen_len
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"\nmedians (one interleaved run; {names[impls[0]]}: decode step {step * 1e3:.2f} ms):")
    print("| implementation | s/rollout | tokens/s |\n|---|---|---|")
    for name, t in med.items():
        print(f"| {name} | {t:.3f} | {generated / t:,.0f} |")
    if "transformers" in med:
        first = names[impls[0]]
        print(f"{first} / transformers: {med['transformers'] / med[first]:.2f}x; no compilation after the warm-up")
    if len(versions) > 1:
        first = med[names[impls[0]]]
        print("; ".join(f"{name}: {first / t:.2f}x the speed of {names[impls[0]]}" for name, t in med.items()
                        if name.startswith("ours (") and name != names[impls[0]]))
    if dev.platform == "cpu":
        print("roofline: skipped on CPU")
        return
    param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(ours.params))
    itemsize = np.dtype(ours.cfg.compute_dtype).itemsize
    ctx = args.prompt_len + args.gen_len / 2
    kv_bytes = 2 * ours.cfg.num_layers * args.batch * ctx * ours.cfg.num_kv_heads * ours.cfg.head_dim * itemsize
    achieved = (param_bytes + kv_bytes) / step
    peak = peak_bandwidth(dev, args.peak_bw)
    frac = f"{achieved / peak:.1%} of {peak / 1e9:.0f} GB/s" if peak else "peak unknown (pass --peak-bw)"
    print(f"roofline: {(param_bytes + kv_bytes) / 1e6:.1f} MB/decode step (params {param_bytes / 1e6:.1f} MB + "
          f"KV {kv_bytes / 1e6:.1f} MB) -> {achieved / 1e9:.0f} GB/s = {frac}")


if __name__ == "__main__":
    main()
