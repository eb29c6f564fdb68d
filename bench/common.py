"""What the benchmarks share: model-shape presets, the device's peak, compile counting, timing
and interleaved rounds, the single-kernel benchmarks' scaffolding, and transformers' side of a
train step.

    import common                                # a script run as python bench/X.py has bench/ on sys.path
    cfg = common.model_config("3b", layers=2)    # real widths, fewer layers (CPU)

Shapes: ``tiny`` (a small model of the Qwen2 architecture, vocabulary 8192) and ``bench`` (the
same with vocabulary 4096: the model of ``realistic.py``'s default workload, ``tiny_vs_hf.py`` and
``packing_plan.py``), and the Qwen2.5 sizes of ``arlopti_jax.aot.shapes.QWEN25`` (their
config.json values: vocabulary 151936 up to 3B and 152064 for 7B, tied embeddings for 0.5B-3B).
A checkout too old to have ``arlopti_jax.aot`` (``realistic.py --before COMMIT``) gets the two
small ones only.

Nothing here runs at import but the shape table: jax, numpy and torch are imported where used.
"""

from __future__ import annotations

import logging
import re
import statistics
import time

SHAPES = {"tiny": dict(hidden=256, intermediate=1024, layers=4, heads=4, kv_heads=2, vocab=8192, tied=True)}
SHAPES["bench"] = dict(SHAPES["tiny"], vocab=4096)
try:
    from arlopti_jax.aot.shapes import QWEN25
except ImportError:  # an older checkout (realistic.py --before): the small presets only
    QWEN25 = {}
SHAPES.update({name: dict(hidden=q["hidden_size"], intermediate=q["intermediate_size"], layers=q["num_hidden_layers"],
                          heads=q["num_attention_heads"], kv_heads=q["num_key_value_heads"], vocab=q["vocab_size"],
                          tied=q["tie_word_embeddings"]) for name, q in QWEN25.items()})
DIM_FLAGS = ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab")


# ---------------------------------------------------------------- shapes
def dims(shape: str, **overrides) -> dict:
    """A preset's dimensions with the non-None ``overrides`` applied."""
    out = dict(SHAPES[shape])
    out.update({k: v for k, v in overrides.items() if v is not None})
    if out["heads"] % out["kv_heads"] or out["hidden"] % out["heads"]:
        raise ValueError(f"heads={out['heads']} must divide hidden={out['hidden']} and be a multiple of "
                         f"kv_heads={out['kv_heads']}")
    return out


def add_shape_flags(parser, default: str | None = "tiny") -> None:
    """--shape and one override flag per dimension (--hidden, --layers, --kv-heads, ...)."""
    parser.add_argument("--shape", choices=sorted(SHAPES), default=default, help="model preset (random weights)")
    for name in DIM_FLAGS:
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, help="override the preset")


def shape_dims(args, fallback: dict | None = None) -> dict:
    """The dimensions ``add_shape_flags``' flags select (``fallback`` when --shape is None)."""
    overrides = {k: getattr(args, k) for k in DIM_FLAGS}
    if args.shape is None:
        return {**fallback, **{k: v for k, v in overrides.items() if v is not None}}
    return dims(args.shape, **overrides)


def describe(d: dict) -> str:
    return (f"hidden={d['hidden']} intermediate={d['intermediate']} layers={d['layers']} heads={d['heads']}/"
            f"{d['kv_heads']} vocab={d['vocab']} tied={d['tied']}")


def model_config(shape: str | dict, dtype: str = "float32", param_dtype: str | None = None, remat: bool = False,
                 **overrides):
    """arlopti_jax ModelConfig of a preset or dimensions (Qwen2 architecture: qkv biases, rope theta 1e6)."""
    from arlopti_jax.models import ModelConfig

    d = dims(shape, **overrides) if isinstance(shape, str) else shape
    return ModelConfig(vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["intermediate"],
                       num_layers=d["layers"], num_heads=d["heads"], num_kv_heads=d["kv_heads"],
                       head_dim=d["hidden"] // d["heads"], tie_word_embeddings=d["tied"], qkv_bias=True,
                       rope_theta=1_000_000.0, dtype=dtype, param_dtype=param_dtype or dtype, remat=remat)


def hf_model(d: dict, dtype: str = "float32", seed: int = 0):
    """A randomly initialised transformers Qwen2ForCausalLM of the same dimensions (EOS id 2)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["intermediate"],
        num_hidden_layers=d["layers"], num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
        tie_word_embeddings=d["tied"], max_position_embeddings=32768, rope_theta=1_000_000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.Qwen2ForCausalLM(config).to(getattr(torch, dtype))


def mesh_axes(text: str) -> dict[str, int]:
    """'fsdp=4,tensor=2' -> {'fsdp': 4, 'tensor': 2}."""
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}


def packed_budget(rows: int, width: int) -> int:
    """Tokens per device of a packed micro-batch that holds ``rows`` dense rows of ``width``
    (rounded up to 64)."""
    return -(-rows * width // 64) * 64


# ---------------------------------------------------------------- the device
def matmul_peak(n: int = 2048, reps: int = 5) -> float:
    """The best FLOP/s of a float32 [n, n] x [n, n] matmul, through XLA (jitted) and through
    numpy's BLAS, best of ``reps`` each: a practical CPU peak (the datasheet one is unknown here)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    host = np.asarray(a)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for run in (lambda: f(a).block_until_ready(), lambda: host @ host):
        for _ in range(reps):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
    return 2.0 * n ** 3 / best


def device_peak(peak_tflops: float | None) -> tuple[float, str]:
    """(peak FLOP/s of one device, where it came from): the flag, the chip table's bf16 peak, or
    on a CPU the measured matmul rate of ``matmul_peak`` (noisy on a shared machine)."""
    import jax

    if peak_tflops:
        return peak_tflops * 1e12, "--peak-tflops"
    try:
        from arlopti_jax.runtime.chips import peak_flops_per_device
    except ImportError:  # an older checkout (realistic.py --before)
        peak_flops_per_device = lambda: None
    table = peak_flops_per_device()
    if table:
        return table, f"bf16 datasheet peak of {jax.devices()[0].device_kind}"
    return matmul_peak() / jax.local_device_count(), "measured float32 matmul rate, XLA or BLAS (CPU)"


def backend_line() -> str:
    """'jax VERSION, N x DEVICE_KIND (platform)'."""
    import jax

    dev = jax.devices()[0]
    return f"jax {jax.__version__}, {jax.device_count()} x {dev.device_kind} ({dev.platform})"


# ---------------------------------------------------------------- compiles and time
class CompileCounter(logging.Handler):
    """The XLA compilations jax logs (``jax_log_compiles``), by program name, and their seconds
    (a persistent-cache hit counts as one, with the seconds it took to load)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []
        self.seconds = 0.0

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Finished XLA compilation"):
            name, _, took = msg.split(" of ", 1)[-1].rpartition(" in ")
            self.names.append(name)
            self.seconds += float(took.split()[0]) if took.split() else 0.0

    @property
    def count(self) -> int:
        return len(self.names)

    def since(self, start: int) -> list[str]:
        return self.names[start:]


COMPILED_LINE = re.compile(r"Finished XLA compilation of (.+?) in ([0-9.eE+-]+) sec")
CACHE_HIT = "Persistent compilation cache hit"


def compile_log_figures(text: str, after: int = 0) -> dict:
    """From a process's output with ``JAX_LOG_COMPILES=1``: its programs (JAX's "Finished XLA
    compilation of" lines, a persistent-cache load included), their summed seconds, the cache hits,
    and the names of the programs written after character ``after`` (e.g. the first step's bar)."""
    found = list(COMPILED_LINE.finditer(text))
    late = [m.group(1) for m in found if m.start() >= after] if after else []
    return {"programs": len(found), "compile_s": sum(float(m.group(2)) for m in found),
            "hits": text.count(CACHE_HIT), "late": late}


def count_compiles() -> CompileCounter:
    """Turn on jax's compile log and count it (without printing it)."""
    import jax

    counter = CompileCounter()
    jax.config.update("jax_log_compiles", True)
    logging.getLogger("jax").addHandler(counter)
    logging.getLogger("jax").propagate = False
    return counter


def timed(fn, *args, **kw) -> tuple[float, object]:
    """(seconds, result) of one call."""
    start = time.perf_counter()
    out = fn(*args, **kw)
    return time.perf_counter() - start, out


def interleaved(sides: dict, rounds: int, tokens) -> dict[str, list[float]]:
    """Run each side once per round, in turn; print each round. ``tokens(out)``: tokens made."""
    times = {name: [] for name in sides}
    for r in range(rounds):
        line = []
        for name, fn in sides.items():
            t, out = timed(fn)
            times[name].append(t)
            line.append(f"{name} {t:.3f}s ({tokens(out) / t:,.0f} tok/s)")
        print(f"round {r + 1}: " + ", ".join(line), flush=True)
    return times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in times.items()}


# ---------------------------------------------------------------- kernel benchmarks
def add_kernel_flags(parser, iters: int, what: str) -> None:
    """The flags the single-kernel benchmarks share (``decode_kernel.py``, ``decode_matmul.py``)."""
    parser.add_argument("--sweep", action="store_true", help="time every --configs setting (default: the first only)")
    parser.add_argument("--iters", type=int, default=iters, help=f"calls per timed program, {what}")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="", help="write the records here")
    parser.add_argument("--quick", action="store_true", help="a CPU check of this script: small shapes, interpret mode")


def kernel_device(what: str = "") -> tuple[object, bool, float]:
    """(device, interpret, HBM bytes/s) for a kernel benchmark, its header printed: Pallas runs in
    interpret mode off a GPU, and the bandwidth is the datasheet's (0 where unknown)."""
    import jax

    from arlopti_jax.aot.targets import hbm_bandwidth

    device = jax.devices()[0]
    interpret = device.platform != "gpu"
    print(f"{device.device_kind}, jax {jax.__version__}{'; ' + what if what else ''}; "
          f"{'interpret mode (no GPU): figures are not kernel times' if interpret else 'bfloat16'}", flush=True)
    return device, interpret, hbm_bandwidth(device.device_kind) or 0.0


def program_seconds(program, x, calls: int, repeats: int) -> float:
    """Seconds per call of a jitted ``program(x)`` that makes ``calls`` calls: median of ``repeats``
    after a warm-up (the compile)."""
    import jax

    jax.block_until_ready(program(x))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(program(x))
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def failed_row(err: Exception, width: int) -> str:
    """A setting the compiler rejects (Triton's shared memory...): the first line of its error."""
    return f"failed: {str(err).splitlines()[0][:width]}"


def write_records(path: str, device, records: list) -> None:
    """``--json``: the device, jax's version and the records."""
    import json
    from pathlib import Path

    import jax

    if path:
        Path(path).write_text(json.dumps({"device": device.device_kind, "jax": jax.__version__, "records": records},
                                         indent=1) + "\n")


# ---------------------------------------------------------------- transformers' train step
def torch_token_logprobs(model, ids, attn):
    """log pi(ids[:, t] | ids[:, :t]) for t >= 1, [B, T - 1], from the full logits (transformers' way)."""
    import torch

    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def torch_minibatch_step(model, opt, t: dict, micro: int, clip=(0.2, 0.24), kl_coef=0.001):
    """One optimizer step on a mini-batch of torch tensors (keys as the JAX train step's):
    ``micro`` micro-batches' forward/backward of the PPO clipped loss + k3 KL, clipping, AdamW."""
    import torch

    ids, attn = t["input_ids"], t["attention_mask"]
    denom = t["response_mask"].sum().clamp(min=1)
    opt.zero_grad(set_to_none=True)
    for rows in torch.arange(ids.shape[0]).chunk(micro):
        logp = torch_token_logprobs(model, ids[rows], attn[rows])
        mask, a = t["loss_mask"][rows, 1:], t["advantages"][rows, 1:]
        ratio = torch.exp(logp - t["old_logprobs"][rows, 1:])
        pg = -torch.minimum(ratio * a, ratio.clamp(1 - clip[0], 1 + clip[1]) * a)
        diff = t["ref_logprobs"][rows, 1:] - logp
        kl = torch.exp(diff) - diff - 1  # k3 / low_var_kl
        loss = ((pg + kl_coef * kl) * mask).sum() / denom
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def torch_batch(arrays: dict) -> dict:
    """numpy/jax arrays -> torch tensors (ids and masks long, the rest float32)."""
    import numpy as np
    import torch

    ints = ("input_ids", "attention_mask")
    return {k: torch.from_numpy(np.array(v)).long() if k in ints else torch.from_numpy(np.array(v, np.float32))
            for k, v in arrays.items()}
