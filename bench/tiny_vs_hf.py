"""The tiny-shape comparison with transformers, interleaved in one run (CPU).

    python bench/tiny_vs_hf.py [--rounds 3] [--skip-rollout] [--floor]

One tiny Qwen2 (vocabulary 4096, hidden 256, 4 layers, 4 heads / 2 KV heads, ffn 1024, tied
embeddings), the same weights on both sides (ours exported with ``save_pretrained`` and
loaded by transformers), two workloads:

  train step  one GRPO update on 32 sequences of 64 prompt + 128 response tokens (no
              padding): PPO clipped loss + k3 KL, gradient clipping, AdamW; micro-batches of
              8 sequences on both sides (ours: packed micro-batches of 8 x 192 tokens);
  rollout     32 prompts x 64 tokens, 128 new tokens each, temperature 1, no EOS.

Each round times ours then transformers on both workloads (after a warm-up call each);
the script prints each round and the medians, tokens/s and ours / transformers. Tokens are
all the tokens through the model (train) or generated tokens (rollout). It also reports our
compile times and asserts that nothing recompiles after the warm-up.

--floor also times, in the same rounds, the matrix products alone of our train step (every
GEMM of its forward and backward at its shapes, nothing else: no attention mask or softmax,
no normalisation, activation or optimizer), once in torch (MKL) and once in XLA. That is a
lower bound on the time of any implementation doing our step's arithmetic on this machine; the
script prints transformers' step over it, the most ours / transformers could reach here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch's spinning threads starve XLA's on a shared CPU
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import common  # noqa: E402

DIMS = common.SHAPES["bench"]
ROWS, PROMPT, RESPONSE, MICRO = 32, 64, 128, 8


def train_workload(seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    t = PROMPT + RESPONSE
    ids = rng.integers(3, DIMS["vocab"], (ROWS, t)).astype(np.int32)
    attn = np.ones((ROWS, t), np.int32)
    resp = np.zeros((ROWS, t), np.float32)
    resp[:, PROMPT:] = 1
    old = np.where(resp > 0, np.log(rng.uniform(0.05, 1, (ROWS, t))), 0).astype(np.float32)
    ref = np.where(resp > 0, old + rng.normal(0, 0.1, (ROWS, t)), 0).astype(np.float32)
    adv = np.where(resp > 0, rng.normal(0, 1, (ROWS, 1)), 0).astype(np.float32)
    return dict(input_ids=ids, attention_mask=attn, response_mask=resp, old_logprobs=old, ref_logprobs=ref,
                advantages=adv, loss_mask=resp)


class Ours:
    def __init__(self, folder: Path):
        import jax

        from arlopti_jax import algos
        from arlopti_jax.runtime import sharding as shd
        from arlopti_jax.models import load_pretrained
        from arlopti_jax.rollout import Sampler, SamplingConfig

        self.mesh = shd.make_mesh({"fsdp": -1})
        self.cfg, self.params = load_pretrained(folder, mesh=self.mesh, dtype="float32", param_dtype="float32",
                                                unroll_layers=True)
        self.opt = algos.make_optimizer(algos.OptimConfig(lr=1e-5))
        self.opt_state = algos.init_opt_state(self.opt, self.cfg, self.params, self.mesh)
        budget = MICRO * (PROMPT + RESPONSE)
        self.step = algos.make_train_step(self.cfg, algos.LossConfig(kl_coef=0.001), self.opt, self.mesh,
                                          tokens_per_device=budget,  # the trainer's shape set (run_setup.pack_shapes)
                                          shapes=algos.packing.shapes_for(budget, PROMPT + RESPONSE))
        self.sampler = Sampler(self.cfg, self.mesh)
        self.sampling = SamplingConfig(max_response_len=RESPONSE, temperature=1.0)
        self.key = jax.random.key(0)

    def train(self, batch):
        import jax

        self.params, self.opt_state, metrics = self.step(self.params, self.opt_state, batch)
        jax.block_until_ready(metrics)

    def rollout(self, prompts):
        return self.sampler.generate(self.params, prompts, 1, self.key, self.sampling)


class Transformers:
    def __init__(self, folder: Path):
        import torch
        import transformers

        torch.manual_seed(0)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, weight_decay=0.01)

    def train(self, batch):
        self.model.train()
        common.torch_minibatch_step(self.model, self.opt, common.torch_batch(batch), ROWS // MICRO)

    def rollout(self, prompts):
        import torch

        self.model.eval()
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.no_grad():
            return self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                       top_p=1.0, top_k=0, max_new_tokens=RESPONSE, min_new_tokens=RESPONSE,
                                       pad_token_id=0)


def step_gemms() -> list[tuple[int, int, int, int]]:
    """(batch, m, k, n) of every matrix product of our tiny train step (forward and backward, all
    micro-batches): y = x @ W needs dx = dy @ W^T and dW = x^T @ dy; attention per (row, head)."""
    n, d, f, v = MICRO * (PROMPT + RESPONSE), DIMS["hidden"], DIMS["intermediate"], DIMS["vocab"]
    hd = d // DIMS["heads"]
    dense = [(d, d), (d, hd * DIMS["kv_heads"]), (d, hd * DIMS["kv_heads"]), (d, d), (d, f), (d, f), (f, d)]
    targets, rows, t = MICRO * RESPONSE, MICRO * DIMS["heads"], PROMPT + RESPONSE
    per_layer = [g for (i, o) in dense for g in ((1, n, i, o), (1, n, o, i), (1, i, n, o))]
    per_layer += [(rows, t, hd, t)] * 2 + [(rows, t, t, hd)] * 4  # scores, dP; P @ V, dV, dQ, dK
    head = [(1, targets, d, v), (1, targets, v, d), (1, v, targets, d)]
    return (per_layer * DIMS["layers"] + head) * (ROWS // MICRO)


class GemmFloor:
    """The step's matrix products alone (``step_gemms``), in torch or in XLA."""

    def __init__(self, side: str):
        import numpy as np

        rng = np.random.default_rng(0)
        gemms = step_gemms()
        self.shapes = shapes = sorted(set(gemms))
        self.counts = [gemms.count(s) for s in shapes]
        arrays = [(rng.standard_normal((b, m, k), np.float32), rng.standard_normal((b, k, n), np.float32))
                  for b, m, k, n in shapes]
        self.flop = sum(2 * b * m * k * n * c for (b, m, k, n), c in zip(shapes, self.counts))
        if side == "torch":
            import torch

            self.arrays = [(torch.from_numpy(a), torch.from_numpy(b)) for a, b in arrays]
            self.run, self._product = self._torch, lambda i: torch.bmm(*self.arrays[i])
        else:
            import jax
            import jax.numpy as jnp

            self.arrays = [(jnp.asarray(a), jnp.asarray(b)) for a, b in arrays]
            self.matmul = jax.jit(jnp.matmul)
            self.run, self._product = self._xla, lambda i: jax.block_until_ready(self.matmul(*self.arrays[i]))

    def by_shape(self, reps: int = 7) -> list[float]:
        """Median seconds of one call of each shape (the order of ``self.shapes``)."""
        out = []
        for i in range(len(self.shapes)):
            one = [timed(self._product, i) for _ in range(reps)]
            out.append(statistics.median(one))
        return out

    def _torch(self):
        import torch

        with torch.no_grad():
            for (a, b), c in zip(self.arrays, self.counts):
                for _ in range(c):
                    torch.bmm(a, b)

    def _xla(self):
        import jax

        for (a, b), c in zip(self.arrays, self.counts):
            for _ in range(c):
                jax.block_until_ready(self.matmul(a, b))


def timed(fn, *args) -> float:
    return common.timed(fn, *args)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-rollout", action="store_true")
    ap.add_argument("--floor", action="store_true", help="also time the step's matrix products alone (see above)")
    args = ap.parse_args(argv)

    import jax
    import numpy as np
    import torch

    from arlopti_jax.runtime import sharding as shd
    from arlopti_jax.models import init_params, save_pretrained

    compiles = common.count_compiles()
    folder = Path(tempfile.mkdtemp(prefix="tiny_vs_hf_"))
    cfg = common.model_config(DIMS).replace(eos_token_id=2, bos_token_id=1)
    save_pretrained(cfg, init_params(cfg, jax.random.key(0), shd.make_mesh({"fsdp": -1})), folder)
    ours, hf = Ours(folder), Transformers(folder)
    floors = {side: GemmFloor(side) for side in ("torch", "xla")} if args.floor else {}
    for floor in floors.values():
        floor.run()  # warm-up (XLA compiles one program per shape)
    batch = train_workload()
    prompts = np.random.default_rng(1).integers(3, DIMS["vocab"], (ROWS, PROMPT)).tolist()
    workloads = {"train step": ("train", batch, ROWS * (PROMPT + RESPONSE))}
    if not args.skip_rollout:
        workloads["rollout"] = ("rollout", prompts, ROWS * RESPONSE)

    print(f"jax {jax.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"{os.cpu_count()} CPUs; tiny Qwen2 {DIMS}")
    for name, (method, data, _) in workloads.items():
        before = compiles.count
        first = timed(getattr(ours, method), data)
        print(f"{name}: ours first call (trace + compile) {first:.2f}s, {compiles.count - before} compilations")
        getattr(hf, method)(data)  # warm-up
    warm = compiles.count
    times = {name: {"ours": [], "transformers": []} for name in workloads}
    for r in range(args.rounds):
        for name, (method, data, tokens) in workloads.items():
            for side, impl in (("ours", ours), ("transformers", hf)):
                times[name][side].append(timed(getattr(impl, method), data))
            o, t = times[name]["ours"][-1], times[name]["transformers"][-1]
            print(f"round {r + 1} {name}: ours {o:.3f}s, transformers {t:.3f}s, ratio {t / o:.2f}")
            if name == "train step" and floors:
                for side, floor in floors.items():
                    times.setdefault(f"gemms {side}", []).append(timed(floor.run))
                print("  the step's matrix products alone: " + ", ".join(
                    f"{side} {times[f'gemms {side}'][-1]:.3f}s" for side in floors))
    assert compiles.count == warm, f"{compiles.count - warm} compilations after the warm-up"
    print("\nmedians (one interleaved run):")
    print("| workload | transformers tok/s | ours tok/s | ours / transformers |\n|---|---|---|---|")
    for name, (_, _, tokens) in workloads.items():
        o, t = (statistics.median(times[name][s]) for s in ("ours", "transformers"))
        print(f"| {name} | {tokens / t:,.0f} | {tokens / o:,.0f} | {t / o:.2f}x |")
    if floors:
        hf_step = statistics.median(times["train step"]["transformers"])
        flop = floors["torch"].flop
        print(f"\nthe train step's matrix products alone, {flop / 1e9:.1f} GFLOP (medians):")
        for side in floors:
            g = statistics.median(times[f"gemms {side}"])
            print(f"  {side}: {g:.3f}s ({flop / g / 1e9:.0f} GFLOP/s); transformers' step / this = {hf_step / g:.2f}x")
        print("\nby shape, one call each, medians of 7 (GFLOP/s, and seconds per step at the step's count):")
        print("| (batch, m, k, n) | per step | torch GFLOP/s | XLA GFLOP/s | torch s/step | XLA s/step |")
        print("|---|---|---|---|---|---|")
        per = {side: floor.by_shape() for side, floor in floors.items()}
        for i, (b, m, k, n) in enumerate(floors["torch"].shapes):
            c, f = floors["torch"].counts[i], 2 * b * m * k * n
            t, x = per["torch"][i], per["xla"][i]
            print(f"| {(b, m, k, n)} | {c} | {f / t / 1e9:.0f} | {f / x / 1e9:.0f} | {c * t:.3f} | {c * x:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
