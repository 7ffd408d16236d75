#!/usr/bin/env bash
# GPT-2 124M training throughput and MFU on one NVIDIA GPU (H100/H200), from a fresh machine with only pip.
#
#   bash bench/gpu.sh                 # ≈ 5–8 min: venv + jax[cuda12] install, then the runs below
#   STEPS=500 BATCH=32 bash bench/gpu.sh
#
# Synthetic tokens (GPT-2's 50304-row vocabulary), sequence 1024, bfloat16 compute, float32 params and
# AdamW state; the step is jitted exactly as the trainer's (donated state, no host sync in the loop).
# Prints the measured bfloat16 matmul peak, then a Markdown table: tokens/s, step time, MFU against the
# measured peak and the catalogue peak (989 TFLOP/s dense bf16 for H100/H200 SXM). Then, briefly: cuDNN
# vs XLA attention, float16 + dynamic loss scaling, and ZeRO-Offload (AdamW state in pinned host memory).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS="${STEPS:-300}"
BATCH="${BATCH:-16}"
VENV="${VENV:-.venv-gpu}"

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q -e . "jax[cuda12]"
fi
PY="$VENV/bin/python"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
"$PY" -c "import jax; d = jax.devices()[0]; print('device:', d.device_kind, d.platform); assert d.platform == 'gpu', 'no GPU visible'"

bench() { "$PY" bench/train_throughput.py --models=gpt2_small --seq_lens=1024 "$@"; }

echo "## GPT-2 124M, bfloat16, seq 1024, batch $BATCH, cuDNN flash attention, $STEPS steps"
bench --batch_sizes="$BATCH" --dtypes=bfloat16 --attention_impls=cudnn --steps="$STEPS" --warmup=5 \
  --json=/tmp/gpu_bench_main.json
echo "## attention: XLA vs cuDNN; remat save_dots; larger batch (50 steps each)"
bench --batch_sizes="$BATCH,$((BATCH * 2))" --dtypes=bfloat16 --attention_impls=xla,cudnn \
  --remat_policies=none,save_dots --steps=50 --warmup=3 || echo "(some points failed, e.g. out of memory)"
echo "## float16 + dynamic loss scaling (50 steps)"
bench --batch_sizes="$BATCH" --dtypes=float16 --attention_impls=cudnn --steps=50 --warmup=3 || true
echo "## ZeRO-Offload: AdamW state in pinned host memory (50 steps)"
bench --batch_sizes="$BATCH" --dtypes=bfloat16 --attention_impls=cudnn --steps=50 --warmup=3 \
  --offload_optimizer || echo "(offload failed: see the error above)"
