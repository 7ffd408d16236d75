"""GRPO rollouts on the training mesh: prompts from a chat DATA_DIR, G samples each from the inference engine,
rewards from a registered function, group-relative advantages, and the rollout batch the GRPO step trains on.

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
"""

import dataclasses
import time
from typing import Sequence

import jax
import numpy as np

from t5x_like.data import chat
from t5x_like.data import input_pipeline
from t5x_like.inference import chat_eval
from t5x_like.inference import engine as engine_lib
from t5x_like.inference.sampling import SamplingParams
from t5x_like.posttrain import rewards as rewards_lib

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
                 max_new_tokens: int) -> PromptSet:
  """Every conversation of `split` as a prompt and its reference (see the module docstring)."""
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
        if len(prompt) + max_new_tokens > seq_len + 1:
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
  """(r − group mean) / (group std + 1e-4) per completion; rows of one group are consecutive."""
  grouped = rewards.reshape(-1, group_size).astype(np.float64)
  mean = grouped.mean(axis=1, keepdims=True)
  std = grouped.std(axis=1, ddof=1, keepdims=True)
  return ((grouped - mean) / (std + ADVANTAGE_EPS)).reshape(-1).astype(np.float32)


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


class Rollouts:
  """An Experiment's GRPO rollouts: `train_step` samples, scores and trains one step; `evaluate` scores greedy
  answers to the validation prompts."""

  def __init__(self, exp):
    self.exp = exp
    config = exp.config
    self.objective_config = config.recipe_config
    self.group = config.recipe_config.num_generations
    self.per_step = config.batch_size // self.group
    self.reward_fn = rewards_lib.get(config.recipe_config.reward)
    self.encoder = chat_eval.encoder_for(exp, chat.ChatTemplate())
    self.stop_ids = (self.encoder.marker_ids["end"], self.encoder.tokenizer.eos_id)
    read = lambda split: read_prompts(config.data_dir, split, seq_len=config.seq_len, encoder=self.encoder,
                                      max_new_tokens=config.recipe_config.max_new_tokens)
    self.train = read("train")
    if not self.train.prompts:
      raise ValueError(f"DATA_DIR '{config.data_dir}' split 'train' has no usable GRPO prompt (skipped: "
                       f"{self.train.skipped}); raise SEQ_LEN or lower GrpoConfig.max_new_tokens")
    self.validation = read("validation") if "validation" in exp.manifest["splits"] else None
    self.width = max(len(p) for p in self.train.prompts + (self.validation.prompts if self.validation else []))
    self.engine = None  # made at the first rollout, then reused with each step's parameters: one compile

  def sample(self, params, prompts: Sequence[Sequence[int]], *, n: int, seed: int, temperature: float,
             top_k: int) -> tuple:
    """(completions, log-probs): `n` completions of each prompt from the engine (the n share one prefill), in
    prompt order, each a token list up to and including its stop token, with the log-prob of every token under
    `params` (the trainer's number for that token)."""
    if self.engine is None:
      cache_len = min(self.exp.model_config.max_len, self.width + self.objective_config.max_new_tokens)
      self.engine = engine_lib.Engine(self.exp.model_config, params, self.exp.mesh, self.exp.rules,
                                      slots=self.exp.config.batch_size, cache_len=cache_len,
                                      pad_id=self.encoder.tokenizer.pad_id)
    self.engine.params = params
    sampling = SamplingParams(max_tokens=self.objective_config.max_new_tokens, temperature=temperature, top_k=top_k,
                              stop_token_ids=self.stop_ids)
    out = [c for samples in self.engine.generate(list(prompts), sampling, n=n, seed=seed) for c in samples]
    return [c.tokens for c in out], [c.logprobs for c in out]

  def score(self, prompt_set: PromptSet, indices, completions) -> np.ndarray:
    texts = [self.encoder.completion_text(c) for c in completions]
    extra = {}
    if getattr(self.reward_fn, "wants_sequences", False):  # a reward model reads tokens, through the end marker
      end = self.encoder.marker_ids["end"]
      body = lambda c: c[:-1] if c and c[-1] in self.stop_ids else c
      extra = {"mesh": self.exp.mesh,
               "sequences": [prompt_set.prompts[i] + body(c) + [end] for i, c in zip(indices, completions)]}
    values = self.reward_fn(texts, [prompt_set.references[i] for i in indices],
                            [prompt_set.texts[i] for i in indices], config=self.objective_config, **extra)
    values = np.asarray(values, np.float64).reshape(-1)
    if values.shape != (len(completions),) or not np.all(np.isfinite(values)):
      raise ValueError(f"reward function {self.objective_config.reward!r} returned {values.shape[0]} values "
                       f"({'some not finite' if values.size == len(completions) else 'wrong count'}) for "
                       f"{len(completions)} completions")
    return values

  def batch(self, params, step: int):
    """(global rollout batch, host metrics) for optimizer step `step` (1-based) from the current parameters."""
    t0 = time.perf_counter()
    config = self.exp.config
    chosen = schedule(len(self.train.prompts), step, self.per_step, config.seed)
    indices = np.repeat(chosen, self.group)
    prompts = [self.train.prompts[i] for i in indices]
    completions, logprobs = self.sample(params, [self.train.prompts[i] for i in chosen], n=self.group,
                                        seed=step_seed(config.seed, step),
                                        temperature=self.objective_config.temperature,
                                        top_k=self.objective_config.top_k)
    values = self.score(self.train, indices, completions)
    advantages = group_advantages(values, self.group)
    rows = rollout_rows(prompts, completions, advantages, config.seq_len, self.encoder.tokenizer.pad_id)
    batch = self.exp.global_batch(self._process_rows(rows))  # on-policy: no old log-probs (objectives/grpo.py)
    grouped = values.reshape(-1, self.group)
    metrics = {"reward_mean": float(values.mean()), "reward_std": float(values.std()),
               "reward_group_std": float(grouped.std(axis=1).mean()),
               "groups_without_signal": float(np.mean(grouped.std(axis=1) == 0)),
               "response_length": float(np.mean([len(c) for c in completions])),
               "sampled_logp": float(np.mean([lp for row in logprobs for lp in row])),
               "rollout_seconds": time.perf_counter() - t0}
    return batch, metrics

  def _process_rows(self, rows: dict) -> dict:
    """This process's rows of a global batch every process built whole (consecutive blocks per process)."""
    per = self.exp.config.batch_size // jax.process_count()
    first = jax.process_index() * per
    return {k: v[first:first + per] for k, v in rows.items()}

  def train_step(self, jitted_step, state, step: int, frozen):
    """One GRPO optimizer step: rollouts from `state.params`, then the jitted step on them."""
    batch, host = self.batch(state.params, step)
    state, metrics = jitted_step(state, batch, frozen)
    return state, {**metrics, **host}

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
