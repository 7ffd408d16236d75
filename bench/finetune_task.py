"""A task the base model cannot do and a fine-tuned one can: full, LoRA and attention-only SFT from one base.

    python bench/finetune_task.py [--work_dir runs/finetune_task] [--task first|reverse|lookup] [--finetune_steps 300]

Every stage runs through the command-line entry points, as docs/finetune.md walks through them:
  1. the built-in corpus (data/pystdlib/prepare.py, a few MB of the standard library's source);
  2. a base model: llama_tiny (--model) pre-trained on it (configs/experiments/pystdlib_demo.gin's run);
  3. a generated chat task (t5x_like/data/chat_synth.py), train and held-out test JSON lines;
  4. `preprocess --format=chat` with the base's tokenizer;
  5. `train` with configs/runs/finetune.gin and INITIAL_CHECKPOINT_PATH=base, three ways: all weights,
     LoRA adapters (lora.LoraConfig.rank), the attention layers only (TRAINABLE='attention');
  6. `evaluate --generate` on the held-out lines: exact match and reference loss, for the base and each.
Prints a table (and writes it, with every report, to WORK_DIR/results.json). Stages whose output exists are
reused (the corpus, the base), so a second run re-measures only the fine-tunes; --fresh starts over.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from t5x_like.data import chat_synth  # pylint: disable=g-import-not-at-top,wrong-import-position

# The chat template's role markers are tokens a base pre-trained on plain text never saw: their embedding
# rows are untrained and its output head learnt never to predict them (`<|end|>`, which ends every answer).
# LoRA trains those rows by default (lora.LoraConfig.marker_rows); "lora-no-markers" is LoRA without them.
# The "+head" variants also train the whole tables (as PEFT's modules_to_save does for added tokens): LoRA
# adapters on the embedding table and lm_head too, or the attention layers plus both tables.
LORA_WITH_TABLES = ("--gin.lora.LoraConfig.targets='blocks/attn/(qkv|query|key_value|out)/kernel|"
                    "blocks/mlp_(in|gate|out)/kernel|lm_head/kernel|token_embedding'")
# name → (train gin bindings, learning rate); LoRA adapters start at zero effect and want a larger step (3e-3: on
# the 'first' task 1e-3 answered 0.28, 1e-2 and 3e-2 0.04, docs/finetune.md).
LORA_LR = 3e-3
VARIANTS = {
    "full": ([], 1e-3),
    "lora": (["--gin.lora.LoraConfig.rank=8"], LORA_LR),
    "lora-no-markers": (["--gin.lora.LoraConfig.rank=8", "--gin.lora.LoraConfig.marker_rows=False"], LORA_LR),
    "attention": (["--gin.TRAINABLE='attention'"], 1e-3),
    "lora+head": (["--gin.lora.LoraConfig.rank=8", LORA_WITH_TABLES], LORA_LR),
    "attention+head": (["--gin.TRAINABLE='blocks/attn/.*|lm_head/.*|token_embedding'"], 1e-3),
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--work_dir", default=os.path.join(REPO, "runs", "finetune_task"))
  p.add_argument("--fresh", action="store_true", help="Delete --work_dir first (the corpus and base too).")
  p.add_argument("--task", default="first", choices=chat_synth.TASKS)
  p.add_argument("--num_train", type=int, default=4000)
  p.add_argument("--num_test", type=int, default=100)
  p.add_argument("--corpus_mb", type=float, default=4.0, help="Standard-library source for the base's corpus.")
  p.add_argument("--model", default="llama_tiny", help="configs/models/<MODEL>.gin of the base and the fine-tunes.")
  p.add_argument("--pretrain_steps", type=int, default=300)
  p.add_argument("--finetune_steps", type=int, default=300)
  p.add_argument("--batch_size", type=int, default=16)
  p.add_argument("--seq_len", type=int, default=64, help="Fine-tuning rows (conversations are packed whole).")
  p.add_argument("--variants", default=",".join(VARIANTS), help=f"Comma-separated subset of {list(VARIANTS)}.")
  return p.parse_args(argv)


def run(args, log_path: str) -> tuple[float, float]:
  """Runs a command (output to `log_path`); returns its (wall, CPU) seconds (CPU: user + system of the
  process and its children, which other jobs on a shared machine do not inflate). Raises with the log's
  tail on failure."""
  before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
  with open(log_path, "w", encoding="utf-8") as log:
    code = subprocess.call(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
  seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
  if code:
    tail = open(log_path, encoding="utf-8").read()[-3000:]
    raise RuntimeError(f"{' '.join(args[:4])} ... exited {code} (log {log_path}):\n{tail}")
  return seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def module(name: str, *args) -> list:
  return [sys.executable, "-m", f"t5x_like.{name}", *args]


def newest_step(model_dir: str) -> int:
  steps = [int(s) for s in os.listdir(os.path.join(model_dir, "checkpoints")) if s.isdigit()] if os.path.isdir(
      os.path.join(model_dir, "checkpoints")) else []
  return max(steps, default=-1)


def start_report(model_dir: str) -> dict:
  """The start-up report of a train run (trainable parameters, optimizer bytes) from its metrics.jsonl."""
  with open(os.path.join(model_dir, "metrics.jsonl"), encoding="utf-8") as f:
    for line in f:
      record = json.loads(line)
      if "params/trainable" in record:
        return record
  raise ValueError(f"{model_dir}/metrics.jsonl has no start-up report (params/trainable)")


def gin_files(model: str) -> list:
  return [f"--gin_file=configs/models/{model}.gin", "--gin_file=configs/runs/finetune.gin",
          "--gin.model.GPTConfig.dtype='float32'"]  # XLA:CPU has no fast bfloat16 matmul


def evaluate_generate(work: str, name: str, model: str, model_dir: str, data_dir: str, test_file: str,
                      extra=()) -> dict:
  report = os.path.join(work, f"eval_{name}.json")
  seconds = run(module("evaluate", *gin_files(model),
                       "--generate", f"--prompt_file={test_file}", f"--output_file={report}", "--batch_size=50",
                       f"--gin.MODEL_DIR='{model_dir}'", f"--gin.DATA_DIR='{data_dir}'", *extra),
                os.path.join(work, f"eval_{name}.log"))
  with open(report, encoding="utf-8") as f:
    return dict(json.load(f), eval_seconds=seconds[0])


def main(argv=None) -> None:
  args = parse_args(argv)
  work = os.path.abspath(args.work_dir)
  if args.fresh and os.path.isdir(work):
    shutil.rmtree(work)
  os.makedirs(work, exist_ok=True)
  timings, started = {}, time.perf_counter()
  corpus, base = os.path.join(work, "pystdlib"), os.path.join(work, f"base_{args.model}")

  if not os.path.exists(os.path.join(corpus, "manifest.json")):
    timings["corpus"] = run([sys.executable, "data/pystdlib/prepare.py", f"--output_dir={corpus}",
                             f"--max_mb={args.corpus_mb}"], os.path.join(work, "prepare.log"))
  if newest_step(base) != args.pretrain_steps:
    shutil.rmtree(base, ignore_errors=True)
    timings["pretrain"] = run(module("train", "--gin_file=configs/experiments/pystdlib_demo.gin",
                                     f"--gin_file=configs/models/{args.model}.gin",
                                     f"--gin.MODEL_DIR='{base}'", f"--gin.DATA_DIR='{corpus}'",
                                     f"--gin.TRAIN_STEPS={args.pretrain_steps}",
                                     f"--gin.EVAL_EVERY={args.pretrain_steps}",
                                     f"--gin.CHECKPOINT_EVERY={args.pretrain_steps}", "--gin.LOG_EVERY=50"),
                              os.path.join(work, "pretrain.log"))
  print(f"base: {args.model} pre-trained {args.pretrain_steps} steps on {corpus}", flush=True)

  task_dir, chat_dir = os.path.join(work, "task"), os.path.join(work, "chat")
  train_file, test_file = chat_synth.write_synthetic_chat(task_dir, args.task, args.num_train, args.num_test)
  shutil.rmtree(chat_dir, ignore_errors=True)
  timings["preprocess"] = run(module("preprocess", "--format=chat", f"--input={train_file}",
                                     f"--output_dir={chat_dir}", f"--tokenizer={corpus}", "--validation_fraction=0.05",
                                     "--num_train_shards=2"), os.path.join(work, "preprocess.log"))

  rows = [{"variant": "base", **evaluate_generate(work, "base", args.model, base, chat_dir, test_file)}]
  print(f"base: exact match {rows[0]['generate/exact_match']:.3f}", flush=True)
  for name in args.variants.split(","):
    bindings, learning_rate = VARIANTS[name]
    model_dir = os.path.join(work, f"ft_{name}")
    shutil.rmtree(model_dir, ignore_errors=True)
    seconds, cpu_seconds = run(module(
        "train", *gin_files(args.model), f"--gin.MODEL_DIR='{model_dir}'", f"--gin.DATA_DIR='{chat_dir}'",
        f"--gin.INITIAL_CHECKPOINT_PATH='{base}'", f"--gin.TRAIN_STEPS={args.finetune_steps}",
        f"--gin.BATCH_SIZE={args.batch_size}", f"--gin.SEQ_LEN={args.seq_len}", "--gin.LOG_EVERY=50",
        f"--gin.EVAL_EVERY={args.finetune_steps}", f"--gin.CHECKPOINT_EVERY={args.finetune_steps}",
        f"--gin.optimizer.OptimizerConfig.learning_rate={learning_rate}", *bindings),
        os.path.join(work, f"ft_{name}.log"))
    evaluated = evaluate_generate(work, name, args.model, model_dir, chat_dir, test_file, bindings)
    rows.append({"variant": name, "train_seconds": seconds, "train_cpu_seconds": cpu_seconds,
                 "learning_rate": learning_rate, **start_report(model_dir), **evaluated})
    print(f"{name}: exact match {evaluated['generate/exact_match']:.3f} after {seconds:.0f} s", flush=True)

  print_table(rows, args)
  print(f"\nwhole bench: {time.perf_counter() - started:.0f} s wall (stages in WORK_DIR/results.json)")
  with open(os.path.join(work, "results.json"), "w", encoding="utf-8") as f:
    json.dump({"args": vars(args), "stage_wall_cpu_seconds": timings, "rows": rows}, f, indent=1)


def print_table(rows: list, args) -> None:
  print(f"\nheld-out {args.task}: {args.num_test} conversations; fine-tuning {args.finetune_steps} steps of "
        f"{args.batch_size} x {args.seq_len} tokens, {args.num_train} training conversations\n")
  header = ("variant", "trainable params", "trainable %", "opt. state B/dev", "train wall s", "train CPU s",
            "exact match", "ref. loss")
  print("| " + " | ".join(header) + " |")
  print("|" + "---|" * len(header))
  for r in rows:
    trainable = r.get("params/trainable")
    cells = (r["variant"], f"{trainable:,}" if trainable else "-",
             f"{100 * r['params/trainable_fraction']:.2f}" if trainable else "-",
             f"{r['memory/opt_state_bytes_per_device']:,}" if trainable else "-",
             f"{r['train_seconds']:.0f}" if "train_seconds" in r else "-",
             f"{r['train_cpu_seconds']:.0f}" if "train_seconds" in r else "-",
             f"{r['generate/exact_match']:.3f}", f"{r['generate/loss']:.3f}")
    print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()
