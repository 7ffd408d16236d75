"""A trained reward model as a function: token sequences → one float each, on a device mesh (GRPO's learned reward).

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

from t5x_like.model import config as config_lib
from t5x_like.model import decoder as model_lib
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.parallel import partitioning
from t5x_like.training import checkpointing
from t5x_like.posttrain import distill

MIN_LENGTH = 16  # sequences are right-padded to a power of two ≥ this (≤ max_len): few shapes, few compiles


class RewardModelScorer:
  """Scores token sequences with a reward model checkpoint restored onto a mesh.

  Example:
    scorer = RewardModelScorer("/tmp/rm")                      # its MODEL_DIR's model config, all devices
    rewards = scorer.score([[5, 9, 12, 3], [5, 9, 7]])         # np.ndarray float32 (2,)
  """

  def __init__(self, checkpoint_path: str, model_config: Optional[model_lib.GPTConfig] = None, mesh=None,
               rules=None):
    """Restores the reward model.

    Args:
      checkpoint_path: a reward model's MODEL_DIR (its newest step) or MODEL_DIR/checkpoints/<step>.
      model_config: its GPTConfig (score_head is set); None = read from the MODEL_DIR's model.gin or config.gin
        (a vocabulary of 0 there is read from the checkpoint). Its dtype is the one scoring computes in.
      mesh: the device mesh to hold it (e.g. the training run's `Experiment.mesh`); None = all devices, data parallel.
      rules: logical → mesh axis rules; None = partitioning.DEFAULT_RULES.

    Raises:
      ValueError: one line naming the checkpoint, a parameter whose shape differs and the GPTConfig field.
    """
    self.mesh = mesh if mesh is not None else mesh_lib.create_mesh({"data": -1})
    self.rules = tuple(rules or partitioning.DEFAULT_RULES)
    if model_config is None:
      model_config, _ = distill.saved_model_config(checkpoint_path, model_lib.GPTConfig(dtype="float32"),
                                                   key="reward model")
    self.config = dataclasses.replace(model_config, score_head=True, num_stages=self.mesh.shape["pipeline"])
    self.config.validate()
    model = model_lib.GPT(self.config)
    with self.context():
      boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
      shardings = partitioning.shardings_from_boxed(boxed, self.mesh, self.rules)
      abstract = checkpointing.abstract_with_shardings(partitioning.unbox(boxed), shardings)
      self.checkpoint = checkpointing.check_param_shapes(checkpoint_path, abstract, what="reward model")
      _, self.params = checkpointing.restore_params(self.checkpoint, abstract_params=abstract)
    self.batch_sharding = partitioning.batch_sharding(self.mesh, self.rules)
    axes = self.batch_sharding.spec[0] or ()
    batch_shards = int(np.prod([self.mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))
    # rows per call: a multiple of the batch's shards (and of the pipeline's microbatches on a pipeline mesh)
    self.row_multiple = batch_shards * (config_lib.pipeline_microbatches(self.config) if self.config.num_stages > 1
                                        else 1)

    def score_at_last(params, tokens, segment_ids, last):
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32)[None], tokens.shape)
      hidden = model.apply({"params": params}, tokens, positions, segment_ids, return_hidden=True)
      scores = model_lib.project_scores(params, hidden, self.config)  # (B, L)
      return jnp.take_along_axis(scores, last[:, None], axis=1)[:, 0]  # (B,)

    self.row_sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(axes or None))  # (B,)
    self._score = jax.jit(score_at_last, in_shardings=(shardings, self.batch_sharding, self.batch_sharding,
                                                       self.row_sharding))

  def context(self):
    """The mesh and the rules, entered around every trace and call (as Experiment.context)."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(self.mesh))
    stack.enter_context(nn.logical_axis_rules(self.rules))
    return stack

  def score(self, sequences: Sequence[Sequence[int]]) -> np.ndarray:
    """One float32 reward per token sequence (prompt + response), read at its last token.

    Raises:
      ValueError: an empty sequence, or one longer than the model's max_len.
    """
    lengths = [len(s) for s in sequences]
    if not sequences:
      return np.zeros([0], np.float32)
    if min(lengths) < 1 or max(lengths) > self.config.max_len:
      raise ValueError(f"reward model: sequences must hold 1..max_len={self.config.max_len} tokens, got lengths "
                       f"{min(lengths)}..{max(lengths)}")
    length = min(self.config.max_len, max(MIN_LENGTH, 1 << (max(lengths) - 1).bit_length()))
    rows = -(-len(sequences) // self.row_multiple) * self.row_multiple
    tokens = np.zeros([rows, length], np.int32)
    segment_ids = np.zeros([rows, length], np.int32)
    last = np.zeros([rows], np.int32)
    for i, seq in enumerate(sequences):
      tokens[i, :len(seq)], segment_ids[i, :len(seq)], last[i] = seq, 1, len(seq) - 1
    with self.context():
      put = lambda x: jax.device_put(x, self.batch_sharding)
      out = self._score(self.params, put(tokens), put(segment_ids), jax.device_put(last, self.row_sharding))
    return np.asarray(jax.device_get(out), np.float32)[:len(sequences)]
