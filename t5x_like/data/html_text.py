"""HTML → text with the standard library's HTML parser: markup, scripts, styles and comments go, text stays."""

from __future__ import annotations

import html.parser
import re

# Elements whose content is never text a reader sees.
_SKIPPED = frozenset({"script", "style", "noscript", "template", "svg", "iframe", "object", "head"})
# Elements that start a new line in the rendered page.
_BLOCKS = frozenset({"address", "article", "aside", "blockquote", "br", "dd", "div", "dl", "dt", "fieldset",
                     "figcaption", "figure", "footer", "form", "h1", "h2", "h3", "h4", "h5", "h6", "header",
                     "hr", "li", "main", "nav", "ol", "p", "pre", "section", "table", "tr", "ul", "title"})
_VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track",
                   "wbr"})
# A document is HTML when it starts with markup and either opens as a page or closes several common HTML
# elements: code that mentions `List<String>` or `a < b`, or holds HTML templates in strings, does not.
_PAGE_START = re.compile(r"\A\s*(?:<\?xml[^>]*>\s*)?(?:<!--.*?-->\s*)*<(?:!doctype\s+html|html[\s>])", re.I | re.S)
_COMMON = "html|head|body|div|p|span|a|table|tr|td|ul|ol|li|h[1-6]|script|style|section|article|nav|footer|header"
_CLOSING = re.compile(rf"</(?:{_COMMON})\s*>", re.I)
_SPACES = re.compile(r"[ \t\r\f\v]+")
_BLANKS = re.compile(r"\n\s*\n\s*\n+")


def looks_like_html(text: str, min_pairs: int = 3) -> bool:
  """True for text that starts with markup and is a page (<!doctype html>, <html>) or has `min_pairs` closing
  tags of common HTML elements."""
  if not text.lstrip().startswith("<"):
    return False
  if _PAGE_START.match(text):
    return True
  count = 0
  for _ in _CLOSING.finditer(text):
    count += 1
    if count >= min_pairs:
      return True
  return False


class _TextExtractor(html.parser.HTMLParser):
  """Collects the text of the elements a browser would show; block elements become line breaks."""

  def __init__(self):
    super().__init__(convert_charrefs=True)
    self.parts: list[str] = []
    self.skipping: list[str] = []  # open skipped elements, innermost last

  def handle_starttag(self, tag, attrs):
    del attrs
    if tag in _SKIPPED and tag not in _VOID:
      self.skipping.append(tag)
    elif tag in _BLOCKS and not self.skipping:
      self.parts.append("\n")

  def handle_startendtag(self, tag, attrs):
    if tag in _BLOCKS and not self.skipping:
      self.parts.append("\n")

  def handle_endtag(self, tag):
    if self.skipping:
      if tag == self.skipping[-1]:
        self.skipping.pop()
      elif tag in self.skipping:  # an unclosed inner element: close up to this one
        del self.skipping[self.skipping.index(tag):]
      return
    if tag in _BLOCKS:
      self.parts.append("\n")

  def handle_data(self, data):
    if not self.skipping:
      self.parts.append(data)


def html_to_text(page: str) -> str:
  """The visible text of an HTML page or fragment, one line per block element, entities decoded.

  Example:
    >>> html_to_text("<p>caf&eacute; <b>bar</b></p><script>x()</script><div>next</div>")
    'café bar\\n\\nnext'
  """
  parser = _TextExtractor()
  parser.feed(page)
  parser.close()
  lines = (_SPACES.sub(" ", line).strip() for line in "".join(parser.parts).split("\n"))
  return _BLANKS.sub("\n\n", "\n".join(lines)).strip("\n")
