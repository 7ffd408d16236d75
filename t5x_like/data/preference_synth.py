"""A generated preference task (word reversal with a wrong answer) as JSON lines for DPO demos and tests.

Each pair asks to reverse a few distinct words of `words[:-distractors]`; `chosen` is the correct reversal,
`rejected` the same reversal with one word replaced by one of the last `distractors` words, which the prompt
names as the word not to use. A model that has not seen the pairs prefers neither (both answers have the same length and
format); preference training teaches it to prefer the faithful answer.
"""

from __future__ import annotations

import json
import os
import random
from typing import Sequence

from t5x_like.data import chat_synth


def reverse_pair(rng: random.Random, words: Sequence[str], distractors: Sequence[str], num_words: int = 3) -> dict:
  """{"prompt": "reverse: a b c not x", "chosen": "c b a", "rejected": "c x a"} (x a distractor).

  The prompt names the wrong word too, so that both answers copy only words of the prompt: a model that has
  not learnt the preference has no reason to favour either (an untrained model tends to repeat its context).
  """
  picked = rng.sample(list(words), num_words)
  chosen = list(reversed(picked))
  rejected = list(chosen)
  wrong = rng.choice(list(distractors))
  rejected[rng.randrange(num_words)] = wrong
  return {"prompt": f"reverse: {' '.join(picked)} not {wrong}", "chosen": " ".join(chosen),
          "rejected": " ".join(rejected)}


def make_pairs(count: int, seed: int = 0, words: Sequence[str] = chat_synth.WORDS, distractors: int = 6,
               num_words: int = 3) -> list[dict]:
  """`count` pairs with distinct prompts, deterministic in `seed`."""
  if len(words) <= distractors + num_words:
    raise ValueError(f"{len(words)} words leave too few for prompts of {num_words} beside {distractors} distractors")
  rng, seen, out = random.Random(f"preference-{seed}"), set(), []
  prompt_words, wrong = words[:-distractors], words[-distractors:]
  for _ in range(100 * count + 1000):
    if len(out) == count:
      return out
    pair = reverse_pair(rng, prompt_words, wrong, num_words)
    if pair["prompt"] not in seen:
      seen.add(pair["prompt"])
      out.append(pair)
  raise ValueError(f"fewer than {count} distinct prompts of {num_words} of {len(prompt_words)} words")


def write_synthetic_preferences(output_dir: str, count: int = 1200, seed: int = 0, **kwargs) -> str:
  """Writes OUTPUT_DIR/reverse_pairs.jsonl (preprocess --format=preference splits it); returns its path."""
  os.makedirs(output_dir, exist_ok=True)
  path = os.path.join(output_dir, "reverse_pairs.jsonl")
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(p) + "\n" for p in make_pairs(count, seed, **kwargs))
  return path
