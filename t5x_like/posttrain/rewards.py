"""Reward functions for GRPO and PPO, by name (GrpoConfig.reward, PpoConfig.reward).

A reward function maps one rollout batch to one float per completion:

  fn(completions: list[str], references: list[str], prompts: list[str], *, config) -> list[float]

(a function with the attribute `wants_sequences = True` also gets `sequences`, each prompt's token ids followed by
its completion's up to the end marker, and `mesh`, the training mesh), where `completions` is the generated assistant text (decoded, cut at the end marker), `references` the
reference answer of each prompt's conversation in the DATA_DIR, `prompts` the prompt text, and `config` the
run's GrpoConfig. Register your own with `@rewards.register("name")` in a module that a gin file imports
(`import my_project.my_rewards` at the top of the gin file), then bind `grpo.GrpoConfig.reward = 'name'`.

Built in:
  exact_match    1 when the completion equals the reference (leading/trailing whitespace stripped), else 0.
  format         1 when the whole completion matches the regex GrpoConfig.reward_format, else 0.
  reward_model   the scalar score of a trained reward model (configs/runs/reward.gin) at
                 GrpoConfig.reward_checkpoint (RLHF with a learned reward); see posttrain/reward_scoring.py.
"""

import re
from typing import Callable, Dict, Sequence

from t5x_like.inference import chat_eval
from t5x_like.posttrain import reward_scoring

RewardFn = Callable[..., Sequence[float]]
_REGISTRY: Dict[str, RewardFn] = {}


def register(name: str):
  """Decorator: registers a reward function under `name` (a second function of the same name is refused)."""
  def wrap(fn: RewardFn) -> RewardFn:
    if name in _REGISTRY and _REGISTRY[name] is not fn:
      raise ValueError(f"a reward function named {name!r} is already registered ({_REGISTRY[name].__module__})")
    _REGISTRY[name] = fn
    return fn
  return wrap


def registered() -> tuple:
  return tuple(sorted(_REGISTRY))


def get(name: str, owner: str = "GrpoConfig") -> RewardFn:
  """The reward function registered as `name` (the setting `owner`.reward: GrpoConfig, PpoConfig).

  Raises:
    ValueError: one line naming <owner>.reward, the name and the registered ones.
  """
  if name not in _REGISTRY:
    raise ValueError(f"{owner}.reward={name!r} is not a registered reward function (registered: "
                     f"{', '.join(registered())}); register one with @t5x_like.posttrain.rewards.register({name!r})")
  return _REGISTRY[name]


@register("exact_match")
def exact_match(completions, references, prompts, *, config=None):
  del prompts, config
  return [float(chat_eval.exact_match(c, r)) for c, r in zip(completions, references)]


@register("format")
def format_match(completions, references, prompts, *, config):
  del references, prompts
  if not config.reward_format:
    name = type(config).__name__
    raise ValueError(f"{name}.reward='format' needs the regex {name}.reward_format")
  try:
    pattern = re.compile(config.reward_format, re.DOTALL)
  except re.error as e:
    raise ValueError(f"{type(config).__name__}.reward_format={config.reward_format!r} is not a valid regex: "
                     f"{e}") from None
  return [float(pattern.fullmatch(c.strip()) is not None) for c in completions]


_SCORERS: Dict[tuple, reward_scoring.RewardModelScorer] = {}


def reward_model(completions, references, prompts, *, config, sequences, mesh):
  """The trained reward model's score of each prompt + completion (RLHF with a learned reward), restored once per
  (checkpoint, mesh) onto the training mesh."""
  del completions, references, prompts
  if not config.reward_checkpoint:
    name = type(config).__name__
    raise ValueError(f"{name}.reward='reward_model' needs {name}.reward_checkpoint, a reward model's MODEL_DIR "
                     "(configs/runs/reward.gin)")
  key = (config.reward_checkpoint, mesh)
  if key not in _SCORERS:
    _SCORERS[key] = reward_scoring.RewardModelScorer(config.reward_checkpoint, mesh=mesh)
  return [float(x) for x in _SCORERS[key].score(sequences)]


reward_model.wants_sequences = True
register("reward_model")(reward_model)
