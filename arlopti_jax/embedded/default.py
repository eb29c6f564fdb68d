"""The embedded default: GRPO + AR + Lopti on a tiny Qwen2-architecture policy, on CPU, GPU or TPU.

``python -m arlopti_jax.train`` with no flags uses this. Nothing is downloaded: the start
point (a tokenizer trained on generated K&K text and a small model warm-started on
generated 2-3 person puzzles; see ``arlopti_jax.embedded.start_point``) is built once in the run
folder's parent. Sizes are chosen to finish on 2 CPU cores in minutes.

The numerics follow the backend found when the config is loaded (``runtime.chips.backend()``:
``JAX_PLATFORMS``'s first entry, else ``jax.default_backend()``); ``--help`` shows this machine's:

    cpu       float32 activations and weights, no remat, layers unrolled (what the CPU runs fastest;
              the accuracy gain of docs/results/default_run.md was measured with these)
    gpu       bfloat16 activations, float32 weights (and AdamW state), cuDNN's fused attention
    tpu       bfloat16 activations, float32 weights, XLA's attention

On a GPU or TPU remat stays off (the model is tiny: memory is no constraint) and the 4 layers stay
unrolled. On one H200 this default ran end to end in 91 s with an empty compilation cache
(2026-11-27 night, ed51b63, with the decode kernel: docs/measurements/gpu_2026-11-27c/; 81.6 s
that morning before it) and 24.9 s with a warm one (the morning's run, the only warm one). Scan against unroll was not
measured there; compiler figures for an H100 favour unrolling (``python -m arlopti_jax.aot
--target=h100 --config.model.dtype=bfloat16 --config.model.attention=cudnn
--config.model.unroll_layers=True|False --config.compile_cache_dir=""``, compile-only on a shared
2-core CPU machine, jax 0.10.2 with its CUDA 12 plugin 0.10.2): the 8 programs compiled in 34.0 s
unrolled against 35.0 s scanned (a second pair, on a working tree with another change's micro-batch
shape: 46.1 s against 51.3 s), and the update's accumulate program reads and writes 0.63 GB against
0.96 GB (2.22 against 3.28) with 0.06 GiB of temporaries against 0.12 GiB (0.23 against 0.36). The
sampler loops over the layers either way.
"""

from arlopti_jax.config import base_config
from arlopti_jax.runtime import chips


def get_config():
    c = base_config()
    c.run_dir = "runs/default"
    c.model.path = ""  # the embedded start point
    backend = chips.backend()
    if backend == "cpu":  # these values exactly: the default's measured accuracy gain is theirs
        c.model.dtype = "float32"
    else:  # GPU, TPU: 16-bit compute on float32 weights; cuDNN's fused attention on a GPU
        c.model.dtype = "bfloat16"
        c.model.param_dtype = "float32"
        c.model.attention = "cudnn" if backend == "gpu" else "xla"
    c.model.remat = False  # a tiny model: memory is no constraint anywhere
    # 4 layers: straight-line code is faster on CPU; on GPU/TPU unmeasured, chosen by compiler figures (docstring)
    c.model.unroll_layers = True
    c.data.max_prompt_length = 256
    c.rollout.n = 8
    c.rollout.temperature = 1.0
    c.rollout.max_response_length = 48
    # 48-token responses: the dense sampler's few programs per batch shape compile faster than the
    # length-aware sampler's phases and row buckets save in decoding (about 75 s per run)
    c.rollout.length_aware = False
    c.rollout.prompt_bucket = 64
    c.algo.weighting = "ar"  # the paper's best combination: AR (alpha 0.3) + Lopti (eta 0.5)
    c.algo.ar_alpha = 0.3
    c.algo.lopti_eta = 0.5
    c.optim.lr = 5e-4  # a tiny model needs far more than the paper's 1e-6; decayed to damp late drift
    c.optim.weight_decay = 0.0
    c.optim.schedule = "warmup_cosine"
    c.optim.warmup_steps = 4  # optimizer steps (4 per RL step with Lopti)
    c.optim.min_lr_ratio = 0.1
    c.train.batch_prompts = 8
    c.train.mini_batch = 32
    c.train.micro_batch = 32
    # one packed row length (640: a group's prompt and its 8 responses): 4 programs per packed pass
    # instead of 8, compiled with the first batch; on the default's lengths 19% padding against 22%
    # with two (bench/packing_plan.py, 2026-11-27)
    c.train.pack_row_lengths = 1
    c.train.max_steps = 30
    c.train.eval_every = 15
    c.train.save_every = 10
    c.train.eval_n = 1
    c.train.samples_every = 5
    c.reward.workers = 0  # K&K scoring is cheap: inline
    return c
