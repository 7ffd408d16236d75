"""PPO (InstructGPT's RLHF): rollouts of a chat DATA_DIR's prompts scored by a reward model or a registered reward
function, a per-token KL penalty to a frozen reference in the reward, GAE over a value head on the policy, and
several epochs of clipped policy and value updates over minibatches of each rollout (posttrain/ppo.py, batches in
posttrain/ppo_rollout.py). Gin: configs/runs/ppo.gin.

The critic is a scalar head on the policy's trunk (model/heads.ScoredGPT), warm-started with the policy from
INITIAL_CHECKPOINT_PATH (an SFT model; the head starts at zero, or from a reward model's score head with
`critic_checkpoint`) and trained with it: one model, one optimizer, one checkpoint, which `infer` and `convert`
read as the policy.
"""

import dataclasses
import functools

import jax

from t5x_like.model import decoder
from t5x_like.model import heads
from t5x_like.posttrain import ppo
from t5x_like.posttrain import ppo_rollout
from t5x_like.posttrain import preference
from t5x_like.recipes import base
from t5x_like.training import checkpointing
from t5x_like.training import logprobs

NAME = "TrainConfig.recipe='ppo'"


@dataclasses.dataclass(frozen=True)
class PpoConfig(base.RolloutConfig):
  """PPO (gin: `ppo.PpoConfig`). Each rollout holds BATCH_SIZE × num_minibatches completions (num_generations per
  prompt) and trains ppo_epochs × num_minibatches optimizer steps of BATCH_SIZE rows each."""
  kl_coef: float = 0.05  # per-token KL penalty to the frozen reference, inside the reward (0 = no reference loaded)
  clip_epsilon: float = 0.2  # the policy ratio is clipped to [1 − ε, 1 + ε]
  value_clip: float = 0.2  # a value is clipped to the rollout's value ± this in the value loss
  vf_coef: float = 0.1  # the value loss's weight beside the policy loss
  gamma: float = 1.0  # GAE discount
  lam: float = 0.95  # GAE λ
  ppo_epochs: int = 4  # passes over each rollout
  num_minibatches: int = 1  # optimizer steps per pass (each of BATCH_SIZE rows)
  # the value head's initial kernel: '' = zeros; a reward model's MODEL_DIR or checkpoints/<step> = its score head
  # (InstructGPT initialises the critic from the reward model; here the head, on the policy's trunk)
  critic_checkpoint: str = ""
  scored_model = True  # the policy carries the value head (a class constant, not a gin setting)

  def needs_reference(self, run) -> bool:
    del run
    return self.kl_coef > 0

  def make_objective(self, run, *, loss_scaled: bool):
    del loss_scaled
    for name in ("ppo_epochs", "num_minibatches"):
      if getattr(self, name) < 1:
        raise ValueError(f"PpoConfig.{name}={getattr(self, name)} must be >= 1")
    for name in ("gamma", "lam"):
      if not 0 <= getattr(self, name) <= 1:
        raise ValueError(f"PpoConfig.{name}={getattr(self, name)} must be in [0, 1]")
    if self.kl_coef < 0:
      raise ValueError(f"PpoConfig.kl_coef={self.kl_coef} must be >= 0")
    if run.config.use_lora:
      raise ValueError(f"{NAME} with LoRA (LoraConfig.rank > 0): the value head would not train; use full or "
                       "selective fine-tuning")
    self.check_rollouts(run, NAME, run.config.batch_size * self.num_minibatches)
    if self.environment:
      raise ValueError(f"PpoConfig.environment={self.environment!r}: multi-turn episodes train with GRPO "
                       "(configs/runs/grpo.gin); PPO's GAE does not yet carry values across the environment's turns")
    if self.critic_checkpoint:
      self.critic_head_shape(run)  # a head that does not fit is an error now, before anything compiles
    return ppo.Ppo(ppo.value_head_forward(run.model.apply, run.model_config), clip_epsilon=self.clip_epsilon,
                   value_clip=self.value_clip, vf_coef=self.vf_coef)

  def critic_head_shape(self, run) -> tuple:
    """The shape of critic_checkpoint's score head, checked against the policy's value head.

    Raises:
      ValueError: one line naming the checkpoint and both shapes (GPTConfig.d_model), or the missing head.
    """
    _, path = checkpointing.resolve_checkpoint(self.critic_checkpoint)
    saved = checkpointing.state_tree_metadata(str(path)).get("params", {})
    if not heads.has_score_head(saved):
      raise ValueError(f"PpoConfig.critic_checkpoint={self.critic_checkpoint!r}: {path} has no "
                       f"'{heads.SCORE_HEAD}' (not a reward model: configs/runs/reward.gin)")
    shape, want = tuple(saved[heads.SCORE_HEAD].shape), (run.model_config.d_model, 1)
    if shape != want:
      raise ValueError(f"PpoConfig.critic_checkpoint={self.critic_checkpoint!r}: its {heads.SCORE_HEAD} has shape "
                       f"{shape}, the policy's value head {want} (GPTConfig.d_model={run.model_config.d_model}): "
                       "the critic does not fit the policy")
    return shape

  def initial_params(self, run, params):
    """A fresh run's value head: critic_checkpoint's score head, or the zeros it starts with."""
    if not self.critic_checkpoint:
      return params
    head = params[heads.SCORE_HEAD]
    abstract = {heads.SCORE_HEAD: jax.ShapeDtypeStruct(head.shape, head.dtype, sharding=head.sharding)}
    _, restored = checkpointing.restore_params(self.critic_checkpoint, abstract_params=abstract)
    return {**params, heads.SCORE_HEAD: restored[heads.SCORE_HEAD]}

  def rollouts(self, run) -> ppo_rollout.PpoRollouts:
    """The run's rollouts and the minibatches of each, built once per run."""
    forward = ppo.value_head_forward(run.model.apply, run.model_config)
    reference = decoder.GPT(run.model_config).apply  # the reference has no value head

    def stats(params, frozen, batch):
      logits, values, _ = forward(params, batch)
      ref = (logprobs.model_token_logps(reference, frozen[preference.REFERENCE], batch)
             if preference.REFERENCE in frozen else None)
      return logprobs.token_logps(logits, batch["targets"]), values, ref
    return run.part("rollouts", lambda: ppo_rollout.PpoRollouts(run, stats))

  def batches(self, run, next_batch):
    """Each step's minibatch, of a rollout sampled from the parameters its cycle starts from."""
    del next_batch
    return lambda step: functools.partial(self.rollouts(run).batch, step=step)

  def evaluate(self, run, params) -> dict:
    """Greedy answers to the validation prompts, scored by the reward function (and exact match)."""
    return self.rollouts(run).rollouts.evaluate(params)


CONFIG = PpoConfig
