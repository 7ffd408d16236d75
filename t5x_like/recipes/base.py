"""What the recipes share: the recipe protocol, the reference model of DPO, GRPO and PPO, the rollout settings of
GRPO and PPO, the DATA_DIR format check, the pair checks."""

import dataclasses

from t5x_like.posttrain import environments
from t5x_like.posttrain import frozen_models
from t5x_like.posttrain import preference
from t5x_like.posttrain import rewards
from t5x_like.training import config as config_lib

Recipe = config_lib.Recipe  # the protocol every recipe config follows (defaults: language modelling's)


@dataclasses.dataclass(frozen=True)
class ReferenceConfig(Recipe):
  """Methods trained against a frozen reference model (DPO/IPO, GRPO's KL term, PPO's KL penalty), when they read
  one (`needs_reference`: not SimPO, not GRPO or PPO without their KL term)."""
  # the frozen reference model (REFERENCE_CHECKPOINT_PATH): a MODEL_DIR, checkpoints/<step> or converted checkpoint;
  # '' = CheckpointConfig.warm_start_from (INITIAL_CHECKPOINT_PATH)
  reference_checkpoint: str = ""

  def needs_reference(self, run) -> bool:
    """Whether the run reads the reference (default: when its objective does)."""
    return getattr(run.model_objective, "needs_reference", False)

  def frozen_models(self, run) -> tuple:
    if not self.needs_reference(run):
      return ()
    loss = getattr(run.model_objective, "loss_type", run.config.recipe)
    return (frozen_models.Frozen(
        name=preference.REFERENCE, path=self.reference_checkpoint or run.config.checkpoint.warm_start_from,
        what="reference model (REFERENCE_CHECKPOINT_PATH)",
        missing=f"the {loss} loss needs a reference model: set REFERENCE_CHECKPOINT_PATH "
                f"({type(self).__name__}.reference_checkpoint) or INITIAL_CHECKPOINT_PATH"),)


@dataclasses.dataclass(frozen=True)
class RolloutConfig(ReferenceConfig):
  """Methods that train on their own samples (GRPO, PPO): prompts of a chat DATA_DIR answered by the engine on the
  training mesh and scored by a registered reward function (posttrain/rollout.py)."""
  num_generations: int = 1  # samples per prompt
  reward: str = "exact_match"  # a registered reward function (posttrain/rewards.py): exact_match, format, reward_model
  reward_format: str = ""  # the `format` reward's regex: 1 when the whole completion matches it
  reward_checkpoint: str = ""  # the `reward_model` reward: a reward model's MODEL_DIR (configs/runs/reward.gin)
  max_new_tokens: int = 16  # rollout length budget per completion
  temperature: float = 1.0  # rollout sampling temperature (evaluation is greedy)
  top_k: int = 0  # rollout sampling: only the k most likely tokens (0 = all)
  # multi-turn episodes against a registered environment (posttrain/environments.py: 'calculator', or your own) in
  # place of one completion scored by `reward`; '' = single turn
  environment: str = ""
  max_turns: int = 4  # with an environment: the most assistant turns of an episode (then it is cut and counted)

  def play_fn(self):
    """The multi-turn episode player of `environment` (None without one), for rollout.Rollouts(play=...)."""
    if not self.environment:
      return None
    env = environments.get(self.environment, type(self).__name__)
    return lambda rollouts, params, prompt_set, indices, seed, temperature, top_k: environments.play(
        rollouts, params, prompt_set, indices, environment=env, seed=seed, max_turns=self.max_turns,
        temperature=temperature, top_k=top_k)

  def check_rollouts(self, run, what: str, rows: int) -> None:
    """The checks every rollout method makes: a chat DATA_DIR, `rows` completions per rollout in whole groups,
    room for max_new_tokens, no sequence-length warmup, a registered reward.

    Raises:
      ValueError: one line naming the setting.
    """
    config = run.config
    if run.manifest is not None and run.manifest.get("format") != "chat":
      raise ValueError(f"{what} samples answers to the prompts of a chat DATA_DIR (python -m t5x_like.preprocess "
                       f"--format=chat): DATA_DIR '{config.data_dir}' has format "
                       f"{run.manifest.get('format', 'text')!r}")
    name = type(self).__name__
    if rows % self.num_generations:
      raise ValueError(f"BATCH_SIZE={config.batch_size} is not a multiple of {name}.num_generations="
                       f"{self.num_generations} (BATCH_SIZE = prompts per step × samples per prompt)")
    if self.max_new_tokens < 1 or self.max_new_tokens > config.seq_len:
      raise ValueError(f"{name}.max_new_tokens={self.max_new_tokens} must be in [1, SEQ_LEN={config.seq_len}]")
    if config.curriculum.enabled():
      raise ValueError(f"{what} with a sequence-length warmup (CurriculumConfig): rollout rows are not cut; turn "
                       "the warmup off")
    rewards.get(self.reward, name)  # an unregistered name is an error now, not after the first rollout
    if self.environment:
      environments.get(self.environment, name)
      if self.max_turns < 1:
        raise ValueError(f"{name}.max_turns={self.max_turns} must be >= 1")


def check_format(run, expected: str, what: str) -> None:
  """A one-line error when the run's DATA_DIR is not of format `expected` (`what` names the setting)."""
  manifest = run.manifest
  if manifest is not None and manifest.get("format", "text") != expected:
    raise ValueError(f"{what} reads a {expected} DATA_DIR (python -m t5x_like.preprocess --format={expected}): "
                     f"DATA_DIR '{run.config.data_dir}' has format {manifest.get('format', 'text')!r}")


def check_pairs(run, loss_scaled: bool, what: str, unpaired_ok: bool = False) -> int:
  """The checks of a method trained on preference pairs (DPO family, reward model; KTO with `unpaired_ok` also on
  unpaired examples); returns the pairs a row holds.

  Raises:
    ValueError: one line naming the setting that does not fit pairs.
  """
  check_format(run, "preference", what)
  if (run.manifest or {}).get("unpaired") and not unpaired_ok:
    raise ValueError(f"{what} trains on pairs: DATA_DIR '{run.config.data_dir}' holds unpaired examples "
                     "(preprocess --format=unpaired), which only TrainConfig.recipe='kto' reads")
  if run.config.curriculum.enabled():
    raise ValueError(f"{what} with a sequence-length warmup (CurriculumConfig): cutting rows would split pairs; "
                     "turn the warmup off")
  if loss_scaled:
    raise ValueError(f"{what} with dynamic loss scaling (float16): not supported, the scaled step normalises by "
                     "tokens, not pairs; use bfloat16 or float32")
  return int((run.manifest or {}).get("max_pairs_per_row") or 1)
