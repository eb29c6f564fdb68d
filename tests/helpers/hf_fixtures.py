"""Small random Hugging Face checkpoints written by transformers itself (PyTorch, CPU)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np

VOCAB = 97


# Gemma 3 at a tiny size: layers 0, 2 and 3 sliding (window 5) around a global layer 1; scores scaled by
# query_pre_attn_scalar 24 (not head_dim 32); the global layer's RoPE linearly scaled, the sliding ones'
# at their own theta
GEMMA3 = dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=5,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
SOFTCAPS = dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0)  # low: the caps bend these models' values


def write_hf_model(folder: Path, kind: str = "qwen2", tied: bool = False, seed: int = 0,
                   layers: int = 2, dtype: str = "float32", **extra) -> Path:
    """kind: 'qwen2', 'llama' (with Llama 3 rope scaling), 'qwen3' (head_dim 24, not hidden / heads)
    or 'gemma3' (``GEMMA3``'s four layers whatever ``layers`` says); ``extra``: config fields that
    replace these (``SOFTCAPS``, a vocabulary size)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tied, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if kind == "gemma3":
        common.update(GEMMA3, num_hidden_layers=len(GEMMA3["layer_types"]))
    common.update(extra)
    if kind == "qwen2":
        config = transformers.Qwen2Config(rope_theta=50000.0, **common)
        model = transformers.Qwen2ForCausalLM(config)
    elif kind == "llama":
        config = transformers.LlamaConfig(
            rope_theta=500000.0, attention_bias=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **common)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen3":
        config = transformers.Qwen3Config(**{"rope_theta": 50000.0, "head_dim": 24, **common})
        model = transformers.Qwen3ForCausalLM(config)
    elif kind == "gemma3":
        config = transformers.Gemma3TextConfig(**common)
        model = transformers.Gemma3ForCausalLM(config)
    else:
        raise ValueError(kind)
    with torch.no_grad():  # non-trivial norms and biases, so a mix-up cannot hide
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's scale is 1 + w: both start near 1
                p.copy_((0.0 if kind == "gemma3" else 1.0) + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(folder)
    return Path(folder)


@contextlib.contextmanager
def gemma3_attention_softcap():
    """transformers' Gemma 3 with its attention scores soft-capped as its config's
    attn_logit_softcapping says: transformers 5's Gemma3Attention keeps the field but never passes
    it to its attention function (Gemma 2's does). Here its eager attention function is given it."""
    from transformers.models.gemma3 import modeling_gemma3 as g3

    eager = g3.eager_attention_forward

    def capped(module, *args, **kwargs):
        return eager(module, *args, **{**kwargs, "softcap": module.attn_logit_softcapping})

    g3.eager_attention_forward = capped
    try:
        yield
    finally:
        g3.eager_attention_forward = eager


def hf_model(folder: Path):
    """transformers' model of ``folder`` in float32; Gemma 3 with its eager attention (where
    ``gemma3_attention_softcap`` reaches), every other family with its default."""
    import torch
    import transformers

    gemma = "gemma3" in json.loads((Path(folder) / "config.json").read_text())["model_type"]
    kw = {"attn_implementation": "eager"} if gemma else {}
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()


def hub_cache(home: Path, repo: str, folder: Path, commit: str, branch: str = "main") -> Path:
    """``folder``'s files as huggingface_hub's cache keeps a downloaded snapshot of ``repo`` under
    ``home`` (an ``HF_HOME``): each file a blob named by its hash, the snapshot's files links to the
    blobs, refs/BRANCH the commit. Returns the snapshot folder."""
    import hashlib
    import os

    root = home / "hub" / ("models--" + repo.replace("/", "--"))
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = root / "snapshots" / commit / f.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / branch).write_text(commit)
    return root / "snapshots" / commit


def hf_logits(folder: Path, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    import torch

    model = hf_model(folder)
    ids = torch.tensor(input_ids, dtype=torch.long)
    mask = torch.tensor(attention_mask, dtype=torch.long)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), gemma3_attention_softcap():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float().numpy()


def padded_batch(seed: int = 0, batch: int = 3, length: int = 12):
    """Left-padded batch with different prompt lengths (row 0 unpadded)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, size=(batch, length)).astype(np.int32)
    mask = np.ones((batch, length), np.int32)
    for row, pad in enumerate([0, 3, 7][:batch]):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask
