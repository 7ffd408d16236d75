"""Generated instruction tasks (word reversal, first word, in-context key lookup) as chat JSON lines, for fine-tuning
demos and tests."""

from __future__ import annotations

import json
import os
import random

# Short words that code-trained tokenizers (the pystdlib demo's) keep whole or nearly so.
WORDS = ("self", "return", "value", "name", "path", "data", "file", "list", "dict", "line", "text", "key",
         "item", "node", "args", "type", "size", "mode", "time", "code", "class", "error", "index", "count",
         "state", "result", "module", "object", "string", "number", "buffer", "config")
KEYS = tuple("abcdefghijklmnopqrstuvwxyz")
TASKS = ("reverse", "first", "lookup")


def reverse_example(rng: random.Random, min_words: int = 2, max_words: int = 4) -> dict:
  """{"prompt": "reverse: a b c", "completion": "c b a"} over distinct WORDS."""
  words = rng.sample(WORDS, rng.randint(min_words, max_words))
  return {"prompt": "reverse: " + " ".join(words), "completion": " ".join(reversed(words))}


def first_example(rng: random.Random, min_words: int = 3, max_words: int = 5) -> dict:
  """{"prompt": "first word: a b c", "completion": "a"} over distinct WORDS: a one-word answer read from the prompt."""
  words = rng.sample(WORDS, rng.randint(min_words, max_words))
  return {"prompt": "first word: " + " ".join(words), "completion": words[0]}


def lookup_example(rng: random.Random, table_size: int = 4) -> dict:
  """A table of key=value pairs in the system turn, a key in the user turn, its value as the answer.

  The table is drawn anew for each example, so the answer must be read from the context.
  """
  keys = rng.sample(KEYS, table_size)
  values = rng.sample(WORDS, table_size)
  asked = rng.randrange(table_size)
  table = " ".join(f"{k}={v}" for k, v in zip(keys, values))
  return {"messages": [{"role": "system", "content": "table: " + table},
                       {"role": "user", "content": "value of " + keys[asked]},
                       {"role": "assistant", "content": values[asked]}]}


def make_examples(task: str, count: int, seed: int = 0, exclude: frozenset = frozenset(), **kwargs) -> list[dict]:
  """`count` distinct examples of `task` (one of TASKS), deterministic in `seed`.

  Args:
    exclude: JSON strings (as `json.dumps(example, sort_keys=True)`) never to produce (a train set).
    **kwargs: the task's options (min_words / max_words, table_size).
  """
  if task not in TASKS:
    raise ValueError(f"chat_synth task must be one of {TASKS}, got '{task}'")
  make = {"reverse": reverse_example, "first": first_example, "lookup": lookup_example}[task]
  rng, seen, out = random.Random(f"{task}-{seed}"), set(exclude), []
  for _ in range(100 * count + 1000):
    if len(out) == count:
      return out
    example = make(rng, **kwargs)
    key = json.dumps(example, sort_keys=True)
    if key not in seen:
      seen.add(key)
      out.append(example)
  raise ValueError(f"chat_synth task '{task}' {kwargs} has fewer than {count} distinct new examples")


def write_synthetic_chat(output_dir: str, task: str = "reverse", num_train: int = 2000, num_test: int = 200,
                         seed: int = 0, **kwargs) -> tuple[str, str]:
  """Writes OUTPUT_DIR/{task}_train.jsonl and {task}_test.jsonl (no example in both); returns their paths.

  A model that was never fine-tuned on the task answers it (exact match of the completion) almost never;
  a fine-tuned one learns it. The test lines carry the reference completion, for generation-based
  evaluation.
  """
  train = make_examples(task, num_train, seed, **kwargs)
  test = make_examples(task, num_test, seed + 1,
                       exclude=frozenset(json.dumps(e, sort_keys=True) for e in train), **kwargs)
  os.makedirs(output_dir, exist_ok=True)
  paths = []
  for name, examples in (("train", train), ("test", test)):
    path = os.path.join(output_dir, f"{task}_{name}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
      f.writelines(json.dumps(e) + "\n" for e in examples)
    paths.append(path)
  return paths[0], paths[1]
