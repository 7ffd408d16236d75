"""lm-eval tasks during training: every `ObserveConfig.task_every` steps and at the end, the run's current
parameters are evaluated on `ObserveConfig.tasks`, and each numeric metric reaches the run's metric sinks
(metrics.jsonl, TensorBoard, Prometheus, trackers) as `tasks/<task>/<metric>`.

The tasks are loaded and checked when the hook is built, before anything compiles: a task that cannot load is a
one-line error then. A later failure (a data file removed mid-run, an error inside lm-eval) is logged once and
training goes on.
"""

from typing import Optional

from absl import logging
import jax

from t5x_like.data import chat
from t5x_like.evaluation import harness
from t5x_like.evaluation import tasks as lm_tasks
from t5x_like.evaluation.runs import Run
from t5x_like.inference import chat_eval
from t5x_like.observe import ObserveConfig


class TaskEvalHook:
  """hook(step, state, step_metrics): the tasks on `state.params` when `step` is due (see the module doc)."""

  def __init__(self, config: ObserveConfig, runtime, sinks, train_steps: int):
    self.config, self.runtime, self.sinks, self.train_steps = config, runtime, list(sinks), train_steps
    self.manager = lm_tasks.task_manager(list(config.tasks), config.task_dir or lm_tasks.shipped_task_dir())
    lm_tasks.load_tasks(list(config.tasks), self.manager)  # before anything compiles: a bad task stops the start
    self.tokenizer = runtime.load_tokenizer(None)
    self.template = chat_eval.template_for(runtime.manifest, runtime.config.data_dir, chat.ChatTemplate())
    self.lm: Optional[harness.T5xLikeLM] = None
    self.failed = False
    self.last = {}

  def due(self, step: int) -> bool:
    every = self.config.task_every
    return step == self.train_steps or (every > 0 and step % every == 0)

  def __call__(self, step: int, state, step_metrics) -> None:
    if not self.due(step):
      return
    try:
      self.last = self.evaluate(state.params)
    except Exception as e:  # pylint: disable=broad-except  # never stops training; said once
      if not self.failed:
        logging.warning("task evaluation failed at step %d (reported once; training goes on): %s", step,
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
        self.failed = True
      return
    for sink in self.sinks:
      sink.write(step, self.last)
    logging.info("step %d: %s", step, "  ".join(f"{k} {v:.4g}" for k, v in sorted(self.last.items())))

  def evaluate(self, params) -> dict:
    """{'tasks/<task>/<metric>': value} of the tasks on `params` (the model's parameters on the run's mesh)."""
    run = Run(self.runtime.model_config, params, self.runtime.mesh, self.runtime.rules, self.tokenizer,
              self.template)
    if self.lm is None:
      self.lm = harness.T5xLikeLM(run=run, batch_size=self.config.task_batch_size)
    else:  # same shapes: the compiled scorer and engine are reused with the new parameters
      self.lm.run = run
      self.lm.scorer.params = self.lm.engine.params = params
    with self.runtime.context():
      results = harness.evaluate(run, list(self.config.tasks), self.manager, limit=self.config.task_limit or None,
                                 lm=self.lm)
    return harness.scalars(results)


def task_hook_factory(config: ObserveConfig):
  """The trainer's hook factory for ObserveConfig.tasks: (runtime, sinks, train_steps) → TaskEvalHook, or None
  when no task is configured. A LoRA or other recipe whose state is not the model's parameters is refused."""
  def make(runtime, sinks, train_steps: int):
    if not config.tasks:
      return None
    if runtime.config.use_lora:
      raise ValueError("ObserveConfig.tasks with LoRA (LoraConfig.rank > 0): in-loop task evaluation reads the "
                       "model's parameters; evaluate the run's checkpoints with evaluate --tasks instead")
    if jax.process_count() > 1:
      raise ValueError("ObserveConfig.tasks in a multi-process run: not supported yet; evaluate the checkpoints "
                       "with evaluate --tasks")
    return TaskEvalHook(config, runtime, sinks, train_steps)
  return make
