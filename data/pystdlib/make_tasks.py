"""Writes the shipped lm-eval tasks' data (configs/tasks/*.jsonl) from this machine's Python standard library.

    python data/pystdlib/make_tasks.py            # rewrites configs/tasks/*.jsonl (deterministic for a stdlib)

- pystdlib_next_line (multiple choice): six lines of a stdlib file and the first half of a seventh; pick that line's
  real continuation among it and the continuations of three lines of similar length from other files.
- pystdlib_cloze (log-likelihood, LAMBADA-style): four lines and the start of a fifth; the identifier that ends it.
- copy_digits (generate_until, exact match): copy a list of digits after three solved examples.

The committed files were made from Python 3.11's stdlib; the corpus `prepare.py` builds is the same files, so a
model trained on it has seen these lines (the tasks measure what it learnt, not generalisation).
"""

import json
import os
import random
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prepare  # pylint: disable=g-import-not-at-top,wrong-import-position  (stdlib_files: the corpus's file list)

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "tasks")
ITEMS = 200
CONTEXT_LINES = 6


def _code_lines(path: str) -> list:
  with open(path, encoding="utf-8", errors="replace") as f:
    return [line.rstrip("\n") for line in f]


def _good(line: str) -> bool:
  text = line.strip()
  return 20 <= len(text) <= 100 and not text.startswith(("#", '"""', "'''"))


def next_line_items(files: list, rng: random.Random) -> list:
  """The real second half of a code line (after its first half and the lines before it) against the second halves
  of three lines of similar length from other files."""
  pool = [(f, line) for f in files for line in _code_lines(f) if _good(line)]
  items = []
  while len(items) < ITEMS:
    path = rng.choice(files)
    lines = _code_lines(path)
    i = rng.randrange(CONTEXT_LINES, max(CONTEXT_LINES + 1, len(lines)))
    if i >= len(lines) or not _good(lines[i]):
      continue
    cut = _half(lines[i])
    similar = [line[_half(line):] for f, line in rng.sample(pool, 400)
               if f != path and abs(len(line) - len(lines[i])) <= 12 and line[_half(line):] != lines[i][cut:]]
    if len(similar) < 3:
      continue
    choices = similar[:3] + [lines[i][cut:]]
    rng.shuffle(choices)
    items.append({"context": "\n".join(lines[i - CONTEXT_LINES:i + 1])[:-(len(lines[i]) - cut)],
                  "choices": choices, "label": choices.index(lines[i][cut:]), "source": os.path.basename(path)})
  return items


def _half(line: str) -> int:
  """Where a line is cut: the first space at or after its middle (the continuation starts with that space)."""
  middle = len(line) // 2
  space = line.find(" ", middle)
  return space if space > 0 else middle


def cloze_items(files: list, rng: random.Random) -> list:
  items = []
  while len(items) < ITEMS:
    path = rng.choice(files)
    lines = _code_lines(path)
    i = rng.randrange(4, max(5, len(lines)))
    if i >= len(lines):
      continue
    found = re.match(r"^(.*\W)([A-Za-z_]\w{2,})$", lines[i].rstrip())
    if not found or not _good(lines[i]) or found.group(1).strip() == "":
      continue
    items.append({"context": "\n".join(lines[i - 4:i]) + "\n" + found.group(1), "target": found.group(2),
                  "source": os.path.basename(path)})
  return items


def copy_items(rng: random.Random, count: int) -> list:
  return [{"digits": " " + " ".join(str(rng.randrange(10)) for _ in range(rng.randint(3, 6)))}
          for _ in range(count)]


def write(name: str, items: list) -> None:
  with open(os.path.join(OUT, name), "w", encoding="utf-8") as f:
    f.writelines(json.dumps(item, ensure_ascii=False) + "\n" for item in items)
  print(f"wrote {len(items)} items to configs/tasks/{name}")


def main() -> None:
  # the codec tables of encodings/ are thousands of near-identical lines: no test of reading code
  files = [f for f in prepare.stdlib_files(10 << 20) if f"{os.sep}encodings{os.sep}" not in f]
  rng = random.Random(0)
  write("pystdlib_next_line.jsonl", next_line_items(files, rng))
  write("pystdlib_cloze.jsonl", cloze_items(files, rng))
  write("copy_digits_train.jsonl", copy_items(rng, 20))
  write("copy_digits_test.jsonl", copy_items(rng, 100))


if __name__ == "__main__":
  main()
