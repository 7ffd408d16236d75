"""Rollouts on the training mesh (GRPO, PPO): prompts from a chat DATA_DIR, G samples each from the inference
engine, rewards from a registered function; for GRPO, group-relative advantages and the batch its step trains on
(PPO's batches: posttrain/ppo_rollout.py).

Prompts. Every conversation of a chat DATA_DIR (`preprocess --format=chat`) is one prompt: its tokens up to
the last assistant turn (ending with the assistant marker, exactly as `infer --chat` prompts), and that turn's
text is the reference answer (for rewards such as exact match). Conversations cut by the row length, and
prompts that leave less than GrpoConfig.max_new_tokens of the row, are skipped and counted.

Determinism. Step s trains on the prompts at positions (s−1)·P .. s·P−1 of a sequence of seeded permutations
of the train prompts (one per epoch; P = BATCH_SIZE / G), sampled with the seed step_seed(SEED, s) from the
parameters of step s − 1 (the engine's draws depend on the seed, the prompt's place and the sample, never on the
slots). Nothing else is drawn, so a run resumed from a checkpoint repeats the same
rollouts, rewards and updates.

Rows. Row g of group p is prompt p followed by its g-th completion (up to and including the end marker, or
all max_new_tokens when it never stopped), right-padded to SEQ_LEN + 1 tokens; loss weight 1 on the
completion's tokens. Advantages: A = (r − mean(group)) / (std(group) + 1e-4) (std with Bessel's correction,
as TRL computes it), on every position of the row.

Failed rewards. An episode whose reward function raised for it or returned a NaN or infinity is dropped: its row
keeps loss weight 0 and it takes no part in its group's statistics; `rollout/dropped_episodes` counts them.

Numerics. `rollout/logprob_gap` is the largest |engine log-prob − trainer log-prob| over the sampled tokens of
the batch: the engine decodes with the trainer's model and parameters on the same mesh, so the two differ only by
the KV cache's other shapes (measured in tests/test_engine.py and tests/test_ppo.py).
"""

import dataclasses
import time
from typing import Callable, Optional, Sequence

from absl import logging
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np

from t5x_like.data import chat
from t5x_like.data import input_pipeline
from t5x_like.inference import chat_eval
from t5x_like.inference import engine as engine_lib
from t5x_like.inference.sampling import SamplingParams
from t5x_like.posttrain import rewards as rewards_lib
from t5x_like.training import logprobs as logprobs_lib

ADVANTAGE_EPS = 1e-4


@dataclasses.dataclass
class PromptSet:
  """The prompts of one split: token ids (ending with the assistant marker), reference text, prompt text."""
  prompts: list
  references: list
  texts: list
  skipped: dict  # reason → count


def conversation_prompts(tokens: np.ndarray, weights: np.ndarray, eos_id: int):
  """(prompt ids, reference ids) of one whole conversation: `tokens` (n,) as rendered, `weights` (n,) the stored
  weight of each token; the reference is the last run of weighted tokens (the final assistant turn's content and
  end marker). None when no token is weighted."""
  weighted = np.flatnonzero(weights > 0)
  if not len(weighted) or tokens[-1] != eos_id:
    return None
  end = weighted[-1]
  start = end
  while start > 0 and weights[start - 1] > 0:
    start -= 1
  return tokens[:start], tokens[start:end + 1]


def read_prompts(data_dir: str, split: str, *, seq_len: int, encoder: chat.ChatEncoder,
                 max_new_tokens: int, row_tokens: int = 0) -> PromptSet:
  """Every conversation of `split` as a prompt and its reference (see the module docstring); a prompt is kept when
  it and max_new_tokens fit `row_tokens` (default SEQ_LEN + 1, a whole row)."""
  row_tokens = row_tokens or seq_len + 1
  out = PromptSet([], [], [], {"cut_by_row_length": 0, "no_room_for_max_new_tokens": 0, "no_assistant_turn": 0})
  eos_id = encoder.tokenizer.eos_id
  ds = input_pipeline.make_dataset(data_dir, split, batch_size=64, seq_len=seq_len, shuffle=False, repeat=False,
                                   process_index=0, process_count=1)
  for batch in ds.as_numpy_iterator():
    for inputs, targets, segments, weights in zip(batch["inputs"], batch["targets"], batch["segment_ids"],
                                                  batch["weights"]):
      for segment in np.unique(segments[segments > 0]):
        where = np.flatnonzero(segments == segment)
        # the stored weight of token i+1 is the weight of predicting it at position i
        tokens, stored = inputs[where], np.append(0.0, weights[where][:-1])
        if tokens[-1] != eos_id and targets[where[-1]] == eos_id:  # the conversation's EOS is the row's last target
          tokens, stored = np.append(tokens, eos_id), np.append(stored, weights[where[-1]])
        if tokens[-1] != eos_id:
          out.skipped["cut_by_row_length"] += 1
          continue
        found = conversation_prompts(tokens, stored, eos_id)
        if found is None:
          out.skipped["no_assistant_turn"] += 1
          continue
        prompt, reference = found
        if len(prompt) + max_new_tokens > row_tokens:
          out.skipped["no_room_for_max_new_tokens"] += 1
          continue
        out.prompts.append([int(t) for t in prompt])
        out.references.append(encoder.completion_text(reference))
        out.texts.append(encoder.tokenizer.decode([int(t) for t in prompt]))
  return out


def schedule(num_prompts: int, step: int, per_step: int, seed: int) -> np.ndarray:
  """Indices of the prompts step `step` (1-based) trains on: positions (step−1)·per_step.. of the sequence of
  per-epoch permutations seeded by (seed, epoch)."""
  positions = np.arange((step - 1) * per_step, step * per_step)
  epochs = positions // num_prompts
  out = np.empty_like(positions)
  for epoch in np.unique(epochs):
    order = np.random.default_rng([seed, int(epoch)]).permutation(num_prompts)
    mask = epochs == epoch
    out[mask] = order[positions[mask] % num_prompts]
  return out


def group_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
  """(r − group mean) / (group std + 1e-4) per completion; rows of one group are consecutive. A NaN reward (a
  dropped episode) takes no part in its group's statistics and gets advantage 0."""
  grouped = rewards.reshape(-1, group_size).astype(np.float64)
  kept = np.isfinite(grouped)
  count = kept.sum(axis=1, keepdims=True)
  mean = np.where(kept, grouped, 0.0).sum(axis=1, keepdims=True) / np.maximum(count, 1)
  var = np.where(kept, (grouped - mean) ** 2, 0.0).sum(axis=1, keepdims=True) / np.maximum(count - 1, 1)
  advantages = np.where(kept & (count > 1), (grouped - mean) / (np.sqrt(var) + ADVANTAGE_EPS), 0.0)
  return advantages.reshape(-1).astype(np.float32)


def step_seed(seed: int, step: int) -> int:
  """The sampling seed of optimizer step `step` of a run seeded `seed` (one 32-bit draw of both)."""
  return int(np.random.SeedSequence([seed, step]).generate_state(1)[0])


def rollout_rows(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], advantages: np.ndarray,
                 seq_len: int, pad_id: int) -> dict:
  """The GRPO features (numpy, (B, seq_len)) of prompt + completion rows; see the module docstring."""
  rows = len(prompts)
  tokens = np.full((rows, seq_len + 1), pad_id, np.int32)
  weights = np.zeros((rows, seq_len), np.float32)
  segments = np.zeros((rows, seq_len), np.int32)
  for i, (prompt, completion) in enumerate(zip(prompts, completions)):
    n = len(prompt) + len(completion)
    if n > seq_len + 1:
      raise ValueError(f"a rollout row of {n} tokens exceeds SEQ_LEN + 1 = {seq_len + 1}")
    tokens[i, :n] = list(prompt) + list(completion)
    weights[i, len(prompt) - 1:n - 1] = 1.0  # predicting each completion token
    segments[i, :min(n, seq_len)] = 1
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments,
          "positions": np.tile(np.arange(seq_len, dtype=np.int32), (rows, 1)), "weights": weights,
          "advantages": np.repeat(advantages[:, None], seq_len, axis=1).astype(np.float32)}


def completion_token_gap(trainer_logps: np.ndarray, weights: np.ndarray, engine_logps: Sequence) -> float:
  """rollout/logprob_gap: the largest |engine log-prob − trainer log-prob| over the sampled tokens of rollout rows
  (rollout_rows' layout: row i's weighted positions predict completion i's tokens, in order)."""
  sampled = np.concatenate([np.asarray(lp, np.float64) for lp in engine_logps] or [np.zeros(0)])
  trainer = trainer_logps[weights > 0]
  if trainer.shape != sampled.shape:
    raise ValueError(f"{sampled.size} sampled tokens against {trainer.size} weighted rollout positions")
  return float(np.abs(trainer - sampled).max()) if sampled.size else 0.0


def host_fn(exp, fn: Callable, in_shardings) -> Callable:
  """jax.jit of `fn` on the run's mesh, its outputs replicated and returned as NumPy arrays on every process."""
  jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=NamedSharding(exp.mesh, P()))

  def call(*args):
    with exp.context():
      out = jitted(*args)
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), out)
  return call


@dataclasses.dataclass
class Episodes:
  """One rollout: row i is prompt `indices[i]` of the train split followed by its sampled completion."""
  indices: np.ndarray
  prompts: list
  completions: list  # token lists, each up to and including its stop token
  logprobs: list  # the engine's log-prob of each completion token
  rewards: np.ndarray  # (rows,) float64; NaN where the reward function failed (the episode is dropped)
  seconds: float  # sampling + scoring
  masks: Optional[list] = None  # multi-turn: per completion token, 1 for the policy's, 0 for the environment's
  extra: dict = dataclasses.field(default_factory=dict)  # more metrics (multi-turn: turns, cut episodes, ...)

  @property
  def dropped(self) -> np.ndarray:
    return ~np.isfinite(self.rewards)

  def metrics(self) -> dict:
    kept = self.rewards[~self.dropped]
    generated = [sum(m) for m in self.masks] if self.masks is not None else [len(c) for c in self.completions]
    return {"reward_mean": float(kept.mean()) if kept.size else 0.0,
            "reward_std": float(kept.std()) if kept.size else 0.0,
            "response_length": float(np.mean(generated)),
            "sampled_logp": float(np.mean([lp for row in self.logprobs for lp in row])),
            "rollout/dropped_episodes": float(self.dropped.sum()), "rollout_seconds": self.seconds, **self.extra}


class Rollouts:
  """A run's rollouts (GRPO, PPO): `collect` samples and scores one rollout batch of `rows` completions from the
  current parameters, `batch` makes GRPO's training batch of it; `evaluate` scores greedy answers to the
  validation prompts."""

  def __init__(self, exp, rows: int = 0, row_tokens: int = 0, play: Optional[Callable] = None):
    """rows: completions per rollout (default BATCH_SIZE), recipe_config.num_generations for each prompt;
    row_tokens: the most tokens a prompt and its completion may take (default SEQ_LEN + 1); play: multi-turn
    episodes (rollouts, params, prompt set, indices, seed, temperature, top_k) → Episodes, in place of one
    completion scored by the reward function (posttrain/environments.py)."""
    self.play = play
    self.exp = exp
    config = exp.config
    self.objective_config = config.recipe_config
    self.group = config.recipe_config.num_generations
    self.rows = rows or config.batch_size
    self.per_step = self.rows // self.group
    self.reward_fn = rewards_lib.get(config.recipe_config.reward)
    self.encoder = chat_eval.encoder_for(exp, chat.ChatTemplate())
    self.stop_ids = (self.encoder.marker_ids["end"], self.encoder.tokenizer.eos_id)
    read = lambda split: read_prompts(config.data_dir, split, seq_len=config.seq_len, encoder=self.encoder,
                                      max_new_tokens=config.recipe_config.max_new_tokens, row_tokens=row_tokens)
    self.train = read("train")
    if not self.train.prompts:
      raise ValueError(f"DATA_DIR '{config.data_dir}' split 'train' has no usable {config.recipe.upper()} prompt "
                       f"(skipped: {self.train.skipped}); raise SEQ_LEN or lower "
                       f"{type(self.objective_config).__name__}.max_new_tokens")
    self.validation = read("validation") if "validation" in exp.manifest["splits"] else None
    self.width = max(len(p) for p in self.train.prompts + (self.validation.prompts if self.validation else []))
    self.engine = None  # made at the first rollout, then reused with each step's parameters: one compile
    self._trainer_logps = None

  def sample(self, params, prompts: Sequence[Sequence[int]], *, n: int, seed: int, temperature: float,
             top_k: int, max_tokens=0) -> tuple:
    """(completions, log-probs): `n` completions of each prompt from the engine (the n share one prefill), in
    prompt order, at most `max_tokens` each (one for all, or one per prompt; 0 = max_new_tokens), each a token
    list up to and including its stop token, with the log-prob of every token under
    `params` (the trainer's number for that token)."""
    if self.engine is None:
      cache_len = min(self.exp.model_config.max_len, self.width + self.objective_config.max_new_tokens)
      if self.play is not None:  # an episode grows over its turns up to a whole row
        cache_len = min(self.exp.model_config.max_len, self.exp.config.seq_len + 1)
      self.engine = engine_lib.Engine(self.exp.model_config, params, self.exp.mesh, self.exp.rules,
                                      slots=self.rows, cache_len=cache_len, pad_id=self.encoder.tokenizer.pad_id)
    self.engine.params = params
    budgets = max_tokens if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
    sampling = [SamplingParams(max_tokens=b or self.objective_config.max_new_tokens, temperature=temperature,
                               top_k=top_k, stop_token_ids=self.stop_ids) for b in budgets]
    out = [c for samples in self.engine.generate(list(prompts), sampling, n=n, seed=seed) for c in samples]
    return [c.tokens for c in out], [c.logprobs for c in out]

  def score(self, prompt_set: PromptSet, indices, completions) -> np.ndarray:
    """One reward per completion, NaN for an episode the reward function failed on (raised for it, or returned a
    NaN or infinity): it is counted and dropped, never trained on. A function that raises on a batch is called
    again one episode at a time, so only the episodes it fails on are dropped; one that raises on all of them is
    an error (its message in one line)."""
    texts = [self.encoder.completion_text(c) for c in completions]
    extra = {}
    if getattr(self.reward_fn, "wants_sequences", False):  # a reward model reads tokens, through the end marker
      end = self.encoder.marker_ids["end"]
      body = lambda c: c[:-1] if c and c[-1] in self.stop_ids else c
      extra = {"mesh": self.exp.mesh,
               "sequences": [prompt_set.prompts[i] + body(c) + [end] for i, c in zip(indices, completions)]}
    call = lambda rows: self.reward_fn([texts[i] for i in rows], [prompt_set.references[indices[i]] for i in rows],
                                       [prompt_set.texts[indices[i]] for i in rows], config=self.objective_config,
                                       **{k: v if k == "mesh" else [v[i] for i in rows] for k, v in extra.items()})
    name = self.objective_config.reward
    try:
      values = np.asarray(call(range(len(completions))), np.float64).reshape(-1)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("reward function %r raised %s: %s; scoring one episode at a time", name, type(e).__name__, e)
      values = np.array([self._one(call, i) for i in range(len(completions))], np.float64)
      if not np.isfinite(values).any():  # it fails on everything: a broken or misconfigured function, not episodes
        raise ValueError(f"reward function {name!r} raised on every episode: {type(e).__name__}: {e}") from e
    if values.shape != (len(completions),):
      raise ValueError(f"reward function {name!r} returned {values.shape[0]} values for {len(completions)} "
                       "completions")
    return np.where(np.isfinite(values), values, np.nan)

  def _one(self, call, i: int) -> float:
    try:
      return float(np.asarray(call([i]), np.float64).reshape(-1)[0])
    except Exception:  # pylint: disable=broad-except
      return float("nan")

  def collect(self, params, index: int) -> Episodes:
    """Rollout `index` (1-based; GRPO's optimizer step): its prompts (schedule) sampled with step_seed(SEED,
    index) from `params`, and scored (or played against the environment)."""
    t0 = time.perf_counter()
    chosen = schedule(len(self.train.prompts), index, self.per_step, self.exp.config.seed)
    indices = np.repeat(chosen, self.group)
    seed = step_seed(self.exp.config.seed, index)
    config = self.objective_config
    if self.play is not None:
      episodes = self.play(self, params, self.train, indices, seed, config.temperature, config.top_k)
    else:
      completions, logprobs = self.sample(params, [self.train.prompts[i] for i in chosen], n=self.group, seed=seed,
                                          temperature=config.temperature, top_k=config.top_k)
      rewards = self.score(self.train, indices, completions)
      episodes = Episodes(indices, [self.train.prompts[i] for i in indices], completions, logprobs, rewards, 0.0)
    episodes.seconds = time.perf_counter() - t0
    return episodes

  def rows_of(self, episodes: Episodes, advantages: np.ndarray) -> dict:
    """The rollout rows (numpy, whole batch) of `episodes`, a dropped episode's row with weight 0."""
    rows = rollout_rows(episodes.prompts, episodes.completions, advantages, self.exp.config.seq_len,
                        self.encoder.tokenizer.pad_id)
    if episodes.masks is not None:  # the environment's tokens are not the policy's: weight 0
      for i, (prompt, mask) in enumerate(zip(episodes.prompts, episodes.masks)):
        rows["weights"][i, len(prompt) - 1:len(prompt) - 1 + len(mask)] *= np.asarray(mask, np.float32)
    rows["weights"][episodes.dropped] = 0.0
    return rows

  def trainer_logps(self, params, batch) -> np.ndarray:
    """log π(target) (B, L) of a global batch under `params` by the trainer's own forward pass, on the host."""
    if self._trainer_logps is None:
      exp = self.exp
      self._trainer_logps = host_fn(exp, lambda p, b: logprobs_lib.model_token_logps(exp.model.apply, p, b),
                                    (exp.state_shardings.params, {k: exp.batch_sharding for k in batch}))
    return self._trainer_logps(params, batch)

  def logprob_gap(self, params, batch, weights: np.ndarray, episodes: Episodes, trainer=None) -> float:
    """rollout/logprob_gap of the kept episodes: the engine's log-probs against the trainer's (`trainer`, or a
    forward pass of `params` on the global `batch`)."""
    if trainer is None:
      trainer = self.trainer_logps(params, {k: batch[k] for k in ("inputs", "targets", "positions", "segment_ids")})
    return completion_token_gap(trainer, weights, [lp for lp, d in zip(episodes.logprobs, episodes.dropped) if not d])

  def batch(self, params, step: int):
    """(global rollout batch, host metrics) for optimizer step `step` (1-based) from the current parameters."""
    episodes = self.collect(params, step)
    advantages = group_advantages(episodes.rewards, self.group)
    rows = self.rows_of(episodes, advantages)
    batch = self.exp.global_batch(self.process_rows(rows))  # on-policy: no old log-probs (posttrain/grpo.py)
    gap = self.logprob_gap(params, batch, rows["weights"], episodes)
    spread = np.array([g[np.isfinite(g)].std() if np.isfinite(g).any() else 0.0
                       for g in episodes.rewards.reshape(-1, self.group)])  # within each group, of its kept episodes
    return batch, {**episodes.metrics(), "reward_group_std": float(spread.mean()),
                   "groups_without_signal": float(np.mean(spread == 0)), "rollout/logprob_gap": gap}

  def process_rows(self, rows: dict) -> dict:
    """This process's rows of a global batch every process built whole (consecutive blocks per process)."""
    per = rows["inputs"].shape[0] // jax.process_count()
    first = jax.process_index() * per
    return {k: v[first:first + per] for k, v in rows.items()}

  def evaluate(self, params) -> dict:
    """Greedy answers to the validation prompts (DataConfig.eval_batches × BATCH_SIZE of them, else all),
    scored by the run's reward function: eval/reward_mean, eval/reward_std, eval/response_length; and
    eval/exact_match against the conversations' reference answers, whatever the reward."""
    prompt_set = self.validation
    if prompt_set is None or not prompt_set.prompts:
      raise ValueError(f"DATA_DIR '{self.exp.config.data_dir}' has no validation prompts to evaluate GRPO on")
    rows = self.exp.config.batch_size
    count = len(prompt_set.prompts)
    if self.exp.config.data.eval_batches:
      count = min(count, self.exp.config.data.eval_batches * rows)
    indices = list(range(count))
    if self.play is not None:  # greedy episodes against the environment: its reward, turns, tool calls
      episodes = self.play(self, params, prompt_set, np.asarray(indices), 0, 0.0, 0)
      metrics = episodes.metrics()
      return {"eval/prompts": count, **{f"eval/{k}": metrics[k] for k in ("reward_mean", "reward_std",
                                                                          "response_length", *episodes.extra)}}
    completions, _ = self.sample(params, [prompt_set.prompts[i] for i in indices], n=1, seed=0, temperature=0.0,
                                 top_k=0)
    values = self.score(prompt_set, indices, completions)
    lengths = [len(c) for c in completions]
    matches = rewards_lib.exact_match([self.encoder.completion_text(c) for c in completions],
                                      [prompt_set.references[i] for i in indices], None)
    values = np.asarray(values)
    return {"eval/reward_mean": float(values.mean()), "eval/reward_std": float(values.std()),
            "eval/response_length": float(np.mean(lengths)), "eval/exact_match": float(np.mean(matches)),
            "eval/prompts": count}
