"""A trained reward model as a function: token sequences → one float each, on a device mesh (GRPO's learned reward):
its checkpoint restored onto the mesh, scored by the engine's Scorer (inference/scoring.py).

The reward of a sequence is the score head at its last token, read the way training reads it
(objectives/reward.py): pass prompt + response as rendered by the chat template, ending at the response's
last learned token (the assistant turn's end marker), without the separator or EOS after it.
"""

import contextlib
import dataclasses
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.inference import scoring
from t5x_like.model import decoder as model_lib
from t5x_like.model import heads
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.parallel import partitioning
from t5x_like.training import checkpointing
from t5x_like.posttrain import distill


class RewardModelScorer:
  """Scores token sequences with a reward model checkpoint restored onto a mesh.

  Example:
    scorer = RewardModelScorer("/tmp/rm")                      # its MODEL_DIR's model config, all devices
    rewards = scorer.score([[5, 9, 12, 3], [5, 9, 7]])         # np.ndarray float32 (2,)
  """

  def __init__(self, checkpoint_path: str, model_config: Optional[model_lib.GPTConfig] = None, mesh=None,
               rules=None, batch_size: int = 32):
    """Restores the reward model.

    Args:
      checkpoint_path: a reward model's MODEL_DIR (its newest step) or MODEL_DIR/checkpoints/<step>.
      model_config: the GPTConfig of its decoder (heads.ScoredGPT adds the score head); None = read from the
        MODEL_DIR's model.gin or config.gin
        (a vocabulary of 0 there is read from the checkpoint). Its dtype is the one scoring computes in.
      mesh: the device mesh to hold it (e.g. the training run's `Experiment.mesh`); None = all devices, data parallel.
      rules: logical → mesh axis rules; None = partitioning.DEFAULT_RULES.
      batch_size: sequences scored per forward pass.

    Raises:
      ValueError: one line naming the checkpoint, a parameter whose shape differs and the GPTConfig field.
    """
    self.mesh = mesh if mesh is not None else mesh_lib.create_mesh({"data": -1})
    self.rules = tuple(rules or partitioning.DEFAULT_RULES)
    if model_config is None:
      model_config, _ = distill.saved_model_config(checkpoint_path, model_lib.GPTConfig(dtype="float32"),
                                                   key="reward model")
    self.config = dataclasses.replace(model_config, num_stages=self.mesh.shape["pipeline"])
    self.config.validate()
    model = heads.ScoredGPT(self.config)
    with self.context():
      boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
      shardings = partitioning.shardings_from_boxed(boxed, self.mesh, self.rules)
      abstract = checkpointing.abstract_with_shardings(partitioning.unbox(boxed), shardings)
      self.checkpoint = checkpointing.check_param_shapes(checkpoint_path, abstract, what="reward model")
      _, self.params = checkpointing.restore_params(self.checkpoint, abstract_params=abstract)
    self.scorer = scoring.Scorer(self.config, self.params, self.mesh, self.rules, batch_size=batch_size)

  def context(self):
    """The mesh and the rules, entered around every trace and call (as Experiment.context)."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(self.mesh))
    stack.enter_context(nn.logical_axis_rules(self.rules))
    return stack

  def score(self, sequences: Sequence[Sequence[int]]) -> np.ndarray:
    """One float32 reward per token sequence (prompt + response), read at its last token (the engine's
    scoring: inference/scoring.py).

    Raises:
      ValueError: an empty sequence, or one longer than the model's max_len.
    """
    return self.scorer.score(sequences)
