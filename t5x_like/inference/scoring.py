"""Scoring with the engine's model on its mesh: log-likelihood of continuations and rolling log-likelihood of whole
texts (lm-eval's semantics), and the reward head's score at a sequence's last token.

Every call runs full forward passes (no cache) over right-padded rows of a power-of-two width (few shapes,
few compiles), `batch_size` rows at a time, and brings back only per-token numbers.
"""

import contextlib
import dataclasses
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from t5x_like.model import config as config_lib
from t5x_like.model import decoder as model_lib
from t5x_like.model import heads
from t5x_like.parallel import axis_names as ax
from t5x_like.parallel import partitioning

MIN_WIDTH = 16  # rows are padded to a power of two ≥ this (≤ max_len)


def rolling_windows(tokens: Sequence[int], prefix_token: int, max_len: int) -> list:
  """(context, continuation) pairs that score every token of `tokens` once, each window at most `max_len`
  inputs: the first predicts tokens[:max_len] after `prefix_token`; each later one predicts the next up to
  max_len tokens after as many earlier tokens as fit (lm-eval's rolling windows, context_len 1, disjoint)."""
  tokens = list(tokens)
  if not tokens:
    return []
  first = min(max_len, len(tokens))
  out = [([prefix_token], tokens[:first])]
  done = first
  while done < len(tokens):
    end = min(len(tokens), done + max_len)
    start = max(0, end - max_len - 1)  # inputs end - max_len - 1 .. end - 2 predict targets end - max_len .. end - 1
    out.append((tokens[start:done], tokens[done:end]))
    done = end
  return out


class Scorer:
  """Log-likelihoods and reward scores of token sequences under a model's parameters on a mesh.

  Example:
    scorer = Scorer(config, params, mesh, rules)
    [(logp, greedy)] = scorer.loglikelihood([([5, 9], [12, 3])])
  """

  def __init__(self, model_config: model_lib.GPTConfig, params, mesh, rules, *, batch_size: int = 8):
    """Args:
      model_config, params, mesh, rules: as the Engine's (params unboxed, on `mesh`; a LoRA run: merged).
      batch_size: rows per forward pass, rounded up to a multiple of the batch's shards (and of the pipeline's
        microbatches on a pipeline mesh).
    """
    self.config = dataclasses.replace(model_config, num_stages=mesh.shape["pipeline"])
    self.params, self.mesh, self.rules = params, mesh, tuple(rules)
    with self.context():
      self.batch_sharding = partitioning.batch_sharding(mesh, self.rules)
    axes = self.batch_sharding.spec[0] or ()
    multiple = int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))
    if self.config.num_stages > 1:
      multiple *= config_lib.pipeline_microbatches(self.config)
    self.batch_size = -(-batch_size // multiple) * multiple
    self.model = model_lib.GPT(self.config)
    self._token_scores = jax.jit(self._token_scores_fn)
    self._last_scores = jax.jit(self._last_scores_fn)

  def context(self):
    """The mesh and the rules, entered around every trace and call."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(self.mesh))
    stack.enter_context(nn.logical_axis_rules(self.rules))
    return stack

  def loglikelihood(self, requests: Sequence[tuple]) -> list:
    """(Σ log p(continuation | context), whether greedy decoding gives exactly the continuation) per
    (context ids, continuation ids) pair; the model reads the last max_len tokens of context + continuation
    minus its final token (lm-eval's truncation).

    Raises:
      ValueError: an empty context or continuation, or a continuation longer than max_len.
    """
    rows = []
    for i, (context, continuation) in enumerate(requests):
      context, continuation = [int(t) for t in context], [int(t) for t in continuation]
      if not context or not continuation:
        raise ValueError(f"loglikelihood: request {i} has an empty {'context' if not context else 'continuation'} "
                         "(lm-eval gives an empty context the EOT token)")
      if len(continuation) > self.config.max_len:
        raise ValueError(f"loglikelihood: request {i}'s continuation of {len(continuation)} tokens exceeds "
                         f"max_len={self.config.max_len}")
      whole = (context + continuation)[-(self.config.max_len + 1):]
      rows.append((whole[:-1], whole[1:], len(continuation)))
    logps, greedy = self._score_rows(rows)
    return [(float(np.sum(lp)), bool(np.all(g))) for lp, g in zip(logps, greedy)]

  def loglikelihood_rolling(self, texts: Sequence[Sequence[int]], prefix_token: int) -> list:
    """Σ log p of every token of each token list (all scored, in windows of max_len; the first token after
    `prefix_token`, e.g. EOS/BOS), lm-eval's loglikelihood_rolling."""
    windows = [rolling_windows(t, prefix_token, self.config.max_len) for t in texts]
    flat = [w for ws in windows for w in ws]
    scores = self.loglikelihood(flat) if flat else []
    out, at = [], 0
    for ws in windows:
      out.append(float(sum(s for s, _ in scores[at:at + len(ws)])))
      at += len(ws)
    return out

  def token_logprobs(self, inputs: Sequence[Sequence[int]], targets: Sequence[Sequence[int]]) -> list:
    """log p(targets[i][j] | inputs[i][:j+1]) for each row: (len,) float32 arrays."""
    rows = [([int(t) for t in x], [int(t) for t in y], len(y)) for x, y in zip(inputs, targets)]
    return self._score_rows(rows)[0]

  def score(self, sequences: Sequence[Sequence[int]]) -> np.ndarray:
    """One float32 score per token sequence: the score head (model/heads.py) at its last token.

    Raises:
      ValueError: a model without a score head, an empty sequence, or one longer than max_len.
    """
    if not heads.has_score_head(self.params):
      raise ValueError(f"Scorer.score: the model has no score head (no '{heads.SCORE_HEAD}' in its parameters)")
    if not sequences:
      return np.zeros([0], np.float32)
    lengths = [len(s) for s in sequences]
    if min(lengths) < 1 or max(lengths) > self.config.max_len:
      raise ValueError(f"Scorer.score: sequences must hold 1..max_len={self.config.max_len} tokens, got lengths "
                       f"{min(lengths)}..{max(lengths)}")
    out = []
    for tokens, segments, _, lengths_ in self._batches([(list(s), list(s), len(s)) for s in sequences]):
      with self.context():
        put = lambda x: jax.device_put(x, self.batch_sharding)
        out.append(_host(self._last_scores(self.params, put(tokens), put(segments), put(lengths_[:, None]))))
    return np.concatenate(out)[:len(sequences)].astype(np.float32)

  def _width(self, longest: int) -> int:
    return min(self.config.max_len, max(MIN_WIDTH, 1 << (longest - 1).bit_length()))

  def _batches(self, rows):
    """(tokens, segment_ids, targets, lengths) numpy batches of (inputs, targets, n) rows, right-padded; each batch
    holds batch_size rows (the last filled with empty ones)."""
    width = self._width(max(len(x) for x, _, _ in rows))
    for start in range(0, len(rows), self.batch_size):
      chunk = rows[start:start + self.batch_size]
      tokens = np.zeros((self.batch_size, width), np.int32)
      targets = np.zeros((self.batch_size, width), np.int32)
      segments = np.zeros((self.batch_size, width), np.int32)
      lengths = np.zeros((self.batch_size,), np.int32)
      for i, (x, y, _) in enumerate(chunk):
        tokens[i, :len(x)], targets[i, :len(y)], segments[i, :len(x)], lengths[i] = x, y, 1, len(x)
      yield tokens, segments, targets, lengths

  def _score_rows(self, rows) -> tuple:
    """Per row (inputs, targets, n): the log-probs and greedy flags of its last n targets."""
    pending = []  # every batch dispatched before the first result is read: the device never waits on the host
    for tokens, segments, targets, _ in self._batches(rows):
      with self.context():
        put = lambda x: jax.device_put(x, self.batch_sharding)
        pending.append(self._token_scores(self.params, put(tokens), put(segments), put(targets)))
    logps = np.concatenate([_host(lp) for lp, _ in pending])
    greedy = np.concatenate([_host(top) for _, top in pending])
    out_lp, out_greedy = [], []
    for i, (x, _, n) in enumerate(rows):
      out_lp.append(logps[i, len(x) - n:len(x)])
      out_greedy.append(greedy[i, len(x) - n:len(x)])
    return out_lp, out_greedy

  def _token_scores_fn(self, params, tokens, segments, targets):
    """(log p of each target (B, T) float32, whether it is the argmax (B, T)) from one forward pass."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32)[None], tokens.shape)
    logits = self.model.apply({"params": params}, tokens, positions, segments)  # (B, T, V) float32
    # log p = logit − logsumexp and greedy = (the target's logit is the largest): two reductions over V, no
    # (B, T, V) log-softmax written out
    top = jnp.max(logits, axis=-1)  # (B, T)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    lse = top + jnp.log(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1))
    return target_logit - lse, target_logit >= top

  def _last_scores_fn(self, params, tokens, segments, lengths):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32)[None], tokens.shape)
    hidden = self.model.apply({"params": params}, tokens, positions, segments, return_hidden=True)
    scores = heads.project_scores(params, hidden, self.config)  # (B, T)
    last = jnp.maximum(lengths[:, 0] - 1, 0)
    return jnp.take_along_axis(scores, last[:, None], axis=1)[:, 0]  # (B,)


def _host(x) -> np.ndarray:
  return np.asarray(x) if x.is_fully_addressable else np.asarray(multihost_utils.process_allgather(x, tiled=True))
