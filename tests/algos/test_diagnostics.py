"""The isolation experiment (the paper's Figure 1, right) on a tiny random policy, against a manual
computation; the trainer's diagnostics_every metrics are checked end to end in test_train.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from arlopti_jax.runtime import sharding as shd
from arlopti_jax.algos import LossConfig, init_opt_state, isolation_experiment, make_compute_logprobs, make_train_step
from arlopti_jax.models import ModelConfig, abstract_params, logits, param_shardings

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8)
LOSS = LossConfig(kl_coef=0.0, temperature=0.7)
ROWS, T, LR = 8, 16, 0.5
TOKENS = 64  # per packed micro-batch


@functools.cache
def mesh():
    return shd.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])


def params():
    rng = np.random.default_rng(0)
    draw = lambda path, leaf: (rng.normal(0.0, 0.3, leaf.shape) + ("scale" in jax.tree_util.keystr(path))).astype(
        np.float32)
    return jax.device_put(jax.tree_util.tree_map_with_path(draw, abstract_params(CFG)), param_shardings(CFG, mesh()))


@functools.cache
def batch(sign: float):
    rng = np.random.default_rng(1)
    ids = rng.integers(3, CFG.vocab_size, (ROWS, T)).astype(np.int32)
    attn, resp = np.zeros((ROWS, T), np.int32), np.zeros((ROWS, T), np.float32)
    for r in range(ROWS):
        pad, prompt, n = r % 3, 3, 6 + r % 4
        attn[r, pad:pad + prompt + n] = 1
        resp[r, pad + prompt:pad + prompt + n] = 1
    old = np.asarray(make_compute_logprobs(CFG, mesh(), temperature=LOSS.temperature, tokens_per_device=TOKENS)(
        params(), {"input_ids": ids, "attention_mask": attn, "response_mask": resp})) * resp
    return {"input_ids": ids, "attention_mask": attn, "response_mask": resp, "old_logprobs": old,
            "advantages": sign * resp}


def manual(b) -> np.ndarray:
    """The same experiment written out: quartiles by numpy, one SGD step on -A * ratio over the
    quartile's tokens / all response tokens, probabilities from a plain forward pass."""
    resp, old = b["response_mask"], b["old_logprobs"]
    p_old = np.exp(old.astype(np.float64))
    quart = np.where(resp > 0, np.digitize(p_old, np.quantile(p_old[resp > 0], [0.25, 0.5, 0.75])), -1)

    @jax.jit
    def token_logp(prm):
        lg = jax.nn.log_softmax(logits(CFG, prm, b["input_ids"], b["attention_mask"]) / LOSS.temperature, -1)
        lp = jnp.take_along_axis(lg[:, :-1], b["input_ids"][:, 1:, None], -1)[..., 0]
        return jnp.pad(lp, ((0, 0), (1, 0)))

    def mean_probs(prm):
        p = np.exp(np.asarray(token_logp(prm), np.float64))
        return np.array([p[quart == q].mean() for q in range(4)])

    @jax.jit
    def grad(prm, mask):
        return jax.grad(lambda x: jnp.sum(-b["advantages"] * mask * jnp.exp(token_logp(x) - old)) / resp.sum())(prm)

    p0 = params()
    before = mean_probs(p0)
    rows = []
    for q in (0, 3):
        g = grad(p0, (quart == q).astype(np.float32))
        rows.append(mean_probs(jax.tree.map(lambda x, d: x - LR * d, p0, g)) - before)
    return np.stack(rows)


def isolation(b) -> np.ndarray:
    opt = optax.sgd(LR)
    step = make_train_step(CFG, LOSS, opt, mesh(), tokens_per_device=TOKENS)
    logprobs = make_compute_logprobs(CFG, mesh(), temperature=LOSS.temperature, tokens_per_device=TOKENS)
    return isolation_experiment(step, logprobs, lambda p: init_opt_state(opt, CFG, p, mesh()), params(), b)


def test_isolation_experiment():
    b = batch(1.0)
    got = isolation(b)
    assert got.shape == (2, 4)
    np.testing.assert_allclose(got, manual(b), rtol=2e-3, atol=1e-6)
    # the updated quartile's probability moves with its advantage's sign
    assert got[0, 0] > 1e-3 and got[1, 3] > 1e-3
    negative = isolation(batch(-1.0))
    assert negative[0, 0] < 0 and negative[1, 3] < -1e-3  # low-probability tokens have little to lose
