"""Heuristic quality filters for web text (after Gopher's and C4's rules): each counts what it removed and
keeps a few examples of it for the report. TF-free: runs in the tokenization workers."""

from __future__ import annotations

import collections
import dataclasses
import re

EXAMPLES_PER_RULE = 3  # examples of each rule's removals kept for the report
EXAMPLE_CHARS = 120  # characters of each example
_WORD = re.compile(r"\w+", re.U)
# Lines a page template repeats on every page: cookie banners, navigation, legal footers, sharing buttons.
BOILERPLATE = (r"\bcookies?\b.*\b(use|accept|policy|consent)\b|\b(accept|allow) (all )?cookies\b",
               r"\benable javascript\b|\bjavascript (is )?(disabled|required)\b",
               r"\b(privacy policy|terms of (use|service)|all rights reserved)\b",
               r"^\W*(home|menu|log ?in|sign ?in|sign ?up|register|subscribe|share( this)?|skip to (main )?content)"
               r"(\W+(home|menu|log ?in|sign ?in|sign ?up|register|subscribe|share|search|contact))*\W*$",
               r"\blorem ipsum\b")


@dataclasses.dataclass(frozen=True)
class QualityConfig:
  """Which heuristic filters run and their limits; a document past a limit is dropped (dropped_<rule>)."""
  enabled: bool = False                     # off: documents pass untouched (code, chat, curated text)
  max_duplicate_line_fraction: float = 0.3  # repeated_lines: share of non-empty lines that repeat an earlier one
  max_top_bigram_fraction: float = 0.2      # repeated_ngrams: share of word characters in the most frequent
                                            # word bigram (Gopher's 2-gram rule)
  max_symbol_ratio: float = 0.1             # symbol_ratio: characters that are neither letters, digits,
                                            # whitespace nor common punctuation, over all non-space characters
  max_digit_ratio: float = 0.2              # digit_ratio: digits over all non-space characters
  min_mean_word_length: float = 3.0         # mean_word_length: mean word length outside [min, max]
  max_mean_word_length: float = 10.0
  min_words: int = 5                        # too_few_words: documents with fewer words (after boilerplate lines)
  remove_boilerplate_lines: bool = True     # delete lines matching `BOILERPLATE` (changed_boilerplate_lines)

  def __post_init__(self):
    for key in ("max_duplicate_line_fraction", "max_top_bigram_fraction", "max_symbol_ratio", "max_digit_ratio"):
      if not 0 < getattr(self, key) <= 1:
        raise ValueError(f"QualityConfig.{key} must be in (0, 1], got {getattr(self, key)}")
    if not 0 <= self.min_mean_word_length <= self.max_mean_word_length:
      raise ValueError(f"QualityConfig mean word length bounds must satisfy 0 <= min <= max, got "
                       f"[{self.min_mean_word_length}, {self.max_mean_word_length}]")


_BOILERPLATE = re.compile("|".join(f"(?:{p})" for p in BOILERPLATE), re.I)
_COMMON_PUNCTUATION = set(".,;:!?'\"()-–—’‘“”/%&")


def note(examples: dict, rule: str, text: str, whole: bool = False) -> None:
  """Keeps the first EXAMPLES_PER_RULE examples of `rule`, each cut to EXAMPLE_CHARS characters unless `whole` (a
  message naming an input file, kept whole however long its path)."""
  kept = examples.setdefault(rule, [])
  if len(kept) < EXAMPLES_PER_RULE:
    kept.append(text if whole or len(text) <= EXAMPLE_CHARS else text[:EXAMPLE_CHARS] + "…")


def merge_examples(per_input) -> dict:
  """Examples of several inputs, in input order, at most EXAMPLES_PER_RULE per rule."""
  out: dict = {}
  for examples in per_input:
    for rule, texts in sorted(examples.items()):
      for text in texts:
        if len(out.setdefault(rule, [])) < EXAMPLES_PER_RULE:
          out[rule].append(text)
  return out


def _failed_rule(text: str, words: list[str], config: QualityConfig) -> str | None:
  """The first rule the document breaks, or None."""
  if len(words) < config.min_words:
    return "too_few_words"
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  if len(lines) > 1 and 1 - len(set(lines)) / len(lines) > config.max_duplicate_line_fraction:
    return "repeated_lines"
  bigrams = collections.Counter(zip(words, words[1:]))
  if bigrams:
    (a, b), n = bigrams.most_common(1)[0]
    if n > 1 and n * (len(a) + len(b)) / sum(map(len, words)) > config.max_top_bigram_fraction:
      return "repeated_ngrams"
  chars = [c for c in text if not c.isspace()]
  if chars:
    symbols = sum(1 for c in chars if not c.isalnum() and c not in _COMMON_PUNCTUATION)
    if symbols / len(chars) > config.max_symbol_ratio:
      return "symbol_ratio"
    if sum(c.isdigit() for c in chars) / len(chars) > config.max_digit_ratio:
      return "digit_ratio"
  mean = sum(map(len, words)) / len(words)
  if not config.min_mean_word_length <= mean <= config.max_mean_word_length:
    return "mean_word_length"
  return None


def apply(text: str, config: QualityConfig, counts: collections.Counter, examples: dict) -> str | None:
  """Removes boilerplate lines, then drops the document (None) if it breaks a rule; counts both.

  Example:
    >>> apply("Buy now buy now buy now buy now", QualityConfig(enabled=True), c, e)   # None
    >>> c["dropped_repeated_ngrams"], e["repeated_ngrams"]
    (1, ['Buy now buy now buy now buy now'])
  """
  if not config.enabled:
    return text
  if config.remove_boilerplate_lines:
    lines = text.split("\n")
    kept = [line for line in lines if not _BOILERPLATE.search(line)]
    if len(kept) < len(lines):
      counts["changed_boilerplate_lines"] += 1
      counts["boilerplate_lines_removed"] += len(lines) - len(kept)
      for line in lines:
        if _BOILERPLATE.search(line):
          note(examples, "boilerplate_lines", line.strip())
      text = "\n".join(kept)
  words = [w.lower() for w in _WORD.findall(text)]
  rule = _failed_rule(text, words, config)
  if rule is None:
    return text
  counts[f"dropped_{rule}"] += 1
  note(examples, rule, " ".join(text.split()))
  return None
