"""Trainable masks: which parameter leaves train; the rest are frozen, with no optimizer state or gradients.

A mask is chosen by a regular expression over parameter paths written 'blocks/attn/qkv/kernel'
(`re.fullmatch`), e.g. '.*' (everything), 'blocks/attn/.*' (attention only), '.*lora.*' (adapters).
The optimizer only ever sees `trainable_part(params)`, a params-shaped dict holding the trainable
leaves alone, so frozen leaves get no AdamW moments and no gradient buffers.
"""

import re
from typing import Any, Dict

import flax
import jax

Params = Dict[str, Any]


def path_name(path) -> str:
  """'blocks/attn/qkv/kernel' for a parameter path: a flatten_dict key ('blocks', 'attn', 'qkv', 'kernel') or
  a jax key path (jax.tree_util.tree_flatten_with_path)."""
  return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def _flat(params: Params) -> dict:
  return flax.traverse_util.flatten_dict(params)


def trainable_paths(params: Params, pattern: str) -> frozenset:
  """The paths (tuples) of the leaves whose name fully matches `pattern`.

  Raises:
    ValueError: `pattern` is not a regular expression, or matches no parameter (a typo would
      otherwise freeze the whole model silently).
  """
  try:
    regex = re.compile(pattern)
  except re.error as e:
    raise ValueError(f"TrainConfig.trainable={pattern!r} is not a regular expression: {e}") from None
  flat = _flat(params)
  chosen = frozenset(path for path in flat if regex.fullmatch(path_name(path)))
  if not chosen:
    examples = ", ".join(sorted(path_name(p) for p in flat)[:6])
    raise ValueError(f"TrainConfig.trainable={pattern!r} matches no parameter (paths look like: {examples}, ...)")
  return chosen


def trainable_part(params: Params, paths: frozenset) -> Params:
  """The params tree holding only the leaves at `paths` (everything when `paths` covers all leaves)."""
  flat = _flat(params)
  if len(paths) == len(flat):
    return params
  return flax.traverse_util.unflatten_dict({p: v for p, v in flat.items() if p in paths})


def merge(params: Params, trainable: Params) -> Params:
  """`params` with the leaves of `trainable` (a `trainable_part` of it) replaced."""
  flat_trainable = _flat(trainable)
  flat = _flat(params)
  if len(flat_trainable) == len(flat):
    return trainable
  return flax.traverse_util.unflatten_dict({**flat, **flat_trainable})
