"""Small random Hugging Face checkpoints written by transformers itself (PyTorch, CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

VOCAB = 97


def write_hf_model(folder: Path, kind: str = "qwen2", tied: bool = False, seed: int = 0,
                   layers: int = 2, dtype: str = "float32") -> Path:
    """kind: 'qwen2' or 'llama' (the llama variant uses Llama 3 rope scaling)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tied, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if kind == "qwen2":
        config = transformers.Qwen2Config(rope_theta=50000.0, **common)
        model = transformers.Qwen2ForCausalLM(config)
    elif kind == "llama":
        config = transformers.LlamaConfig(
            rope_theta=500000.0, attention_bias=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **common)
        model = transformers.LlamaForCausalLM(config)
    else:
        raise ValueError(kind)
    with torch.no_grad():  # non-trivial norms and biases, so a mix-up cannot hide
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(folder)
    return Path(folder)


def hf_logits(folder: Path, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor(input_ids, dtype=torch.long)
    mask = torch.tensor(attention_mask, dtype=torch.long)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
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
