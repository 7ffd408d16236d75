"""A Hugging Face chat template (Jinja) as a `data.ChatTemplate`, or one line that says what it cannot express.

A `data.ChatTemplate` renders every turn as `marker + content + end + separator`, after a `prefix` (a BOS) and
with an optional `default_system` turn. Many hub templates are that shape with multi-token markers: ChatML
(Qwen 2/2.5: `<|im_start|>user\\n` … `<|im_end|>\\n`), Llama 3 (`<|start_header_id|>user<|end_header_id|>\\n\\n` …
`<|eot_id|>`), Gemma (`<start_of_turn>user\\n` … `<end_of_turn>\\n`, no system turn). `from_jinja` renders probe
conversations with the Jinja source (as transformers does: a sandbox, trim_blocks, lstrip_blocks, loop controls,
`raise_exception`), reads the pieces between their contents, and accepts the result only when the ChatTemplate
renders the same text for every probe (with and without a system turn, with a generation prompt). What it cannot
express it names in `NotExpressible`: user and assistant turns that end differently (Mistral's `[INST]`),
turns that open differently late in a conversation (Qwen 3's empty `<think>` block), a system turn that is not a
turn (Gemma folds it into the first user turn: converted with no system turn, and said so). Contents are
rendered as given: templates that `trim` them (Llama 3, Gemma) differ only on content with outer whitespace.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Optional

from t5x_like.data import chat

GIN_FILE = "chat_template.gin"  # written by `convert from_hf` next to the model: --gin_file=MODEL_DIR/chat_template.gin
_S, _U1, _A1, _U2, _A2 = "SYSTEMTEXT1", "USERTEXT1", "ASSISTANTTEXT1", "USERTEXT2", "ASSISTANTTEXT2"


class NotExpressible(ValueError):
  """The template cannot be written as a data.ChatTemplate; the message says why, in one line."""


def read_template(folder: str) -> Optional[str]:
  """The Jinja source of a HF folder's chat template (chat_template.jinja, chat_template.json, or
  tokenizer_config.json's "chat_template": a string, or a list of {name, template} whose "default" is taken);
  None when it has none."""
  path = os.path.join(folder, "chat_template.jinja")
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      return f.read()
  for name in ("chat_template.json", "tokenizer_config.json"):
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
      continue
    with open(path, encoding="utf-8") as f:
      value = json.load(f).get("chat_template")
    if isinstance(value, list):
      value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(value, str):
      return value
  return None


def _environment():
  import jinja2  # pylint: disable=g-import-not-at-top  (convert from_hf only)
  import jinja2.sandbox  # pylint: disable=g-import-not-at-top

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                     extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


def render(source: str, messages: list, add_generation_prompt: bool, bos: str = "", eos: str = "") -> str:
  """The text the Jinja template renders for `messages` ([(role, content)])."""
  template = _environment().from_string(source)
  return template.render(messages=[{"role": r, "content": c} for r, c in messages], bos_token=bos, eos_token=eos,
                         add_generation_prompt=add_generation_prompt, tools=None)


def _split(text: str, contents: list) -> list:
  """The pieces of `text` around each of `contents` in order; NotExpressible when one is missing."""
  pieces, at = [], 0
  for content in contents:
    k = text.find(content, at)
    if k < 0:
      raise NotExpressible(f"it does not render the content {content!r} of every turn in order")
    pieces.append(text[at:k])
    at = k + len(content)
  return pieces + [text[at:]]


def _leading_token(tokenizer, text: str) -> Optional[str]:
  """The longest leading piece of `text` that is a single token (the end marker), or None."""
  return next((text[:cut] for cut in range(len(text), 0, -1) if chat.token_id(tokenizer, text[:cut]) is not None),
              None)


def from_jinja(source: str, tokenizer, bos: str = "", eos: str = "") -> tuple[chat.ChatTemplate, Optional[str]]:
  """(the ChatTemplate that renders as `source` does, a note on what it leaves out: None, or why it has no system
  turn).

  Raises:
    NotExpressible: the template is not `prefix + (marker + content + end + separator)*` for any ChatTemplate.
  """
  def rendered(messages, gen):
    try:
      return render(source, messages, gen, bos, eos)
    except Exception as e:  # pylint: disable=broad-except  (Jinja and the template's own raise_exception)
      raise NotExpressible(f"rendering {[r for r, _ in messages]} fails: {str(e).splitlines()[0]}") from None

  pre, close_u, close_a, close_u2, last = _split(rendered([("user", _U1), ("assistant", _A1), ("user", _U2),
                                                          ("assistant", _A2)], False), [_U1, _A1, _U2, _A2])
  if close_u != close_u2:
    raise NotExpressible(f"its second user turn ends with {close_u2!r}, the first with {close_u!r}")
  final_eos = bool(eos) and last.endswith(eos) and not close_a.startswith(last)
  closing = last[:-len(eos)] if final_eos else last
  if not (close_u.startswith(closing) and close_a.startswith(closing)):
    raise NotExpressible(f"user turns end with {close_u!r} and assistant turns with {close_a!r} before the next "
                         f"turn but {last!r} at the end: a ChatTemplate has one end marker")
  end = _leading_token(tokenizer, closing)
  if end is None:
    raise NotExpressible(f"turns end with {closing!r}, which does not start with a single token")
  user, assistant = close_a[len(closing):], close_u[len(closing):]
  if not pre.endswith(user):
    raise NotExpressible(f"its first user turn opens with {pre!r}, later ones with {user!r}")
  prefix0, system, default_system, note = pre[:len(pre) - len(user)], "", "", None
  try:
    pre_s, after_s, *_ = _split(rendered([("system", _S), ("user", _U1), ("assistant", _A1)], False), [_S, _U1, _A1])
    if after_s != closing + user:
      raise NotExpressible(f"its system content is not a turn of its own (followed by {after_s!r}, not an end "
                           "marker and a user turn)")
  except NotExpressible as e:
    note = f"no system turn: {e}"
  else:
    # the system marker starts where the user marker's leading special token last occurs (after any BOS prefix)
    lead = max((p for p in getattr(tokenizer, "special_pieces", dict)() if p and user.startswith(p)), key=len,
               default="")
    cut = max(pre_s.rfind(lead), 0) if lead else 0
    prefix, system = pre_s[:cut], pre_s[cut:]
    if prefix0 != prefix:  # rendered without a system message, the template writes one of its own
      if not (prefix0.startswith(prefix + system) and prefix0.endswith(closing)):
        raise NotExpressible(f"without a system message it opens with {prefix0!r}, not {prefix!r} nor a system turn")
      default_system = prefix0[len(prefix + system):len(prefix0) - len(closing)]
  template = chat.ChatTemplate(system=system, user=user, assistant=assistant, end=end,
                               separator=closing[len(end):], default_system=default_system,
                               prefix=prefix0 if not system else prefix)
  _verify(template, rendered, final_eos, eos)
  return template, note


def text_of(template: chat.ChatTemplate, messages: list, add_generation_prompt: bool) -> str:
  """The text a ChatTemplate renders (before its final EOS token): what ChatEncoder's token ids spell."""
  if template.default_system and not any(r == "system" for r, _ in messages):
    messages = [("system", template.default_system)] + list(messages)
  markers = template.markers()
  text = template.prefix + "".join(markers[r] + c + template.end + template.separator for r, c in messages)
  return text + (template.assistant if add_generation_prompt else "")


def _verify(template: chat.ChatTemplate, rendered, final_eos: bool, eos: str) -> None:
  """NotExpressible unless `template` renders every probe exactly as the Jinja source does."""
  probes = [[("user", _U1)], [("user", _U1), ("assistant", _A1)], [("user", _U1), ("assistant", _A1), ("user", _U2)],
            [("user", _U1), ("assistant", _A1), ("user", _U2), ("assistant", _A2)]]
  if template.system:
    probes += [[("system", _S)] + p for p in probes]
  for messages in probes:
    gen = messages[-1][0] == "user"  # a prompt asks for the assistant's turn
    want = rendered(messages, gen)
    have = text_of(template, messages, gen) + (eos if final_eos and not gen else "")
    if want != have:
      at = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
      raise NotExpressible(f"for {[r for r, _ in messages]} it renders {want[max(0, at - 20):at + 20]!r} where a "
                           f"ChatTemplate renders {have[max(0, at - 20):at + 20]!r}")


def gin_bindings(template: chat.ChatTemplate, origin: str, note: Optional[str]) -> str:
  """A gin file that binds `template` (every field, so it does not depend on the defaults)."""
  lines = [f"# The chat template of {origin} as a data.ChatTemplate (python -m t5x_like.convert from_hf).",
           "# Use it with preprocess, infer --chat, evaluate --generate and serve: --gin_file=<this file>."]
  if note:
    lines.append(f"# Left out: {note}")
  lines += [f"data.ChatTemplate.{f.name} = {json.dumps(getattr(template, f.name), ensure_ascii=False)}"
            for f in dataclasses.fields(template)]
  return "\n".join(lines) + "\n"


def convert_folder(hf_dir: str, tokenizer) -> tuple[Optional[str], str]:
  """(gin text binding the folder's chat template or None, a one-line report) for `convert from_hf`."""
  source = read_template(hf_dir)
  if source is None:
    return None, f"{hf_dir} has no chat template"
  if tokenizer is None:
    return None, f"chat template of {hf_dir} not converted: the folder has no tokenizer"
  names = {i: text for text, i in getattr(tokenizer, "special_pieces", dict)().items()}
  bos, eos = names.get(tokenizer.bos_id, ""), names.get(tokenizer.eos_id, "")
  try:
    template, note = from_jinja(source, tokenizer, bos, eos)
    chat.ChatEncoder(tokenizer, template)  # its markers resolve to tokens (or this names the one that does not)
  except ValueError as e:
    return None, (f"chat template of {hf_dir} is not expressible as a data.ChatTemplate: {e}; bind "
                  "data.ChatTemplate.* yourself")
  report = f"chat template of {hf_dir} → data.ChatTemplate in {GIN_FILE}" + (f" ({note})" if note else "")
  return gin_bindings(template, os.path.abspath(hf_dir), note), report
