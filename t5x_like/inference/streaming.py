"""The text of one generated sample as its tokens arrive: what may be sent now, so that the streamed pieces
concatenate to exactly the final text (cut before a stop string), and each token's own text for log-probs.

Text that could still change is held back: the end of the text when it is the start of a stop string (the
next token may complete it, and the stop string is never sent), and a trailing U+FFFD (a character whose
bytes are split over tokens).
"""

from typing import Callable, Optional, Sequence


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
  """`text` before the first occurrence of any stop string."""
  cuts = [text.find(s) for s in stops if s in text]
  return text[:min(cuts)] if cuts else text


def held_back(text: str, stops: Sequence[str]) -> int:
  """How many characters at the end of `text` may still change or become part of a stop string."""
  keep = 0
  for stop in stops:
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
      if text.endswith(stop[:k]):
        keep = max(keep, k)
        break
  if text.endswith("\ufffd"):
    keep = max(keep, len(text) - len(text.rstrip("\ufffd")))
  return keep


class SampleText:
  """One sample's tokens, log-probs and text sent so far.

  Example:
    s = SampleText(tok.decode, stops=("\\n",), want_pieces=True)
    new_text, pieces, logprobs, finish = s.add([17], [-0.3], None)   # stream new_text; pieces: each token's text
  """

  def __init__(self, text_fn: Callable[[list], str], stops: Sequence[str] = (), want_pieces: bool = False):
    """Args:
      text_fn: token ids → the sample's text (e.g. the chat encoder's completion_text).
      stops: stop strings (the engine stops at them; the text is cut before the first).
      want_pieces: keep each token's own text (the log-probs' `tokens`), decoding once per token.
    """
    self.text_fn, self.stops, self.want_pieces = text_fn, tuple(stops), want_pieces
    self.tokens, self.logprobs, self.pieces = [], [], []
    self.sent = ""
    self.finish_reason: Optional[str] = None
    self._decoded = ""

  def add(self, tokens: Sequence[int], logprobs: Sequence[float], finish_reason: Optional[str]) -> tuple:
    """Takes a step's new tokens; returns (text to send now, the new tokens' texts, their log-probs,
    finish_reason)."""
    pieces = []
    for t in tokens:
      self.tokens.append(int(t))
      if self.want_pieces:
        text = self.text_fn(self.tokens)
        pieces.append(text[len(self._decoded):] if text.startswith(self._decoded) else text)
        self._decoded = text
    self.logprobs += list(logprobs)
    self.pieces += pieces
    self.finish_reason = finish_reason
    full = cut_at_stop(self.text_fn(self.tokens), self.stops)
    if finish_reason is None:
      full = full[:len(full) - held_back(full, self.stops)]
    new = full[len(self.sent):] if full.startswith(self.sent) else ""
    self.sent += new
    return new, pieces, list(logprobs), finish_reason

  def final_text(self) -> str:
    """The whole text, cut before the first stop string."""
    return cut_at_stop(self.text_fn(self.tokens), self.stops)

  def offset_of(self, pieces: Sequence[str]) -> int:
    """The text offset of the first of `pieces`, the most recently added ones."""
    return sum(len(p) for p in self.pieces[:len(self.pieces) - len(pieces)])
