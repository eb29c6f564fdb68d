"""Does the sampler's decode stay exact on the CPU while another thread runs an XLA program?

    python bench/cpu_thread_race.py [--shape smollm2 | --model DIR] [--calls 3] [--tokens 24]

The sampler (4 prompts of random ids x 8 samples, greedy; random weights of the shape, or a
Hugging Face model folder) decodes once alone as the reference, then ``--calls`` times alone and
``--calls`` times while a second Python thread loops a jitted 2048 x 2048 matmul. Each line gives
the response rows whose tokens differ from the reference, the largest log-prob difference
from it, and the gap that matters to RL: the largest difference between the sampler's log-probs
of its own tokens and a teacher-forced forward pass over them (what the trainer computes as
pi_old). Greedy decoding of one program on the same inputs is deterministic, so every line
should read 0 rows; the gap should be float rounding (about 1e-5).

On 2026-12-05 (jax/jaxlib 0.10.2, this 2-core machine, the SmolLM2 checkpoint rather than random
weights) the concurrent calls did not: 50-308 of 768 tokens differed, log-probs by 3-13, while
prefill, the decode's start and a plain forward stayed exact; see docs/measurements/journal.md,
"CPU, 2026-12-05 (issue 66)". This is why ``rl.pipeline.in_thread`` never runs the sampling
loop's jobs in a worker thread on the CPU. On 2026-12-06 the cause was found: the package's
``--xla_cpu_experimental_ynn_fusion_type=`` (XLA:CPU's own fusions, set for one host device). With
it taken out of XLA_FLAGS after the package's import, 0 rows beside the thread; with it, 32 of 32.
Run it after a jaxlib upgrade, or before letting the CPU use the thread again.
"""

import argparse
import os
import sys
import threading
import time

SMOLLM2 = dict(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, vocab=49152, tied=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2", help="smollm2, or a preset of bench/common.py (random weights)")
    ap.add_argument("--model", help="a Hugging Face model folder (float32) instead of random weights")
    ap.add_argument("--calls", type=int, default=3, help="decodes alone, then as many beside the thread")
    ap.add_argument("--tokens", type=int, default=24, help="response tokens per row")
    args = ap.parse_args(argv)
    if args.calls < 1 or args.tokens < 1:
        ap.error("--calls and --tokens must be >= 1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np

    import common
    from arlopti_jax.models import load_pretrained, token_logprobs
    from arlopti_jax.models.policy import init_params
    from arlopti_jax.rollout import Sampler, SamplingConfig
    from arlopti_jax.runtime import sharding as shd

    if args.shape != "smollm2" and args.shape not in common.SHAPES:
        ap.error(f"--shape {args.shape}: expected smollm2 or one of {sorted(common.SHAPES)}")
    mesh = shd.make_mesh({"fsdp": -1}, jax.devices()[:1])
    if args.model:
        try:
            cfg, params = load_pretrained(args.model, mesh=mesh, dtype="float32", param_dtype="float32")
        except (OSError, ValueError) as err:
            ap.error(f"--model {args.model}: {err}")
        what = f"{args.model} (float32)"
    else:
        dims = SMOLLM2 if args.shape == "smollm2" else common.dims(args.shape)
        cfg = common.model_config(dims)
        params = init_params(cfg, jax.random.key(0), mesh)
        what = f"{common.describe(dims)}, random weights"
    forward = jax.jit(lambda p, ids, mask: token_logprobs(cfg, p, ids, mask)[0])
    sampler = Sampler(cfg, mesh)
    sampling = SamplingConfig(max_response_len=args.tokens, prompt_bucket=96, batch_bucket=4, length_aware=False,
                              greedy=True)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(100, cfg.vocab_size, 90)) for _ in range(4)]

    def decode():
        r = sampler.generate(params, prompts, 8, jax.random.key(1), sampling)
        return r, np.asarray(r.response_ids), np.asarray(r.logprobs)

    def gap(r) -> float:  # sampler log-probs against the teacher-forced forward of the same tokens
        ids, mask = (np.concatenate(pair, axis=1) for pair in ((r.prompt_ids, r.response_ids),
                                                               (r.prompt_mask, r.response_mask)))
        lp = np.asarray(forward(params, ids, mask))[:, r.prompt_ids.shape[1]:]
        return float((np.abs(lp - r.logprobs) * r.response_mask).max())

    _, ref_ids, ref_lp = decode()
    matmul = jax.jit(lambda a: jnp.tanh(a @ a) * 0.5)
    jax.block_until_ready(matmul(jnp.ones((2048, 2048), jnp.float32)))  # compiled before the thread starts
    stop = threading.Event()

    def worker():
        a = jnp.ones((2048, 2048), jnp.float32)
        while not stop.is_set():
            a = jax.block_until_ready(matmul(a))

    print(f"{common.backend_line()}\n{what}, 32 rows x {args.tokens} greedy tokens")
    bad, rollouts = 0, []
    for beside in (False, True):
        thread = threading.Thread(target=worker, daemon=True) if beside else None
        if thread:
            thread.start()
            time.sleep(1)
        for i in range(args.calls):
            r, ids, lp = decode()
            rows = int((ids != ref_ids).any(axis=1).sum())
            bad += rows
            rollouts.append((f"{'beside a matmul thread' if beside else 'alone':>22} call {i}: rows with other tokens "
                             f"{rows}/{len(ids)}, largest log-prob difference {float(np.abs(lp - ref_lp).max()):.3g}",
                             r))
        if thread:
            stop.set()
            thread.join()
    for line, r in rollouts:  # the forward passes run with no thread beside them
        print(f"{line}; sampler against forward {gap(r):.3g}", flush=True)
    print("exact" if bad == 0 else f"NOT exact: {bad} rows differ in all")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
