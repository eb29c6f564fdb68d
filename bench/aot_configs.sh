#!/usr/bin/env bash
# The paper's configs compiled for the pods and nodes they are meant for (issue 32's targets), with
# python -m arlopti_jax.aot: one JSON record and one log per (config, target) in $OUT (default
# docs/measurements/aot). Compiler figures for the targets, not runs. Records already in $OUT are kept (delete one
# to redo it).
#
#   bash bench/aot_configs.sh            # all of them (about an hour on 2 cores)
#   ONLY="kk3b_v5p-8 math_v5p-8" bash bench/aot_configs.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-docs/measurements/aot}"
PY="${PYTHON:-.venv/bin/python}"
mkdir -p "$OUT"

compile() {  # compile NAME TARGET CONFIG [OVERRIDES...]
  local name=$1 target=$2
  shift 2
  if [[ -n "${ONLY:-}" && " $ONLY " != *" ${name}_$target "* ]]; then return; fi
  if [[ -f "$OUT/${name}_$target.json" ]]; then return; fi
  echo "=== ${name}_$target: $*"
  "$PY" -m arlopti_jax.aot --target="$target" --json="$OUT/${name}_$target.json" "$@" >"$OUT/${name}_$target.log" 2>&1
  echo "=== exit $?: $(tail -n 2 "$OUT/${name}_$target.log" | head -n 1)"
}

for model in 3b 7b; do
  compile "kk$model" v5p-8 "--config=configs/layouts/v5p8.py:$model,grpo_ar_lopti"
  compile "kk$model" v5e-16 "--config=configs/layouts/v5e16.py:$model,grpo_ar_lopti"
  compile "kk$model" h100x8 "--config=configs/layouts/gpu8x80.py:$model,grpo_ar_lopti"
  # v5p-64 (32 chips on 8 hosts): fsdp over all of them, one sequence per chip per micro-batch
  compile "kk$model" v5p-64 "--config=configs/kk.py:$model,grpo_ar_lopti" --config.mesh.fsdp=-1 \
    --config.train.micro_batch=32
done
compile math v5p-8 "--config=configs/math.py:grpo_ar_lopti"
# the other named topologies, fsdp over every chip, one sequence per chip per micro-batch
compile kk3b v4-32 "--config=configs/kk.py:3b,grpo_ar_lopti" --config.mesh.fsdp=-1 --config.train.micro_batch=16
compile kk3b v5e-256 "--config=configs/kk.py:3b,grpo_ar_lopti" --config.mesh.fsdp=-1 --config.train.micro_batch=256
# multislice (issue 65): two v5e-16 slices over the data-center network, each laid out as v5e16.py's 3B (fsdp=16),
# the data axis across the slices (mesh.dcn_data=-1: every slice), the same global batch, one sequence per chip
compile kk3b 2xv5e-16 "--config=configs/layouts/v5e16.py:3b,grpo_ar_lopti" --config.train.micro_batch=32
# LoRA (issue 47): Qwen2.5-7B on ONE H100 with a bfloat16 base, float32 adapters of rank 16 on every projection,
# 8 prompts x 8 responses (64 rows) per step, beside full fine-tuning of the same step (float32 master weights);
# and 3B on a v5e-8 with a bfloat16 base, 32 prompts x 8 responses per step (docs/reference/memory.md, LoRA)
LORA=(--config.model.lora_rank=16 --config.model.lora_alpha=32 --config.model.lora_targets=q,k,v,o,gate,up,down)
ONE_H100=(--config.mesh.fsdp=1 --config.train.batch_prompts=8 --config.train.mini_batch=32 --config.train.micro_batch=1)
compile kk7b_lora h100 "--config=configs/kk.py:7b,grpo_ar_lopti" "${ONE_H100[@]}" --config.model.param_dtype=bfloat16 \
  "${LORA[@]}"
compile kk7b_full h100 "--config=configs/kk.py:7b,grpo_ar_lopti" "${ONE_H100[@]}"
# the next batch up: 16 prompts x 8 responses (128 rows)
compile kk7b_lora_16prompts h100 "--config=configs/kk.py:7b,grpo_ar_lopti" "${ONE_H100[@]}" \
  --config.train.batch_prompts=16 --config.train.mini_batch=64 --config.model.param_dtype=bfloat16 "${LORA[@]}"
compile kk3b_lora v5e-8 "--config=configs/kk.py:3b,grpo_ar_lopti" --config.mesh.fsdp=-1 --config.train.batch_prompts=32 \
  --config.train.mini_batch=128 --config.train.micro_batch=8 --config.model.param_dtype=bfloat16 "${LORA[@]}"
compile kk3b_full v5e-8 "--config=configs/kk.py:3b,grpo_ar_lopti" --config.mesh.fsdp=-1 --config.train.batch_prompts=32 \
  --config.train.mini_batch=128 --config.train.micro_batch=8
# Qwen3-8B and Gemma-3-4B's text model (issue 67), K&K lengths: LoRA on ONE H100 (bfloat16 base, 4 prompts x 8
# responses), and full fine-tuning on a v5p-8 (fsdp=4, float32 master weights; 16 prompts x 8 for Qwen3-8B, whose
# KV cache is 144 KiB a token, 32 x 8 for Gemma-3-4B, 136 KiB: docs/reference/memory.md)
for model in qwen3-8b gemma3-4b; do
  name="kk${model//-/_}"
  compile "${name}_lora" h100 "--config=configs/kk.py:$model,grpo_ar_lopti" --config.mesh.fsdp=1 \
    --config.train.batch_prompts=4 --config.train.mini_batch=16 --config.train.micro_batch=1 \
    --config.model.param_dtype=bfloat16 "${LORA[@]}"
done
compile kkqwen3_8b v5p-8 "--config=configs/kk.py:qwen3-8b,grpo_ar_lopti" --config.mesh.fsdp=4 --config.train.micro_batch=4 \
  --config.train.batch_prompts=16 --config.train.mini_batch=64
compile kkgemma3_4b v5p-8 "--config=configs/kk.py:gemma3-4b,grpo_ar_lopti" --config.mesh.fsdp=4 \
  --config.train.micro_batch=4 --config.train.batch_prompts=32 --config.train.mini_batch=128
# the sampling loop's copies of the policy (issue 78): 3B colocated and with the sampler on devices of its own
# (rollout.devices: 2 + 2 chips of a v5p-8, 4 + 4 H100s), at max_staleness 0 and 1; and 7B on a v5p-64 as 16 + 16
# (8 processes: the weight sync gathers each array whole on a trainer chip before it crosses)
for k in 0 1; do
  compile "kk3b_colocated_k$k" v5p-8 "--config=configs/layouts/v5p8.py:3b,grpo_ar_lopti" --config.rollout.max_staleness=$k
  compile "kk3b_split_2+2_k$k" v5p-8 "--config=configs/layouts/v5p8.py:3b,grpo_ar_lopti" --config.rollout.max_staleness=$k \
    --config.rollout.devices=2 --config.mesh.fsdp=2 --config.train.micro_batch=2
  compile "kk3b_colocated_k$k" h100x8 "--config=configs/layouts/gpu8x80.py:3b,grpo_ar_lopti" \
    --config.rollout.max_staleness=$k
  compile "kk3b_split_4+4_k$k" h100x8 "--config=configs/layouts/gpu8x80.py:3b,grpo_ar_lopti" \
    --config.rollout.max_staleness=$k --config.rollout.devices=4 --config.mesh.fsdp=4 --config.train.micro_batch=4
done
compile kk7b_split_16+16_k1 v5p-64 "--config=configs/layouts/v5p8.py:7b,grpo_ar_lopti" --config.rollout.max_staleness=1 \
  --config.rollout.devices=16 --config.mesh.fsdp=16 --config.train.micro_batch=16
# sampler hosts of their own (rollout.hosts, rl/hosts.py): on a v5p-32 hosts 0-1 train and 2-3 sample (8 + 8 chips),
# on a v5p-16 host 0 trains and host 1 samples (4 + 4); the sampler's mesh mirrors the trainer's, k = 1
compile kk3b_hosts_8+8_k1 v5p-32 "--config=configs/layouts/v5p8.py:3b,grpo_ar_lopti" --config.rollout.max_staleness=1 \
  --config.rollout.hosts=2 --config.mesh.fsdp=8 --config.train.micro_batch=8
compile kk3b_hosts_4+4_k1 v5p-16 "--config=configs/layouts/v5p8.py:3b,grpo_ar_lopti" --config.rollout.max_staleness=1 \
  --config.rollout.hosts=1 --config.mesh.fsdp=4 --config.train.micro_batch=4
# tool episodes (issue 80): the 3B layouts of a v5p-8 and 8 H100s on calc with the calculator, Qwen2.5's
# <tool_call> format, episodes of up to 4 turns of 1,024 tokens with observations of up to 256, in the layouts'
# 4,096-token budget; the episodes' programs (rollout/episodes.py), colocated at max_staleness 0 and 1
CALC=(--config.env.name=calc --config.env.max_turns=4 --config.env.turn_tokens=1024
  --config.env.observation_tokens=256 --config.data.train_files=data/calc/train.parquet
  --config.data.test_files=data/calc/test.parquet)
for k in 0 1; do
  compile "calc3b_colocated_k$k" v5p-8 "--config=configs/layouts/v5p8.py:3b,grpo_ar_lopti" "${CALC[@]}" \
    --config.rollout.max_staleness=$k
  compile "calc3b_colocated_k$k" h100x8 "--config=configs/layouts/gpu8x80.py:3b,grpo_ar_lopti" "${CALC[@]}" \
    --config.rollout.max_staleness=$k
done
