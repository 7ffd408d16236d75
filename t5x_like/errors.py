"""The one-line form of an exception, for log lines and the `error: ...` line an entry point exits with."""

from typing import Optional


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
