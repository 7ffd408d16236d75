"""`python -m t5x_like.evaluate --gin_file=... --gin.MODEL_DIR=... [--gin.DATA_DIR=...]`: loss/perplexity of a checkpoint.

`--generate --prompt_file=IN.jsonl`: answer each conversation greedily and score it against its reference (the
final assistant turn, or `completion`): exact match, and the teacher-forced loss on the references
(inference/chat_eval.py: the engine generates, the language-model objective scores). The report is one JSON object (stdout, and --output_file).

`--tasks=NAME[,NAME] [--task_dir=DIR] [--num_fewshot=K] [--limit=N] [--output_file=results.json]`: lm-evaluation-harness
tasks with lm-eval's own metrics (evaluation/; docs/evaluation.md); prints lm-eval's table, writes its results JSON.
"""

import dataclasses
import json

from absl import flags

from t5x_like import cli as gin_utils
from t5x_like import files
from t5x_like.data import chat
from t5x_like.data import tokenizer
from t5x_like.model import decoder as model
from t5x_like.evaluation import harness
from t5x_like.evaluation import runs
from t5x_like.evaluation import tasks as lm_tasks
from t5x_like.inference import chat_eval
from t5x_like.training import optimizer
from t5x_like.training.objectives import language_model
from t5x_like.recipes import experiment

gin_utils.define_gin_flags()
flags.DEFINE_integer("step", None, "Checkpoint step to evaluate (default: the newest good one).")
flags.DEFINE_string("split", "validation", "Split of DATA_DIR to evaluate on.")
flags.DEFINE_integer("eval_batches", None, "Batches to evaluate (default: DataConfig.eval_batches; "
                     "0 = the whole split).")
flags.DEFINE_string("tokenizer", None, "The model's tokenizer (.model, tokenizer.json or HF folder): refuse a "
                    "DATA_DIR whose records another tokenizer wrote.")
flags.DEFINE_bool("generate", False, "Evaluate by generation on --prompt_file instead of the loss on a split.")
flags.DEFINE_string("prompt_file", None, "--generate: JSON lines, each a conversation ending with its reference "
                    "assistant turn ({\"messages\": [...]} or {\"prompt\": ..., \"completion\": ...}).")
flags.DEFINE_integer("batch_size", 16, "--generate: conversations generated (and scored) at once.")
flags.DEFINE_integer("max_new_tokens", None, "--generate: tokens generated per answer (default: the longest "
                     "reference's + 1, so a right answer is never cut).")
flags.DEFINE_string("output_file", None, "--generate / --tasks: also write the JSON report (lm-eval's results JSON) "
                    "here.")
flags.DEFINE_list("tasks", [], "lm-eval tasks to run (NAME[,NAME]): from --task_dir, else lm-eval's own "
                  "(docs/evaluation.md); the shipped ones are in configs/tasks.")
flags.DEFINE_string("task_dir", None, "--tasks: a folder of lm-eval task YAMLs over local data files "
                    "(default: configs/tasks).")
flags.DEFINE_integer("num_fewshot", None, "--tasks: few-shot examples per prompt (default: each task's own).")
flags.DEFINE_integer("limit", None, "--tasks: evaluate only the first N documents of each task.")
FLAGS = flags.FLAGS


def generate_main(exp: experiment.Experiment) -> None:
  """--generate: exact match and reference loss of --prompt_file's conversations."""
  if not FLAGS.prompt_file:
    raise ValueError("--generate needs --prompt_file=IN.jsonl (conversations with reference answers)")
  if FLAGS.batch_size < 1:
    raise ValueError(f"--batch_size must be >= 1, got {FLAGS.batch_size}")
  lines = chat_eval.read_chat_lines(FLAGS.prompt_file, require_reference=True)
  encoder = chat_eval.encoder_for(exp, gin_utils.configured(chat.ChatTemplate, "data"), FLAGS.tokenizer)
  with exp.context():
    step, params = exp.restore_params(FLAGS.step)
    objective = language_model.LanguageModel(
        apply_fn=model.GPT(exp.model_config).apply, loss_chunk=exp.config.loss_chunk,
        logits_fn=lambda p, hidden: model.project_logits(p, hidden, exp.model_config))
    scores = chat_eval.evaluate(params, encoder, lines, objective=objective, config=exp.model_config,
                                batch_size=FLAGS.batch_size, max_new_tokens=FLAGS.max_new_tokens,
                                loss_chunk=exp.config.loss_chunk)
  report = {"step": int(step), "prompt_file": FLAGS.prompt_file, **scores}
  print(f"step {step}  {FLAGS.prompt_file}  exact match {scores['generate/exact_match']:.4f} "
        f"({scores['generate/exact_matches']}/{scores['generate/examples']})  reference loss "
        f"{scores['generate/loss']:.6f} ({int(scores['generate/tokens'])} tokens)", flush=True)
  text = json.dumps(report, ensure_ascii=False)
  print(text, flush=True)
  if FLAGS.output_file:
    files.write_atomic(FLAGS.output_file, text + "\n")


def tasks_main(config) -> None:
  """--tasks: lm-eval's tasks and metrics on the checkpoint; its table on stdout, its results JSON."""
  task_dir = FLAGS.task_dir or lm_tasks.shipped_task_dir()
  if FLAGS.num_fewshot is not None and FLAGS.num_fewshot < 0:
    raise ValueError(f"--num_fewshot must be >= 0, got {FLAGS.num_fewshot}")
  if FLAGS.limit is not None and FLAGS.limit < 1:
    raise ValueError(f"--limit must be >= 1, got {FLAGS.limit}")
  manager = lm_tasks.task_manager(FLAGS.tasks, task_dir)
  lm_tasks.load_tasks(FLAGS.tasks, manager, FLAGS.num_fewshot)  # before the model is restored
  run = runs.run_from_config(config, gin_utils.configured(model.GPTConfig, "model"), step=FLAGS.step,
                             tokenizer=FLAGS.tokenizer)
  results = harness.evaluate(run, FLAGS.tasks, manager, num_fewshot=FLAGS.num_fewshot, limit=FLAGS.limit,
                             batch_size=FLAGS.batch_size)
  print(f"step {run.step}", flush=True)
  print(harness.table(results), flush=True)
  if FLAGS.output_file:
    files.write_atomic(FLAGS.output_file, json.dumps(harness.results_json(results), indent=2, default=str) + "\n")


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments {argv[1:]}")
  gin_utils.parse_gin_flags()
  config = gin_utils.train_config()
  if FLAGS.tasks:
    tasks_main(config)
    return
  if FLAGS.eval_batches is not None:
    if FLAGS.eval_batches < 0:
      raise ValueError(f"--eval_batches must be >= 0, got {FLAGS.eval_batches}")
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, eval_batches=FLAGS.eval_batches))
  exp = experiment.Experiment(config, gin_utils.configured(model.GPTConfig, "model"),
                              gin_utils.configured(optimizer.OptimizerConfig, "optimizer"))
  if FLAGS.tokenizer:
    tokenizer.check_wrote(tokenizer.load(FLAGS.tokenizer), exp.manifest, config.data_dir)
  if FLAGS.generate:
    generate_main(exp)
    return
  result = exp.evaluate_checkpoint(FLAGS.step, FLAGS.split)
  if "eval/loss" in result:
    print(f"step {result['step']}  {result['split']}  loss {result['eval/loss']:.6f}  "
          f"perplexity {result['eval/perplexity']:.4f}  ({int(result['eval/tokens'])} tokens, "
          f"{result['eval/batches']} batches)", flush=True)
  else:  # GRPO: greedy answers to the validation prompts, scored by the run's reward
    print(f"step {result['step']}  {result['split']}  reward {result['eval/reward_mean']:.4f}  exact match "
          f"{result['eval/exact_match']:.4f}  ({result['eval/prompts']} prompts)", flush=True)
  print(json.dumps(result), flush=True)


if __name__ == "__main__":
  gin_utils.run(main)
