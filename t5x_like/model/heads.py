"""Heads over the decoder: the reward model's scalar score head beside the language-model head.

The decoder (decoder.GPT) knows only its language-model head. A reward model is `ScoredGPT(config)`: the same
decoder, called the same way, plus one zero-initialised (d_model, 1) kernel `score_head` at the top level of the
parameter tree, so its tree is {...GPT's parameters..., "score_head"} and a checkpoint of a pre-trained or SFT
model (no `score_head`) warm-starts it. `project_scores` applies the head to the decoder's final hidden states
(`apply(..., return_hidden=True)`); the reward objective reads it at the last response token.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5x_like.model import layers
from t5x_like.model.config import GPTConfig
from t5x_like.model.decoder import GPT
from t5x_like.parallel import axis_names as ax

SCORE_HEAD = "score_head"  # the scalar head's (d_model, 1) kernel, beside the decoder's parameters


class ScoredGPT(nn.Module):
  """decoder.GPT plus the `score_head` kernel, sharing GPT's scope (its parameters stay at the top level).

  Called exactly like GPT (same arguments, same returns: logits, or the final hidden states with
  return_hidden=True); the score head is created at init and applied by `project_scores`.
  """
  config: GPTConfig

  def setup(self):
    self.decoder = GPT(self.config)
    nn.share_scope(self, self.decoder)

  @nn.compact
  def __call__(self, *args, **kwargs):
    out = self.decoder(*args, **kwargs)
    # created after the decoder's parameters, as the last of the scope's initialisers (the others' keys unchanged)
    self.param(SCORE_HEAD, nn.with_logical_partitioning(nn.initializers.zeros, (ax.EMBED, None)),
               (self.config.d_model, 1), jnp.float32)
    return out


def model_for(config: GPTConfig, scored: bool = False) -> nn.Module:
  """The module of a run: ScoredGPT for a reward model (`scored`), else the plain GPT."""
  return ScoredGPT(config) if scored else GPT(config)


def has_score_head(params) -> bool:
  """Whether a parameter tree (boxed, unboxed or abstract) holds a score head."""
  return SCORE_HEAD in params


def project_scores(params, hidden: jax.Array, config: GPTConfig) -> jax.Array:
  """Final hidden states (B, T, D) → one float32 scalar per position (B, T) with the `score_head` kernel of a
  ScoredGPT's parameters (the reward model reads it at the last response token)."""
  kernel = params[SCORE_HEAD].astype(config.compute_dtype)[:, 0]  # (D,)
  scores = jnp.einsum("btd,d->bt", hidden.astype(config.compute_dtype), kernel, preferred_element_type=jnp.float32)
  return layers.constrain(scores, (ax.BATCH, ax.LENGTH))
