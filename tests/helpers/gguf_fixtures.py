"""Small GGUF files written with the ``gguf`` package's writer, laid out as llama.cpp's converter
lays them out, for the converter's tests beyond SmolLM2:

- ``qwen2``: a Qwen2 model (q/k/v biases, tied embeddings) with a Qwen2-style byte-level BPE
  tokenizer (``tokenizer.ggml.pre = qwen2``: NFC, digits one by one);
- ``qwen3``: a Qwen3 model as llama.cpp's converter writes one (no biases, the q/k norms as
  ``attn_q_norm`` / ``attn_k_norm``, head size 128 in ``attention.key_length``, not hidden / heads,
  untied output) with the Qwen2-style tokenizer, which Qwen3's files name too;
- ``llama``: a Llama model (untied output, q/k rows in llama.cpp's rotary order) with a
  Llama-3-style one (``llama-bpe``: digits in threes, a begin-of-text token added, and whole
  words the vocabulary holds without the merges to build them, which a tokenizer with
  ``ignore_merges`` takes as one token).

The tokenizers are trained with ``tokenizers`` on a small generated corpus, with the split
expressions transformers gives these families (not the converter's own). Weights are random, in
a mix of GGUF types (Q8_0, F16, F32) so that dequantization is exercised.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

# Whole words added to the Llama vocabulary without merges: only ignore_merges yields them.
WHOLE_WORDS = ("Ġextraordinarily", "Ġcounterrevolutionaries", "Ġpneumonoultramicroscopic")
SPECIAL = {"qwen2": ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
           "llama": ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                     "<|eot_id|>")}
SPECIAL["qwen3"] = SPECIAL["qwen2"]
CHAT_TEMPLATE = {
    "qwen2": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "llama": "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
             "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
             "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
}
# texts the two tokenizers must agree on: digits, text that NFC changes, the whole words, runs of
# whitespace, special tokens inside text
HARD_TEXTS = (
    "What is 34 + 36? 1234567 and 3.14159, 2024-11-25: 10,000,000!",
    "cafe\u0301 nai\u0308ve A\u030angstro\u0308m \u212b Ω \u2126 ﬁne e\u0301e\u0301e\u0301",
    "café naïve Ångström précomposé",
    " extraordinarily counterrevolutionaries pneumonoultramicroscopic extraordinarilyx",
    "  leading, and   inner\t\truns\n\n\n  of whitespace   \n \t",
    "<|im_start|>user\nhello<|im_end|>\n<|eot_id|> it's we'll THEY'RE Ünïcödé ☃ 日本語 — 🤖",
    "\n\n\n",
    "x" * 300,
)


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ("the apple costs dollars knight knave answer question total number people house river "
             "mountain café naïve résumé Ångström über straße 日本語 東京 données élève").split()
    lines = []
    for _ in range(3000):
        parts = []
        for _ in range(rng.randint(3, 12)):
            r = rng.random()
            if r < 0.6:
                parts.append(rng.choice(words) if rng.random() < 0.8 else rng.choice(words).capitalize())
            elif r < 0.85:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 7))))
            else:
                parts.append(rng.choice((",", ".", "!", "?", "'s", "'ll", " -", ":", "(", ")", "$")))
        lines.append(" ".join(parts) + rng.choice(("\n", "\n\n", " ", "\t")))
    return lines


def train_tokenizer(kind: str, vocab_size: int = 480, seed: int = 0) -> tuple[list[str], list[str]]:
    """(tokens, merges) of a byte-level BPE trained the way ``kind``'s family splits text (Qwen3: Qwen2's way)."""
    kind = "qwen2" if kind == "qwen3" else kind
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import _LLAMA3_SPLIT
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT

    tok = Tokenizer(models.BPE())
    if kind == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT if kind == "qwen2" else _LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(seed), trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    if kind == "llama":
        tokens += [w for w in WHOLE_WORDS if w not in vocab]
    return tokens, merges


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py order for Llama q/k rows: per head, (half, pair) ->
    (pair, half), the interleaved layout its rotary embedding reads."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, kind: str, seed: int = 0, layers: int = 2) -> tuple[list[str], list[str]]:
    """A small ``kind`` ('qwen2', 'qwen3' or 'llama') model with its family's tokenizer, as one GGUF file
    at ``path``; returns the file's (tokens, merges)."""
    import gguf
    from gguf.quants import quantize

    tokens, merges = train_tokenizer(kind, seed=seed)
    special = SPECIAL[kind]
    tokens = tokens + list(special)
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(special)) + [gguf.TokenType.CONTROL] * len(special)
    pad = -len(tokens) % 32  # embedding rows a multiple of the Q8_0 block
    tokens += [f"[PAD{i}]" for i in range(pad)]
    types += [gguf.TokenType.UNUSED] * pad
    vocab, hidden, ffn, heads, kv_heads = len(tokens), 64, 96, 4, 2
    qwen = kind in ("qwen2", "qwen3")
    # Qwen3's head size: what transformers' GGUF reader assumes for qwen3 files (it reads no key_length)
    head_dim = 128 if kind == "qwen3" else hidden // heads
    rng = np.random.default_rng(seed)
    normal = lambda *shape: (rng.standard_normal(shape) * 0.08).astype(np.float32)
    norm = lambda: (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    Q8, F16, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32

    w = gguf.GGUFWriter(str(path), kind)
    w.add_name(f"tiny-{kind}")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(1e6 if qwen else 5e5)
    w.add_layer_norm_rms_eps(1e-6 if qwen else 1e-5)
    if kind == "llama":
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(vocab)
    if kind == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if qwen else "llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if qwen:
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_pad_token_id(tokens.index("<|endoftext|>"))
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_add_bos_token(False)
    else:
        w.add_bos_token_id(tokens.index("<|begin_of_text|>"))
        w.add_eos_token_id(tokens.index("<|eot_id|>"))
        w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE["qwen2" if qwen else kind])

    def tensor(name, array, qtype):
        w.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)

    tensor("token_embd.weight", normal(vocab, hidden), Q8)
    for i in range(layers):
        q, k = normal(heads * head_dim, hidden), normal(kv_heads * head_dim, hidden)
        if kind == "llama":
            q, k = _permute(q, heads), _permute(k, kv_heads)
        tensor(f"blk.{i}.attn_norm.weight", norm(), F32)
        tensor(f"blk.{i}.attn_q.weight", q, F16)
        tensor(f"blk.{i}.attn_k.weight", k, F16)
        tensor(f"blk.{i}.attn_v.weight", normal(kv_heads * head_dim, hidden), Q8)
        if kind == "qwen2":
            for name, rows in (("attn_q", heads), ("attn_k", kv_heads), ("attn_v", kv_heads)):
                tensor(f"blk.{i}.{name}.bias", normal(rows * head_dim) * 2, F32)
        if kind == "qwen3":
            for name in ("attn_q_norm", "attn_k_norm"):
                tensor(f"blk.{i}.{name}.weight", 1.0 + normal(head_dim), F32)
        tensor(f"blk.{i}.attn_output.weight", normal(hidden, heads * head_dim), Q8)
        tensor(f"blk.{i}.ffn_norm.weight", norm(), F32)
        tensor(f"blk.{i}.ffn_gate.weight", normal(ffn, hidden), Q8)
        tensor(f"blk.{i}.ffn_up.weight", normal(ffn, hidden), F16)
        tensor(f"blk.{i}.ffn_down.weight", normal(hidden, ffn), Q8)
    tensor("output_norm.weight", norm(), F32)
    if kind in ("llama", "qwen3"):
        tensor("output.weight", normal(vocab, hidden), Q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens, merges


def gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (its ``bytes_to_unicode``), written out here."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def reference_tokenize(text: str, tokens: list[str], merges: list[str], special: tuple[str, ...], split: str,
                       nfc: bool, ignore_merges: bool) -> list[int]:
    """Byte-level BPE as the families define it, in plain Python: special tokens matched whole;
    the rest NFC-normalized (``nfc``), split by ``split``, each piece spelled in GPT-2's byte
    alphabet and, unless ``ignore_merges`` finds the whole piece in the vocabulary, merged pair by
    pair, the lowest-ranked (leftmost on ties) first."""
    import re
    import unicodedata

    import regex

    alphabet = gpt2_byte_alphabet()
    ids = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
    out = []
    for piece in re.split("(" + "|".join(map(re.escape, special)) + ")", text):
        if piece in special:
            out.append(ids[piece])
            continue
        if nfc:
            piece = unicodedata.normalize("NFC", piece)
        for word in regex.findall(split, piece):
            spelled = "".join(alphabet[b] for b in word.encode("utf-8"))
            if ignore_merges and spelled in ids:
                out.append(ids[spelled])
                continue
            parts = list(spelled)
            while len(parts) > 1:
                rank, i = min((ranks.get((parts[i], parts[i + 1]), len(ranks)), i) for i in range(len(parts) - 1))
                if rank == len(ranks):
                    break
                parts[i:i + 2] = [parts[i] + parts[i + 1]]
            out += [ids[p] for p in parts]
    return out
