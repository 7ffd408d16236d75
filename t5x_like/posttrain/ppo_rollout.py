"""PPO's batches: one rollout every ppo_epochs × num_minibatches optimizer steps, then minibatches of it.

Cycle k (1-based) covers optimizer steps (k−1)·U + 1 .. k·U, U = ppo_epochs × num_minibatches. Its first step
samples the rollout from the parameters it starts from: N = BATCH_SIZE × num_minibatches completions
(posttrain/rollout.Rollouts.collect with index k: the same prompts and draws for the same k), scores them, and
reads, in one forward pass of the trainer on the rollout rows, the policy's log-probs and values and the frozen
reference's log-probs. With those the host computes the per-token rewards, GAE and whitened advantages
(posttrain/ppo.py). Step (k−1)·U + 1 + e·M + m then trains on minibatch m of epoch e: BATCH_SIZE rows of a
permutation of the N seeded by (SEED, k, e).

The old log-probs are the trainer's own numbers, so the first update's ratio is exactly 1; the engine's log-probs
of the same tokens are compared with them as `rollout/logprob_gap`.

Resuming. A run resumed at a cycle's first step samples the same rollout again (same parameters, same seeds). To
resume inside a cycle, the rollout's arrays are kept in MODEL_DIR/ppo_rollouts/<k>.npz, written by the first
process when the cycle begins and kept while a committed checkpoint, or the save that may still be in flight as a
cycle begins, lies inside cycle k (`stale_cycles`); every process reads them back (a filesystem all processes share,
as MODEL_DIR already is for checkpoints).
"""

import io
import os
import time

import jax
import numpy as np
import tensorflow as tf

from t5x_like.parallel import global_batch
from t5x_like.posttrain import ppo
from t5x_like.posttrain import preference
from t5x_like.posttrain import rollout
from t5x_like.training import checkpointing

ROLLOUT_DIR = "ppo_rollouts"


def stale_cycles(on_disk, committed, updates: int, cycle: int, checkpoint_every: int) -> list:
  """The cycles among `on_disk` whose rollout no checkpoint can resume into, now or once a save in flight commits,
  as cycle `cycle` begins.

  A checkpoint at step s resumes at step s + 1, inside cycle s // updates + 1 unless s ends a cycle. Saves are
  asynchronous: the last one started before this cycle, at the last multiple of `checkpoint_every` up to the step
  before it, may commit after the listing `committed` was read, so its cycle is kept too. (One save is in flight at
  most: fault_tolerance.Saver.save settles the one before it. The others are the end of the run's and a
  preemption's, after which no cycle begins.) The current cycle is always kept."""
  started = ((cycle - 1) * updates // checkpoint_every) * checkpoint_every if checkpoint_every else 0
  keep = {cycle} | {s // updates + 1 for s in [*committed, started] if s > 0 and s % updates}
  return sorted(k for k in on_disk if k not in keep)


class PpoRollouts:
  """An Experiment's PPO batches (see the module docstring)."""

  def __init__(self, exp, stats_fn):
    """stats_fn: (params, frozen ({} or {REFERENCE: its params}), batch) → (log-probs, values, reference log-probs
    or None), each (N, L) float32: the trainer's forward pass on rollout rows."""
    self.exp = exp
    self.config = exp.config.recipe_config
    self.minibatches = self.config.num_minibatches
    self.updates = self.config.ppo_epochs * self.minibatches
    self.rollouts = rollout.Rollouts(exp, rows=exp.config.batch_size * self.minibatches, play=self.config.play_fn())
    self.cycle, self.data, self.metrics = None, None, {}
    features = ("inputs", "targets", "positions", "segment_ids")
    frozen = {k: v for k, v in exp.frozen_shardings.items() if k == preference.REFERENCE}
    self.stats = rollout.host_fn(exp, stats_fn, (exp.state_shardings.params, frozen,
                                                 {k: exp.batch_sharding for k in features}))
    self.features = features

  def path(self, cycle: int) -> str:
    return os.path.join(self.exp.config.model_dir, ROLLOUT_DIR, f"{cycle}.npz")

  def batch(self, params, step: int):
    """(global minibatch, host metrics) for optimizer step `step` (1-based)."""
    cycle, inner = divmod(step - 1, self.updates)
    cycle += 1
    seconds = 0.0
    if self.cycle != cycle:
      if inner == 0:
        seconds = self._rollout(params, cycle)
      else:
        self._load(cycle, step)
    epoch, minibatch = divmod(inner, self.minibatches)
    order = np.random.default_rng([self.exp.config.seed, cycle, epoch]).permutation(self.rollouts.rows)
    size = self.exp.config.batch_size
    rows = order[minibatch * size:(minibatch + 1) * size]
    local = self.rollouts.process_rows({k: v[rows] for k, v in self.data.items()})
    return self.exp.global_batch(local), {**self.metrics, "rollout_seconds": seconds}

  def _rollout(self, params, cycle: int) -> float:
    """Samples, scores and prepares cycle `cycle`'s rollout (self.data, self.metrics); returns its seconds."""
    t0 = time.perf_counter()
    rollouts, config = self.rollouts, self.config
    episodes = rollouts.collect(params, cycle)
    rows = rollouts.rows_of(episodes, np.zeros(rollouts.rows, np.float32))
    del rows["advantages"]
    batch = global_batch.to_global(rollouts.process_rows({k: rows[k] for k in self.features}), self.exp.batch_sharding)
    frozen = {k: v for k, v in self.exp.frozen.items() if k == preference.REFERENCE}
    logps, values, ref_logps = self.stats(params, frozen, batch)
    weights = rows["weights"]
    if ref_logps is None:
      ref_logps = logps
    scores = np.nan_to_num(episodes.rewards)  # a dropped episode's row has no weighted position
    rewards = ppo.token_rewards(logps, ref_logps, weights, scores, config.kl_coef)
    advantages, returns = ppo.gae(rewards, values, weights, config.gamma, config.lam)
    self.data = {**rows, "old_logps": logps, "old_values": values * (weights > 0),
                 "advantages": ppo.whiten(advantages, weights).astype(np.float32),
                 "returns": returns.astype(np.float32)}
    w = weights > 0
    per_episode = lambda x: float(np.sum(x * w) / max(int(w.any(axis=1).sum()), 1))
    metrics = episodes.metrics()
    del metrics["rollout_seconds"]
    self.metrics = {**metrics,
                    "rollout/logprob_gap": rollouts.logprob_gap(params, batch, weights, episodes, trainer=logps),
                    "rollout/kl": per_episode(logps - ref_logps),  # Σ over a completion's tokens, mean over episodes
                    "rollout/non_score_reward": per_episode(-config.kl_coef * (logps - ref_logps)),
                    "rollout/explained_variance": ppo.explained_variance(values, returns, weights),
                    "rollout/value_mean": float(values[w].mean()) if w.any() else 0.0}
    self.cycle = cycle
    if jax.process_index() == 0 and self.updates > 1:
      self._save(cycle)
    return time.perf_counter() - t0

  def _save(self, cycle: int) -> None:
    """Writes cycle `cycle`'s rollout, and removes the files no checkpoint can resume into any more."""
    path = self.path(cycle)
    folder = os.path.dirname(path)
    tf.io.gfile.makedirs(folder)
    buffer = io.BytesIO()
    np.savez(buffer, **self.data, **{f"metric:{k}": np.asarray(v) for k, v in self.metrics.items()})
    with tf.io.gfile.GFile(path + ".tmp", "wb") as f:
      f.write(buffer.getvalue())
    tf.io.gfile.rename(path + ".tmp", path, overwrite=True)
    on_disk = [int(n[:-4]) for n in tf.io.gfile.listdir(folder) if n.endswith(".npz") and n[:-4].isdigit()]
    committed = checkpointing.committed_steps(self.exp.config.model_dir)
    for stale in stale_cycles(on_disk, committed, self.updates, cycle, self.exp.config.checkpoint_every):
      tf.io.gfile.remove(os.path.join(folder, f"{stale}.npz"))

  def _load(self, cycle: int, step: int) -> None:
    path = self.path(cycle)
    if not tf.io.gfile.exists(path):
      raise ValueError(f"{path} is missing: the run resumes at step {step}, inside PPO cycle {cycle} (steps "
                       f"{(cycle - 1) * self.updates + 1}..{cycle * self.updates}), whose rollout it cannot sample "
                       "again; restore a checkpoint at a cycle's boundary")
    with tf.io.gfile.GFile(path, "rb") as f:
      saved = dict(np.load(io.BytesIO(f.read())))
    self.data = {k: v for k, v in saved.items() if not k.startswith("metric:")}
    self.metrics = {k[len("metric:"):]: float(v) for k, v in saved.items() if k.startswith("metric:")}
    self.cycle = cycle
