"""Conversations in, assistant turns out: the generation of `infer --chat` and the scores of `evaluate --generate`.

A prompt file holds one JSON object a line, in the shapes `preprocess --format=chat` reads
({"messages": [...]} or {"prompt": ..., "completion": ...}); here the assistant turn may be missing. A
line's prompt is its turns before the last assistant turn when the conversation ends with one (that
turn is the reference: the same file serves training, sampling and scoring), else all of its turns.
The prompt is rendered by the chat template exactly as preprocess renders it, then ends with the
assistant marker (`ChatEncoder.prompt_ids`); generation stops at the template's end marker (or EOS).
"""

import dataclasses
import json
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.data import chat
from t5x_like.data import packing
from t5x_like.inference import engine as engine_lib
from t5x_like.inference.sampling import SamplingParams
from t5x_like.observe import metrics as metrics_lib

MISMATCHES_KEPT = 5  # wrong answers quoted in an evaluation report


@dataclasses.dataclass(frozen=True)
class ChatLine:
  """One prompt-file line: where it is, its prompt turns and (when it has one) the reference answer."""
  where: str  # "file:line", named in errors
  messages: tuple  # ((role, content), ...): the turns the answer follows
  reference: Optional[str] = None  # the content of the conversation's final assistant turn


_PLACEHOLDER = {"role": "assistant", "content": "?"}  # a missing answer's stand-in while a prompt is validated


def parse_prompt(obj) -> tuple[list, Optional[str]]:
  """(prompt turns, reference or None) of one decoded JSON line.

  Accepts the conversation shapes of `chat.parse_conversation`, and also ones without an assistant turn:
  {"messages": [... ending with a user turn]} or {"prompt": ...} alone. When the turns end with an
  assistant turn, that turn is the reference and the turns before it are the prompt.

  Raises:
    chat.MalformedLine: wrong shape, unknown role, empty content (as `chat.parse_conversation`).
  """
  if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
    # validated with a placeholder answer appended (so a prompt without one passes the no-assistant check)
    turns = chat.parse_conversation(dict(obj, messages=obj["messages"] + [_PLACEHOLDER]))[:-1]
  elif isinstance(obj, dict) and "messages" not in obj and "prompt" in obj and "completion" not in obj:
    turns = chat.parse_conversation(dict(obj, completion=[_PLACEHOLDER]))[:-1]
  else:
    turns = chat.parse_conversation(obj)
  if turns and turns[-1][0] == "assistant":
    return turns[:-1], turns[-1][1]
  return turns, None


def read_chat_lines(path: str, *, require_reference: bool = False) -> list[ChatLine]:
  """Every non-blank line of the JSON-lines file `path`, in order.

  Raises:
    ValueError: one line naming `path:line` and what is wrong (bad JSON, wrong shape, unknown role,
      empty content; with `require_reference`, a line whose conversation does not end in an assistant
      turn), or a file without lines.
  """
  out = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{number}"
      try:
        obj = json.loads(line)
      except ValueError as e:
        raise ValueError(f"{where}: bad_json: {e}") from None
      try:
        messages, reference = parse_prompt(obj)
      except chat.MalformedLine as e:
        raise ValueError(f"{where}: {e}") from None
      if require_reference and reference is None:
        raise ValueError(f"{where}: no reference answer: the conversation must end with an assistant turn "
                         "(or have a 'completion') to score the generated one against")
      if not messages:
        raise ValueError(f"{where}: wrong_shape: no turn before the answer to prompt with")
      out.append(ChatLine(where, tuple(messages), reference))
  if not out:
    raise ValueError(f"{path}: no conversations (the file is empty)")
  return out


def template_for(manifest: Optional[dict], data_dir: str, bound: chat.ChatTemplate) -> chat.ChatTemplate:
  """The chat template to render with: the one a chat DATA_DIR was written with, else `bound` (gin's
  data.ChatTemplate).

  Raises:
    ValueError: `bound` is not the default and differs from the DATA_DIR's (the model was trained on the
      DATA_DIR's rendering), naming the differing fields.
  """
  if manifest is None or "chat_template" not in manifest:
    return bound
  written = chat.template_from_manifest(manifest)
  if bound not in (written, chat.ChatTemplate()):
    differ = {f.name: (getattr(bound, f.name), getattr(written, f.name)) for f in dataclasses.fields(bound)
              if getattr(bound, f.name) != getattr(written, f.name)}
    raise ValueError(f"data.ChatTemplate bindings differ from the template DATA_DIR '{data_dir}' was written with "
                     f"(field: (bound, written)) {differ}: drop the bindings or use another DATA_DIR")
  return written


def encoder_for(exp, bound: chat.ChatTemplate, tokenizer: Optional[str] = None) -> chat.ChatEncoder:
  """The chat encoder of an Experiment: its tokenizer (`tokenizer`, else DATA_DIR's) and `template_for`'s
  template (`bound`: gin's data.ChatTemplate)."""
  return chat.ChatEncoder(exp.load_tokenizer(tokenizer), template_for(exp.manifest, exp.config.data_dir, bound))


def encode_prompts(encoder: chat.ChatEncoder, lines: Sequence[ChatLine]) -> list[list[int]]:
  """Token ids of each line's prompt, ending with the assistant marker.

  Raises:
    ValueError: a content string holding a template marker, naming the line.
  """
  out = []
  for line in lines:
    try:
      out.append(encoder.prompt_ids(line.messages))
    except chat.MalformedLine as e:
      raise ValueError(f"{line.where}: {e}") from None
  return out


def check_fits(lines: Sequence[ChatLine], lengths: Sequence[int], extra: int, max_len: int, what: str) -> None:
  """A one-line error naming the longest line when its `lengths` + `extra` exceed the model's max_len."""
  longest = int(np.argmax(lengths))
  if lengths[longest] + extra > max_len:
    raise ValueError(f"{lines[longest].where}: {what} is {lengths[longest]} + {extra} = {lengths[longest] + extra} "
                     f"tokens, more than the model's max_len={max_len} (GPTConfig.max_len)")


def engine_for(params, config, batch_size: int, encoder: chat.ChatEncoder, seed: int = 0) -> engine_lib.Engine:
  """An Engine of `batch_size` slots over `params`, on the mesh and rules of the caller's context (enter the
  runtime's `context()` first)."""
  mesh = jax.sharding.get_mesh()
  if mesh.empty:
    raise ValueError("chat_eval: no mesh in context: call inside the runtime's context() (jax.set_mesh)")
  return engine_lib.Engine(config, params, mesh, nn.get_logical_axis_rules(), slots=batch_size,
                           detokenize=encoder.completion_text, pad_id=encoder.tokenizer.pad_id, seed=seed)


def generate(engine: engine_lib.Engine, encoder: chat.ChatEncoder, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0) -> list[str]:
  """The assistant text generated after each prompt by `engine` (continuous batching over its slots), stopped
  at the template's end marker or EOS. Prompt p samples with seed `seed`, stream p (inference/engine.py)."""
  sampling = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            stop_token_ids=(encoder.marker_ids["end"], encoder.tokenizer.eos_id))
  return [encoder.completion_text(c.tokens) for [c] in engine.generate(list(prompts), sampling, seed=seed)]


def reference_documents(encoder: chat.ChatEncoder, lines: Sequence[ChatLine]) -> list[tuple[np.ndarray, np.ndarray]]:
  """(ids, weights) of each line's prompt + reference, rendered as preprocess renders it, with the weights
  of the reference turn only (its content and end marker; earlier assistant turns are context here)."""
  docs = []
  for line in lines:
    try:
      doc = encoder.render(list(line.messages) + [("assistant", line.reference)])
    except chat.MalformedLine as e:
      raise ValueError(f"{line.where}: {e}") from None
    start = doc.turn_ends[-2] if len(doc.turn_ends) > 1 else 0  # where the reference turn begins
    weights = doc.weights.copy()
    weights[:start] = 0
    docs.append((doc.ids, weights))
  return docs


def reference_features(docs: Sequence[tuple[np.ndarray, np.ndarray]], length: int, pad_id: int) -> dict:
  """Teacher-forcing features of one document a row, as the input pipeline makes them (packing.row_features):
  the weight of predicting token i+1 is that token's stored weight. Returns (N, length) numpy arrays."""
  rows = np.stack([packing.pack_documents_np([doc], length + 1, pad_id)[0] if len(doc[0])
                   else packing.empty_row(length + 1, pad_id) for doc in docs])  # (N, 4, L+1); empty: padding
  tokens, segments = rows[:, packing.TOKENS], rows[:, packing.SEGMENTS]
  same_doc = (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] != 0)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments[:, :-1],
          "positions": rows[:, packing.POSITIONS, :-1],
          "weights": (same_doc * rows[:, packing.WEIGHTS, 1:]).astype(np.float32)}


def reference_loss(objective, params, docs: Sequence[tuple[np.ndarray, np.ndarray]], *, pad_id: int,
                   batch_size: int, loss_chunk: int = 0) -> tuple[float, float]:
  """(Σ weight·cross-entropy, Σ weight) of the documents under the language-model objective (without an
  MoE model's auxiliary losses), `batch_size` rows at a time; rows are as long as the longest
  document minus one, rounded up to a multiple of `loss_chunk`."""
  length = max(len(ids) for ids, _ in docs) - 1
  if loss_chunk and length > loss_chunk:
    length = -(-length // loss_chunk) * loss_chunk
  batch_size = max(1, min(batch_size, len(docs)))
  padded = list(docs) + [(np.zeros(0, np.int32), np.zeros(0, np.int32))] * (-len(docs) % batch_size)

  @jax.jit
  def sums(params, batch):
    loss_sum, weight_sum, metrics = objective.loss(params, batch, {})
    return metrics.get("cross_entropy", loss_sum), weight_sum

  loss_sum, weight_sum = 0.0, 0.0
  for start in range(0, len(padded), batch_size):
    batch = reference_features(padded[start:start + batch_size], length, pad_id)
    loss, weight = sums(params, {k: jnp.asarray(v) for k, v in batch.items()})
    loss_sum, weight_sum = loss_sum + float(loss), weight_sum + float(weight)
  return loss_sum, weight_sum


def exact_match(prediction: str, reference: str) -> bool:
  """The generated answer equals the reference once leading and trailing whitespace is stripped."""
  return prediction.strip() == reference.strip()


def evaluate(params, encoder: chat.ChatEncoder, lines: Sequence[ChatLine], *, objective, config,
             batch_size: int, max_new_tokens: Optional[int] = None, loss_chunk: int = 0) -> dict:
  """Greedy answers to every line scored against its reference, and the reference loss.

  Args:
    max_new_tokens: generation budget (default: the longest reference's tokens + 1, room for every
      reference and its end marker, so a right answer is never cut).

  Returns:
    {"generate/examples", "generate/exact_match" (fraction), "generate/exact_matches", "generate/loss"
    (token-weighted cross-entropy of the references' turns, teacher-forced), "generate/perplexity",
    "generate/tokens" (Σ weight), "generate/max_new_tokens", "generate/mismatches" (the first few
    {"where", "prediction", "reference"})}.
  """
  prompts = encode_prompts(encoder, lines)
  if max_new_tokens is None:
    max_new_tokens = max(len(encoder.tokenizer.encode(line.reference)) for line in lines) + 1
  check_fits(lines, [len(p) for p in prompts], max_new_tokens, config.max_len, "prompt + max_new_tokens")
  docs = reference_documents(encoder, lines)
  check_fits(lines, [len(ids) - 1 for ids, _ in docs], 0, config.max_len, "prompt + reference")
  predictions = generate(engine_for(params, config, batch_size, encoder), encoder, prompts,
                         max_new_tokens=max_new_tokens)
  matches = [exact_match(p, line.reference) for p, line in zip(predictions, lines)]
  loss_sum, weight_sum = reference_loss(objective, params, docs, pad_id=encoder.tokenizer.pad_id,
                                        batch_size=batch_size, loss_chunk=loss_chunk)
  loss = loss_sum / max(weight_sum, 1.0)
  mismatches = [{"where": line.where, "prediction": p, "reference": line.reference}
                for p, line, ok in zip(predictions, lines, matches) if not ok][:MISMATCHES_KEPT]
  return {"generate/examples": len(lines), "generate/exact_match": sum(matches) / len(lines),
          "generate/exact_matches": sum(matches), "generate/loss": loss,
          "generate/perplexity": metrics_lib.perplexity(loss), "generate/tokens": weight_sum,
          "generate/max_new_tokens": max_new_tokens, "generate/mismatches": mismatches}


def answered(line: ChatLine, text: str) -> dict:
  """The output JSON object of `infer --chat` for one line: {"messages": its prompt turns + the answer}."""
  return {"messages": [{"role": role, "content": content} for role, content in line.messages]
                      + [{"role": "assistant", "content": text}]}
