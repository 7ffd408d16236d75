"""Knowledge distillation: temperature-scaled KL to a frozen teacher's next-token distribution, mixed with the
data's cross-entropy (Hinton et al. 2015), on the data's weighted tokens.

Per position with weight w, with p_T = softmax(logits / T) of the teacher and q_T of the student:

  loss = α · T² · KL(p_T ‖ q_T) + (1 − α) · CE(targets, q_1)

summed as w · loss over the batch (the step divides by Σ w). The T² keeps the KL gradients' scale
independent of T. Metrics: kl (Σ w·KL(p_T ‖ q_T)) and cross_entropy (Σ w·CE), per token after the step's
division. With `loss_chunk` both models' hidden states are projected to logits chunk by chunk (and again
in the backward pass), so the largest live logits are two (B, chunk, V) float32 blocks, never (B, L, V).

The teacher may be larger (another GPTConfig, read from its MODEL_DIR's model.gin or config.gin by
`saved_model_config`) but must share the vocabulary.
"""

import ast
import dataclasses
import re
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import tensorflow as tf

from t5x_like.model import decoder as model_lib
from t5x_like.training import checkpointing
from t5x_like.training import logprobs
from t5x_like.training.objectives import language_model

TEACHER = "teacher"  # the frozen teacher's key in `frozen`
MODEL_CONFIG_FILES = ("model.gin", "config.gin")  # a converted checkpoint's model.gin, a run's operative config
# GPTConfig fields that fix execution, not the function: taken from this run's config, never the teacher's file.
EXECUTION_FIELDS = ("dtype", "remat_policy", "scan_unroll", "attention_impl", "num_stages",
                    "pipeline_microbatches", "pipeline_repeats", "blocks_in_stage_order")
# Former GPTConfig fields an older run's config.gin may still bind: skipped (the score head is model/heads.py's
# ScoredGPT, LoRA dropout is posttrain/lora.py's).
RETIRED_FIELDS = ("score_head", "lora_dropout")
_BINDING = re.compile(r"^(?:[\w.]+\.)?GPTConfig\.(\w+)\s*=\s*(.+)$")
_MACRO = re.compile(r"^([A-Z][A-Z0-9_]*)\s*=\s*(.+)$")


def kl_ce_sums(student_logits: jax.Array, teacher_logits: jax.Array, targets: jax.Array, weights: jax.Array,
               temperature: float):
  """(Σ w·KL(p_T ‖ q_T), Σ w·CE, Σ w), float32; logits (B, L, V), possibly vocab-sharded.

  Vocabulary padding rows (float32 minimum logits, probability 0 for both) add nothing to the KL.
  """
  student, teacher = student_logits.astype(jnp.float32), teacher_logits.astype(jnp.float32)
  ce_sum, weight_sum = language_model.cross_entropy_sums(student, targets, weights)
  log_q = jax.nn.log_softmax(student / temperature, axis=-1)
  log_p = jax.nn.log_softmax(teacher / temperature, axis=-1)
  p = jnp.exp(log_p)
  kl = jnp.sum(p * jnp.where(p > 0, log_p - log_q, 0.0), axis=-1)  # (B, L)
  return jnp.sum(kl * weights.astype(jnp.float32)), ce_sum, weight_sum


def chunked_kl_ce_sums(student_logits_fn: Callable, teacher_logits_fn: Callable, hidden: jax.Array,
                       teacher_hidden: jax.Array, targets: jax.Array, weights: jax.Array, chunk: int,
                       temperature: float):
  """kl_ce_sums over chunks of `chunk` positions: each chunk's student and teacher logits are made from the
  hidden states (B, L, D) and (B, L, D_teacher), reduced and dropped, and recomputed in the backward pass.
  L % chunk == 0."""

  @jax.checkpoint
  def one(h, th, t, w):
    return kl_ce_sums(student_logits_fn(h), teacher_logits_fn(th), t, w, temperature)

  return logprobs.chunked_sums(one, chunk, hidden, teacher_hidden, targets, weights)


@dataclasses.dataclass(frozen=True)
class Distill:
  """α·T²·KL(teacher_T ‖ student_T) + (1 − α)·CE (see the module docstring).

  Attributes:
    apply_fn: the student decoder's `apply` ({'params': p}, tokens, positions, segment_ids[, return_hidden]).
    logits_fn: (student params, hidden) → logits (decoder.project_logits with the student's config).
    teacher_apply_fn, teacher_logits_fn: the same for the teacher (its own GPTConfig).
    alpha: α, the KL's share of the loss (1 = pure distillation, 0 = plain cross-entropy).
    temperature: T > 0, applied to both models' logits in the KL term.
    loss_chunk: > 0: the chunked loss over this many positions at a time (never the full (B, L, V) logits).
    moe: the student has experts: its auxiliary losses are added, token-weighted like the cross-entropy.
  """
  apply_fn: Callable
  logits_fn: Callable
  teacher_apply_fn: Callable
  teacher_logits_fn: Callable
  alpha: float = 0.5
  temperature: float = 2.0
  loss_chunk: int = 0
  moe: bool = False
  features: tuple = language_model.FEATURES

  def __post_init__(self):
    if not 0.0 <= self.alpha <= 1.0:
      raise ValueError(f"DistillConfig.alpha must be in [0, 1], got {self.alpha}")
    if self.temperature <= 0:
      raise ValueError(f"DistillConfig.temperature must be > 0, got {self.temperature}")

  def loss(self, params, batch, frozen):
    if TEACHER not in frozen:
      raise ValueError(f"distillation needs the frozen model '{TEACHER}' (TEACHER_CHECKPOINT_PATH)")
    teacher = jax.lax.stop_gradient(frozen[TEACHER])
    args = (batch["inputs"], batch["positions"], batch["segment_ids"])
    student = lambda **kw: language_model.forward(self.apply_fn, params, batch, moe=self.moe, **kw)
    if self.loss_chunk and batch["inputs"].shape[1] > self.loss_chunk:
      hidden, state = student(return_hidden=True)
      teacher_hidden = self.teacher_apply_fn({"params": teacher}, *args, return_hidden=True)
      kl, ce, weight_sum = chunked_kl_ce_sums(
          lambda h: self.logits_fn(params, h), lambda h: self.teacher_logits_fn(teacher, h), hidden,
          teacher_hidden, batch["targets"], batch["weights"], self.loss_chunk, self.temperature)
    else:
      logits, state = student()
      teacher_logits = self.teacher_apply_fn({"params": teacher}, *args)
      kl, ce, weight_sum = kl_ce_sums(logits, teacher_logits, batch["targets"], batch["weights"], self.temperature)
    loss = self.alpha * self.temperature ** 2 * kl + (1.0 - self.alpha) * ce
    aux, moe_metrics = language_model.moe_terms(state, batch["weights"], weight_sum)
    return loss + aux, weight_sum, {"kl": kl, "cross_entropy": ce, **moe_metrics}


def _literal(text: str, macros: dict, where: str):
  text = text.strip()
  for candidate in (text, text.split(" #", 1)[0].strip()):
    if candidate.startswith("%") and candidate[1:] in macros:
      return macros[candidate[1:]]
    try:
      return ast.literal_eval(candidate)
    except (ValueError, SyntaxError):
      continue
  raise ValueError(f"{where}: cannot read the value {text!r}")


def saved_model_config(path: str, run_config: model_lib.GPTConfig, key: str = "TEACHER_CHECKPOINT_PATH"):
  """The GPTConfig a MODEL_DIR (or a `checkpoints/<step>` inside one) was written with, and the file read.

  Reads MODEL_DIR/model.gin (a converted checkpoint), else MODEL_DIR/config.gin (a run's operative config):
  its `model.GPTConfig.<field> = value` lines (macros resolved); fields it leaves out keep GPTConfig's
  defaults, and the execution fields (EXECUTION_FIELDS) come from `run_config`. A vocabulary of 0 (taken from
  a DATA_DIR at training time) is read from the checkpoint's token_embedding rows.

  Raises:
    ValueError / FileNotFoundError: one line naming `key`, the path or file:line.
  """
  step_dir = checkpointing.resolve_checkpoint(path)[1]
  model_dir = str(step_dir).rsplit("/checkpoints/", 1)[0]
  found = [f"{model_dir}/{name}" for name in MODEL_CONFIG_FILES if tf.io.gfile.exists(f"{model_dir}/{name}")]
  fields, macros, source = {}, {}, None
  names = {f.name for f in dataclasses.fields(model_lib.GPTConfig)}
  for file in found:
    with tf.io.gfile.GFile(file) as f:
      lines = f.read().splitlines()
    for number, line in enumerate(lines, 1):
      line = line.strip()
      macro, binding = _MACRO.match(line), _BINDING.match(line)
      if macro:
        macros[macro.group(1)] = _literal(macro.group(2), {}, f"{file}:{number}")
      elif binding and binding.group(1) not in RETIRED_FIELDS:
        if binding.group(1) not in names:
          raise ValueError(f"{file}:{number}: GPTConfig has no field {binding.group(1)!r}")
        fields[binding.group(1)] = (binding.group(2), f"{file}:{number}")
    if fields:
      source = file
      break
  if not fields:
    raise FileNotFoundError(f"{key} {path}: no model config in {model_dir} (expected {' or '.join(MODEL_CONFIG_FILES)} "
                            "with model.GPTConfig bindings, as a run or `python -m t5x_like.convert` writes)")
  values = {name: _literal(text, macros, where) for name, (text, where) in fields.items()
            if name not in EXECUTION_FIELDS}
  config = dataclasses.replace(model_lib.GPTConfig(**values),
                               **{name: getattr(run_config, name) for name in EXECUTION_FIELDS})
  if not config.vocab_size:
    saved = checkpointing.state_tree_metadata(str(step_dir))["params"]
    config = dataclasses.replace(config, vocab_size=int(saved["token_embedding"].shape[0]))
  return config, source


def check_teacher_config(teacher: model_lib.GPTConfig, student: model_lib.GPTConfig, source: str,
                         key: str = "TEACHER_CHECKPOINT_PATH") -> Optional[str]:
  """A one-line error when the teacher cannot teach this student: another vocabulary, or a model config
  that does not validate (e.g. layers not divisible by this mesh's pipeline stages)."""
  for field in ("vocab_size", "valid_vocab_size"):
    if getattr(teacher, field) != getattr(student, field):
      raise ValueError(f"{key}: the teacher's GPTConfig.{field}={getattr(teacher, field)} ({source}) differs from "
                       f"this run's {getattr(student, field)}: distillation needs the same tokenizer")
  try:
    teacher.validate()
  except ValueError as e:
    raise ValueError(f"{key}: the teacher's model config ({source}): {e}") from None
