#!/usr/bin/env bash
# The whole post-training pipeline on built-in and generated data, one command a stage (docs/alignment.md):
#   pre-train (the Python standard library's source) → SFT (a generated chat task) → reward model and DPO
#   (preference pairs of the same task) → GRPO with a verifiable reward (exact match) and with the learned reward →
#   PPO with the learned reward, a value head and a KL penalty (RLHF as InstructGPT trained it).
# Each stage prints its held-out figures; the numbers in docs/alignment.md come from this script on a 2-core CPU.
#
#   bash bench/alignment_pipeline.sh [WORK_DIR]        (≈ 30 min on 2 CPU cores; a WORK_DIR whose base/ exists keeps it)
# SFT_STEPS (default 60) leaves the SFT model answering part of the held-out prompts, so GRPO has room to improve:
# after 300 steps it already answers all of them.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-/tmp/align}
M=configs/models/llama_tiny.gin
F32=(--gin.model.GPTConfig.dtype="'float32'")  # tiny models train faster in float32 on a CPU
mkdir -p "$W"
stage() { echo; echo "=== $* ($(date +%T))"; }
evaluate() { python -m t5x_like.evaluate "$@" 2>&1 | grep -E "^\{|eval/" | tail -1; }

stage "0. data: the built-in corpus; one generated task as chat (SFT, GRPO) and as preference pairs (RM, DPO)"
# The task (t5x_like/data/preference_synth.py): "reverse: a b c not x" → "c b a"; the rejected answer of a pair
# puts x in place of one word. SFT learns the chosen answers of other prompts (seed 1) than the pairs' (seed 0).
[ -f "$W/pystdlib/manifest.json" ] || python data/pystdlib/prepare.py --output_dir="$W/pystdlib" --max_mb=4
mkdir -p "$W/task"
python -c "
import json; from t5x_like.data import preference_synth
with open('$W/task/chat.jsonl', 'w') as f:
  for p in preference_synth.make_pairs(4000, seed=1): f.write(json.dumps({'prompt': p['prompt'], 'completion': p['chosen']}) + '\n')"
python -m t5x_like.preprocess --format=chat --input="$W/task/chat.jsonl" --output_dir="$W/chat" \
  --tokenizer="$W/pystdlib" --validation_fraction=0.05
python -c "from t5x_like.data import preference_synth; preference_synth.write_synthetic_preferences('$W/pairs', 1200)"
python -m t5x_like.preprocess --format=preference --input="$W/pairs/reverse_pairs.jsonl" --output_dir="$W/prefs" \
  --tokenizer="$W/pystdlib" --pack_length=65 --validation_fraction=0.1

stage "1. pre-train"
[ -d "$W/base/checkpoints" ] && echo "(kept: $W/base)" || python -m t5x_like.train --gin_file=configs/experiments/pystdlib_demo.gin --gin_file=$M \
  --gin.MODEL_DIR="'$W/base'" --gin.DATA_DIR="'$W/pystdlib'" --gin.TRAIN_STEPS=300

stage "2. supervised fine-tuning (chat)"
python -m t5x_like.train --gin_file=$M --gin_file=configs/runs/finetune.gin "${F32[@]}" \
  --gin.MODEL_DIR="'$W/sft'" --gin.DATA_DIR="'$W/chat'" --gin.INITIAL_CHECKPOINT_PATH="'$W/base'" \
  --gin.TRAIN_STEPS=${SFT_STEPS:-60} --gin.BATCH_SIZE=16 --gin.SEQ_LEN=64 --gin.optimizer.OptimizerConfig.learning_rate=1e-3

stage "3. reward model (Bradley–Terry on the pairs), from the SFT model"
RM=(--gin_file=$M --gin_file=configs/runs/reward.gin "${F32[@]}" --gin.MODEL_DIR="'$W/rm'" --gin.DATA_DIR="'$W/prefs'"
    --gin.INITIAL_CHECKPOINT_PATH="'$W/sft'" --gin.SEQ_LEN=64 --gin.BATCH_SIZE=16)
python -m t5x_like.train "${RM[@]}" --gin.TRAIN_STEPS=150 --gin.optimizer.OptimizerConfig.learning_rate=1e-3
echo "reward model, held-out pairs:"; evaluate "${RM[@]}"

stage "4. DPO on the pairs, from the SFT model (its own reference)"
DPO=(--gin_file=$M --gin_file=configs/runs/dpo.gin "${F32[@]}" --gin.MODEL_DIR="'$W/dpo'" --gin.DATA_DIR="'$W/prefs'"
     --gin.INITIAL_CHECKPOINT_PATH="'$W/sft'" --gin.SEQ_LEN=64 --gin.BATCH_SIZE=16)
python -m t5x_like.train "${DPO[@]}" --gin.TRAIN_STEPS=60 --gin.optimizer.OptimizerConfig.learning_rate=1e-4
echo "DPO, held-out pairs:"; evaluate "${DPO[@]}"

stage "5. GRPO with the exact-match reward, from the SFT model"
GRPO=(--gin_file=$M --gin_file=configs/runs/grpo.gin "${F32[@]}" --gin.DATA_DIR="'$W/chat'"
      --gin.INITIAL_CHECKPOINT_PATH="'$W/sft'" --gin.SEQ_LEN=64 --gin.BATCH_SIZE=64 --gin.GRPO_GROUP=8
      --gin.GRPO_MAX_NEW_TOKENS=16 --gin.data.DataConfig.eval_batches=2)
echo "SFT model, held-out prompts (greedy):"; evaluate "${GRPO[@]}" --gin.MODEL_DIR="'$W/sft'"
python -m t5x_like.train "${GRPO[@]}" --gin.MODEL_DIR="'$W/grpo'" --gin.TRAIN_STEPS=60 --gin.EVAL_EVERY=20 \
  --gin.optimizer.OptimizerConfig.learning_rate=2e-4 --gin.optimizer.OptimizerConfig.warmup_steps=10
echo "GRPO (exact match), held-out prompts:"; evaluate "${GRPO[@]}" --gin.MODEL_DIR="'$W/grpo'"

stage "6. GRPO with the learned reward (RLHF), from the SFT model"
python -m t5x_like.train "${GRPO[@]}" --gin.MODEL_DIR="'$W/rlhf'" --gin.TRAIN_STEPS=60 --gin.EVAL_EVERY=20 \
  --gin.GRPO_REWARD="'reward_model'" --gin.grpo.GrpoConfig.reward_checkpoint="'$W/rm'" \
  --gin.optimizer.OptimizerConfig.learning_rate=2e-4 --gin.optimizer.OptimizerConfig.warmup_steps=10
echo "GRPO (learned reward), held-out prompts:"
evaluate "${GRPO[@]}" --gin.MODEL_DIR="'$W/rlhf'" --gin.GRPO_REWARD="'reward_model'" \
  --gin.grpo.GrpoConfig.reward_checkpoint="'$W/rm'"

stage "7. PPO with the learned reward (RLHF: value head, per-token KL penalty), from the SFT model"
PPO=(--gin_file=$M --gin_file=configs/runs/ppo.gin "${F32[@]}" --gin.DATA_DIR="'$W/chat'"
     --gin.INITIAL_CHECKPOINT_PATH="'$W/sft'" --gin.SEQ_LEN=64 --gin.BATCH_SIZE=32 --gin.PPO_MINIBATCHES=2
     --gin.PPO_EPOCHS=2 --gin.PPO_MAX_NEW_TOKENS=16 --gin.PPO_REWARD="'reward_model'"
     --gin.REWARD_CHECKPOINT_PATH="'$W/rm'" --gin.data.DataConfig.eval_batches=4)
echo "SFT model, held-out prompts (greedy), learned reward:"; evaluate "${PPO[@]}" --gin.MODEL_DIR="'$W/sft'"
python -m t5x_like.train "${PPO[@]}" --gin.MODEL_DIR="'$W/ppo'" --gin.TRAIN_STEPS=120 --gin.EVAL_EVERY=40 \
  --gin.optimizer.OptimizerConfig.learning_rate=2e-4 --gin.optimizer.OptimizerConfig.warmup_steps=10
echo "PPO (learned reward), held-out prompts:"; evaluate "${PPO[@]}" --gin.MODEL_DIR="'$W/ppo'"
stage "done"
