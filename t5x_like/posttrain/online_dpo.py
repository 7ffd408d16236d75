"""Online DPO (Guo et al. 2024, "Direct language model alignment from online AI feedback"): each step samples two
answers to each prompt from the current policy, a reward function or a reward model judges which is better, and
the pair trains one DPO step against the frozen reference (posttrain/preference.py's loss).

Rows. Each prompt's pair takes one row in DPO's layout (data/preference.py): segment 1 = prompt + the preferred
completion, segment 2 = prompt + the other, positions restarting at 0 in each, loss weight 1 on the completions'
tokens (exactly as sampled, stop token included: nothing is re-tokenised). A row must hold both, so a prompt and
one completion may take at most (SEQ_LEN + 1) / 2 tokens; longer prompts are skipped and counted. A pair whose two
rewards are equal (or not finite) prefers nothing: its row is left empty (no loss) and counted as
`pairs_without_preference`.
"""

import numpy as np

from t5x_like.data import preference as preference_data
from t5x_like.posttrain import rollout


def pair_rows(episodes: rollout.Episodes, seq_len: int, pad_id: int):
  """(features (P, seq_len) numpy, {metric: value}) of the pairs of an episode batch holding two consecutive
  samples per prompt (see the module docstring)."""
  rows = np.zeros((len(episodes.prompts) // 2, 4, seq_len + 1), np.int32)
  rows[:, 0] = pad_id
  chosen, rejected = [], []
  for p in range(rows.shape[0]):
    a, b = 2 * p, 2 * p + 1
    ra, rb = episodes.rewards[a], episodes.rewards[b]
    if not (np.isfinite(ra) and np.isfinite(rb)) or ra == rb:
      continue
    order = (a, b) if ra > rb else (b, a)
    sides = []
    for i in order:
      prompt, completion = episodes.prompts[i], episodes.completions[i]
      sides.append((np.asarray(list(prompt) + list(completion), np.int32),
                    np.asarray([0] * len(prompt) + [1] * len(completion), np.int32)))
    rows[p] = preference_data.pack_pairs_np([preference_data.Pair(*sides)], seq_len + 1, pad_id)[0]
    chosen.append(order[0])
    rejected.append(order[1])
  tokens, segments, positions, stored = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]
  # the weight of predicting token i + 1 at position i: the token's own, within one segment (packing.row_features)
  same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] != 0)
  features = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments[:, :-1],
              "positions": positions[:, :-1], "weights": (same * stored[:, 1:]).astype(np.float32)}
  length = lambda ids: float(np.mean([len(episodes.completions[i]) for i in ids])) if ids else 0.0
  metrics = {"pairs_without_preference": float(rows.shape[0] - len(chosen)),
             "reward_chosen": float(np.mean(episodes.rewards[chosen])) if chosen else 0.0,
             "reward_rejected": float(np.mean(episodes.rewards[rejected])) if rejected else 0.0,
             "length_chosen": length(chosen), "length_rejected": length(rejected)}
  return features, metrics
