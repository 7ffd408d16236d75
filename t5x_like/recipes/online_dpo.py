"""Online DPO: two samples per prompt of a chat DATA_DIR from the current policy, judged by a registered reward
function or a reward model, then a DPO step on each pair against the frozen reference (posttrain/online_dpo.py,
the loss of posttrain/preference.py). Gin: configs/runs/online_dpo.gin.
"""

import dataclasses
import functools

import numpy as np

from t5x_like.model import decoder
from t5x_like.posttrain import online_dpo
from t5x_like.posttrain import preference
from t5x_like.posttrain import rollout
from t5x_like.recipes import base

NAME = "TrainConfig.recipe='online_dpo'"


@dataclasses.dataclass(frozen=True)
class OnlineDpoConfig(base.RolloutConfig):
  """Online DPO (gin: `online_dpo.OnlineDpoConfig`); BATCH_SIZE = prompts per step, each sampled twice."""
  loss_type: str = "sigmoid"  # 'sigmoid' (DPO), 'ipo', 'simpo' (reference-free), as dpo.DpoConfig
  beta: float = 0.1  # β: DPO/IPO: strength of the implicit KL to the reference; SimPO: reward scale
  gamma: float = 0.5  # SimPO's target reward margin γ
  num_generations: int = 2  # a pair per prompt (not a setting: any other value is refused)

  def make_objective(self, run, *, loss_scaled: bool):
    if self.num_generations != 2:
      raise ValueError(f"OnlineDpoConfig.num_generations={self.num_generations}: online DPO samples a pair (2) "
                       "per prompt")
    if loss_scaled:
      raise ValueError(f"{NAME} with dynamic loss scaling (float16): not supported, the scaled step normalises by "
                       "tokens, not pairs; use bfloat16 or float32")
    self.check_rollouts(run, NAME, 2 * run.config.batch_size)
    if self.environment:
      raise ValueError(f"OnlineDpoConfig.environment={self.environment!r}: multi-turn episodes train with GRPO "
                       "(configs/runs/grpo.gin)")
    if 2 * self.max_new_tokens > run.config.seq_len:
      raise ValueError(f"OnlineDpoConfig.max_new_tokens={self.max_new_tokens}: a row holds the prompt twice and both "
                       f"completions, so 2 × max_new_tokens must be at most SEQ_LEN={run.config.seq_len}")
    return preference.Preference(run.model.apply, loss_type=self.loss_type, beta=self.beta, gamma=self.gamma,
                                 max_pairs=1, logits_fn=decoder.logits_projection(run.model_config),
                                 loss_chunk=run.config.loss_chunk, moe=run.model_config.num_experts > 0)

  def rollouts(self, run) -> rollout.Rollouts:
    """2 × BATCH_SIZE samples a step; a prompt and a completion fit half a row."""
    return run.part("rollouts", lambda: rollout.Rollouts(run, rows=2 * run.config.batch_size,
                                                         row_tokens=(run.config.seq_len + 1) // 2))

  def batches(self, run, next_batch):
    del next_batch
    return lambda step: functools.partial(self.batch, run, step=step)

  def batch(self, run, params, step: int):
    """(global batch of this step's pairs, host metrics), sampled from `params`."""
    rollouts = self.rollouts(run)
    episodes = rollouts.collect(params, step)
    features, metrics = online_dpo.pair_rows(episodes, run.config.seq_len, rollouts.encoder.tokenizer.pad_id)
    # the engine's log-probs against the trainer's, on the samples laid out one per row
    rows = rollouts.rows_of(episodes, np.zeros(rollouts.rows, np.float32))
    gap = rollouts.logprob_gap(params, run.global_batch(rollouts.process_rows(rows)), rows["weights"], episodes)
    batch = run.global_batch(rollouts.process_rows(features))
    return batch, {**episodes.metrics(), **metrics, "rollout/logprob_gap": gap}

  def evaluate(self, run, params) -> dict:
    """Greedy answers to the validation prompts, scored by the reward function (and exact match)."""
    return self.rollouts(run).evaluate(params)


CONFIG = OnlineDpoConfig
