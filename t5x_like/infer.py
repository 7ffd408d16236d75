"""`python -m t5x_like.infer --gin_file=... --gin.MODEL_DIR=... --prompt=... [--tokenizer=...]`: sample text from the latest checkpoint.

`--chat --prompt_file=IN.jsonl [--output_file=OUT.jsonl]`: answer conversations (inference/chat_eval.py);
each output line is {"messages": [the prompt turns..., {"role": "assistant", "content": <generated>}]}.
"""

import json
import sys

from absl import flags

from t5x_like import cli as gin_utils
from t5x_like import files
from t5x_like.data import chat
from t5x_like.model import decoder as model
from t5x_like.inference import chat_eval
from t5x_like.inference import text as text_lib
from t5x_like.training import runtime as runtime_lib

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The CLI's flags; defined only when run as a program (tests import this module)."""
  gin_utils.define_gin_flags()
  flags.DEFINE_multi_string("prompt", [], "Prompt text; repeat the flag for a batch of prompts.")
  flags.DEFINE_string("prompt_file", None, "A file with one prompt per line (added to --prompt); with --chat, "
                      "JSON lines: {\"messages\": [...]} or {\"prompt\": ...} (a final assistant turn is dropped "
                      "and answered anew).")
  flags.DEFINE_bool("chat", False, "Answer conversations: render each with the chat template (the chat DATA_DIR's, "
                    "else gin's data.ChatTemplate) and generate the assistant turn, stopping at its end marker. "
                    "Each --prompt is one user turn.")
  flags.DEFINE_string("output_file", None, "--chat: write the answered conversations here as JSON lines "
                      "(default: stdout).")
  flags.DEFINE_integer("batch_size", 16, "Sequences generated at once (the engine's slots).")
  flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate after each prompt.")
  flags.DEFINE_float("temperature", 0.0, "0 = greedy; otherwise softmax temperature.")
  flags.DEFINE_integer("top_k", 0, "Sample only among the k most likely tokens (0 = all).")
  flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: the smallest set of tokens with this much probability.")
  flags.DEFINE_integer("seed", 0, "Sampling seed.")
  flags.DEFINE_integer("step", None, "Checkpoint step to load (default: the newest good one).")
  flags.DEFINE_string("tokenizer", None, "Tokenizer instead of DATA_DIR's: a SentencePiece .model, an HF "
                      "tokenizer.json or HF folder (e.g. a converted MODEL_DIR); with it DATA_DIR may be ''.")


def chat_main(exp: runtime_lib.Runtime) -> None:
  """--chat: answers every conversation of --prompt_file and every --prompt, in order."""
  lines = chat_eval.read_chat_lines(FLAGS.prompt_file) if FLAGS.prompt_file else []
  for i, prompt in enumerate(FLAGS.prompt):
    where = f"--prompt[{i}]"
    try:
      messages, _ = chat_eval.parse_prompt({"prompt": prompt})
    except chat.MalformedLine as e:
      raise ValueError(f"{where}: {e}") from None
    lines.append(chat_eval.ChatLine(where, tuple(messages)))
  if not lines:
    raise ValueError("no prompt: pass --prompt_file=IN.jsonl or --prompt='...' (repeatable)")
  if FLAGS.batch_size < 1:
    raise ValueError(f"--batch_size must be >= 1, got {FLAGS.batch_size}")
  encoder = chat_eval.encoder_for(exp, gin_utils.configured(chat.ChatTemplate, "data"), FLAGS.tokenizer)
  prompts = chat_eval.encode_prompts(encoder, lines)
  chat_eval.check_fits(lines, [len(p) for p in prompts], FLAGS.max_new_tokens, exp.model_config.max_len,
                       "prompt + --max_new_tokens")
  with exp.context():
    step, params = exp.restore_params(FLAGS.step)
    engine = chat_eval.engine_for(params, exp.model_config, FLAGS.batch_size, encoder, seed=FLAGS.seed)
    texts = chat_eval.generate(engine, encoder, prompts, max_new_tokens=FLAGS.max_new_tokens,
                               temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p, seed=FLAGS.seed)
  out = "".join(json.dumps(chat_eval.answered(line, text), ensure_ascii=False) + "\n"
                for line, text in zip(lines, texts))
  if FLAGS.output_file:
    files.write_atomic(FLAGS.output_file, out)
    print(f"# checkpoint step {step}: {len(lines)} answers written to {FLAGS.output_file}", flush=True)
  else:
    print(f"# checkpoint step {step}", file=sys.stderr, flush=True)
    sys.stdout.write(out)
    sys.stdout.flush()


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments {argv[1:]}")
  gin_utils.parse_gin_flags()
  # no optimizer, no objective: a LoRA run's checkpoint is read with the settings it records
  exp = runtime_lib.Runtime(gin_utils.train_config(), gin_utils.configured(model.GPTConfig, "model"))
  if FLAGS.chat:
    chat_main(exp)
    return
  prompts = list(FLAGS.prompt)
  if FLAGS.prompt_file:
    with open(FLAGS.prompt_file, encoding="utf-8") as f:
      prompts += [line.rstrip("\n") for line in f if line.strip()]
  if not prompts:
    raise ValueError("no prompt: pass --prompt='...' (repeatable) or --prompt_file=FILE")
  step, continuations = text_lib.sample(exp, prompts, max_new_tokens=FLAGS.max_new_tokens,
                                        temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
                                        seed=FLAGS.seed, step=FLAGS.step, tokenizer=FLAGS.tokenizer,
                                        batch_size=FLAGS.batch_size)
  print(f"# checkpoint step {step}", flush=True)
  for i, (prompt, text) in enumerate(zip(prompts, continuations)):
    if len(prompts) > 1:  # a continuation may span lines: mark where each sample starts
      print(f"# sample {i + 1}/{len(prompts)}", flush=True)
    print(prompt + text, flush=True)


if __name__ == "__main__":
  define_flags()
  gin_utils.run(main)
