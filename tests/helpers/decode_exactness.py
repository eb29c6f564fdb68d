"""``python -m decode_exactness FOLDER``: the sampler's greedy decode of a model folder checked as a
user's command would run it (``runtime.process.prepare``: the commands' XLA settings, nothing else),
on meshes of 1, 2 and all host devices, and on one device beside a thread looping a matmul on
another device and on the same one; each decode's tokens against the 1-device decode's, and its
log-probs against a teacher-forced forward pass of its own tokens. Prints one JSON line:
{case: [rows whose tokens differ, largest log-prob gap to the forward pass]}."""

import json
import sys
import threading
import time

from arlopti_jax.runtime import process

process.prepare()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from arlopti_jax.models import load_pretrained, token_logprobs  # noqa: E402
from arlopti_jax.rollout import Sampler, SamplingConfig  # noqa: E402
from arlopti_jax.runtime import sharding as shd  # noqa: E402


def decode(folder, devices, beside=None, tokens=24, n=8):
    mesh = shd.make_mesh({"fsdp": -1}, devices)
    cfg, params = load_pretrained(folder, mesh=mesh, dtype="float32")
    prompts = [list(np.random.default_rng(0).integers(100, cfg.vocab_size, 90)) for _ in range(4)]
    sampling = SamplingConfig(max_response_len=tokens, prompt_bucket=96, batch_bucket=4, length_aware=False,
                              greedy=True)
    sampler = Sampler(cfg, mesh)
    sampler.generate(params, prompts, n, jax.random.key(1), sampling)  # compiled before any thread runs
    stop, thread = threading.Event(), None
    if beside is not None:
        matmul = jax.jit(lambda a: jnp.tanh(a @ a) * 0.5)
        start = jax.device_put(jnp.ones((1024, 1024), jnp.float32), beside)
        jax.block_until_ready(matmul(start))

        def loop():
            a = start
            while not stop.is_set():
                a = jax.block_until_ready(matmul(a))

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        time.sleep(0.5)
    r = sampler.generate(params, prompts, n, jax.random.key(1), sampling)
    if thread is not None:
        stop.set()
        thread.join()
    ids, mask = (np.concatenate(p, axis=1) for p in ((r.prompt_ids, r.response_ids), (r.prompt_mask, r.response_mask)))
    forward = jax.jit(lambda p, i, m: token_logprobs(cfg, p, i, m)[0])
    logp = np.asarray(forward(params, ids, mask))[:, r.prompt_ids.shape[1]:]
    return np.asarray(r.response_ids), float((np.abs(logp - r.logprobs) * r.response_mask).max())


def main(folder):
    devices = jax.devices()
    cases = {"1 device": (devices[:1], None), "2 devices": (devices[:2], None),
             f"{len(devices)} devices": (devices, None),
             "beside a matmul on another device": (devices[1:2], devices[0]),
             "beside a matmul on the same device": (devices[:1], devices[0])}
    out, reference = {}, None
    for name, (where, beside) in cases.items():
        ids, gap = decode(folder, where, beside)
        reference = ids if reference is None else reference
        out[name] = [int((ids != reference).any(axis=1).sum()), gap]
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
