"""The one-line form of an exception, for log lines and the `error: ...` line an entry point exits with."""

from typing import Callable, Optional

# (exception) → the reason an entry point exits with; set by parallel.distributed.initialize in a multi-process run,
# so that an error that may be a peer's death names the dead process (errors stays free of jax).
_EXIT_REASON: list = [None]


def first_line(error: BaseException, *, with_type: bool = False, limit: Optional[int] = None) -> str:
  """The first line of `error`'s message (orbax and XLA errors run to pages).

  Args:
    error: any exception.
    with_type: prefix the exception's class name: "ValueError: ...".
    limit: cut the line to at most this many characters.

  Returns:
    e.g. "gin file 'x.gin' not found"; the class name alone when the message is empty.
  """
  text = str(error).strip()
  line = text.splitlines()[0] if text else ""
  if limit is not None:
    line = line[:limit]
  if with_type:
    return f"{type(error).__name__}: {line}"
  return line or type(error).__name__


def set_exit_reason(explain: Optional[Callable[[BaseException], str]]) -> None:
  """Makes `explain(exception)` the one-line reason `exit_reason` gives (None: back to first_line)."""
  _EXIT_REASON[0] = explain


def exit_reason(error: BaseException) -> str:
  """The one line an entry point exits with for `error`: first_line, or the multi-process explanation."""
  return _EXIT_REASON[0](error) if _EXIT_REASON[0] is not None else first_line(error)
