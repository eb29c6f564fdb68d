"""LoRA adapters as parameter trees: split from the base, put back, switched off, merged.

The decoder holds each adapted projection's adapter beside its weight (``decoder.adapted``:
``{name}_lora_a`` and ``{name}_lora_b`` next to ``{name}_kernel``, stacked over layers like it).
A run trains only those leaves; these functions move between the whole tree and its parts:

    base, adapters = split(params)        # the frozen weights, the trained adapters
    params = combine(base, adapters)
    trained, frozen = trainable(cfg, params)   # what a step updates (the whole tree without LoRA)
    reference = adapters_off(params)      # B at zero: the base model's outputs, exactly
    plain = merge(cfg, params)            # W + (alpha / r) A B folded in, adapters dropped
    adapters = init_adapters(cfg, key, mesh)   # fresh adapters alone (the base is not built)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import traverse_util

from arlopti_jax.models.config import ModelConfig

_A, _B = "_lora_a", "_lora_b"


def is_adapter(name: str) -> bool:
    return name.endswith((_A, _B))


def split(params: dict) -> tuple[dict, dict]:
    """(base, adapters): the tree's leaves without and with an adapter's name, nested as before."""
    flat = traverse_util.flatten_dict(params)
    base = {k: v for k, v in flat.items() if not is_adapter(k[-1])}
    adapters = {k: v for k, v in flat.items() if is_adapter(k[-1])}
    return traverse_util.unflatten_dict(base), traverse_util.unflatten_dict(adapters)


def combine(base: dict, adapters: dict) -> dict:
    """The whole tree again (``split``'s inverse)."""
    return traverse_util.unflatten_dict({**traverse_util.flatten_dict(base), **traverse_util.flatten_dict(adapters)})


def trainable(cfg: ModelConfig, params: dict) -> tuple[dict, dict]:
    """(trained, frozen) parts of a tree for ``cfg``: the adapters and the base with LoRA, else the
    whole tree and nothing (the train step differentiates and updates the first part only)."""
    if not cfg.lora_rank:
        return params, {}
    base, adapters = split(params)
    return adapters, base


def whole(trained: dict, frozen: dict) -> dict:
    """``trainable``'s inverse."""
    return combine(frozen, trained) if frozen else trained


def adapters_off(params: dict) -> dict:
    """The tree with its adapters at zero: the model then computes exactly what its base computes
    (the reference policy of a LoRA run). It shares the base's arrays, not the adapters' (those a
    train step donates), so no copy of the weights is made."""
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({k: jnp.zeros_like(v) if is_adapter(k[-1]) else v for k, v in flat.items()})


def delta(scale: float, a, b) -> jax.Array:
    """scale x A B in float32, in the weight's shape: A [layers, contracted..., r] times B [layers,
    r, kept...] over the rank, layer by layer (a weight's contracted axes come first in this model)."""
    return scale * jax.vmap(lambda x, y: jnp.tensordot(x, y, axes=1))(a.astype(jnp.float32), b.astype(jnp.float32))


@functools.partial(jax.jit, static_argnums=0)
def merge(cfg: ModelConfig, params: dict) -> dict:
    """The base tree with each adapted weight replaced by W + (alpha / r) A B (in W's dtype) and
    no adapter leaves: a plain model of ``cfg.replace(lora_rank=0)`` (export, and a sampler that
    prefers one product per projection). One compiled program."""
    flat = traverse_util.flatten_dict(params)
    out = {}
    for key, value in flat.items():
        name = key[-1]
        if is_adapter(name):
            continue
        target = name[: -len("_kernel")] if name.endswith("_kernel") else None
        a_key = key[:-1] + (f"{target}{_A}",)
        if target is not None and a_key in flat:
            update = delta(cfg.lora_scale, flat[a_key], flat[key[:-1] + (f"{target}{_B}",)])
            assert update.shape == value.shape, (key, update.shape, value.shape)
            value = (value.astype(jnp.float32) + update).astype(value.dtype)
        out[key] = value
    return traverse_util.unflatten_dict(out)


def plain(cfg: ModelConfig, params: dict) -> tuple[ModelConfig, dict]:
    """(config, weights) of the plain model a run exports: with LoRA, the merged weights of
    ``cfg`` without adapters; else both as they are."""
    return (cfg.replace(lora_rank=0), merge(cfg, params)) if cfg.lora_rank else (cfg, params)


@functools.lru_cache(maxsize=None)
def _jitted_init(cfg: ModelConfig, mesh, rules):
    from arlopti_jax.models import policy

    init = policy._jitted_init(cfg, mesh, rules)
    # the base's initialisation is dead code: never built. The adapters in the train step's shardings,
    # named: left to the compiler, the same layout came back under other names, and the sampler's
    # merge compiled again at step 2 for the updated adapters
    return jax.jit(lambda key: split(init(key))[1], out_shardings=split(policy.param_shardings(cfg, mesh, rules))[1])


def init_adapters(cfg: ModelConfig, key, mesh, rules=None) -> dict:
    """Fresh adapters of ``cfg`` (A as PEFT starts it, B at zero), in their shardings."""
    from arlopti_jax.runtime import sharding as shd

    return _jitted_init(cfg, mesh, tuple(rules or shd.DEFAULT_RULES))(key)
