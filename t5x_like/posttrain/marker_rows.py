"""Marker rows (lora.LoraConfig.marker_rows): the chat template's marker-token rows of the token embedding and an
untied lm_head, trained beside LoRA's adapters as zero-initialised deltas (PEFT's trainable_token_indices).

In an adapter tree they sit under their table's path: {'token_embedding': {'marker_rows': (n, D)}, 'lm_head':
{'kernel': {'marker_rows': (D, n)}}}; `add` puts them onto rows (columns of lm_head/kernel) `marker_ids`.
"""

from typing import Any, Dict, Mapping, Tuple

import flax
import flax.linen as nn
import jax.numpy as jnp

from t5x_like.parallel import axis_names as ax
from t5x_like.training.trainable import path_name

MARKERS = "marker_rows"  # the marker rows' delta under its table's path (token_embedding, lm_head/kernel)
TABLES = (("token_embedding",), ("lm_head", "kernel"))  # tables with a row (or column) per token

Params = Dict[str, Any]


def _names(leaf) -> tuple:
  return tuple(leaf.names) if isinstance(leaf, nn.LogicallyPartitioned) else (None,) * len(leaf.shape)


def tables(boxed_params: Params) -> Dict[Tuple[str, ...], Any]:
  """{table path: its boxed abstract value} of the model's tables with a row per token (TABLES)."""
  flat = flax.traverse_util.flatten_dict(boxed_params)
  return {path: flat[path] for path in TABLES if path in flat}


def _vocab_axis(names: tuple, path: Tuple[str, ...]) -> int:
  if ax.VOCAB not in names:
    raise ValueError(f"'{path_name(path)}' has no vocabulary axis (logical axes {names}): no marker rows")
  return names.index(ax.VOCAB)


def init(table_leaves: Mapping[Tuple[str, ...], Any], count: int) -> Params:
  """Boxed zero deltas of `count` marker rows for each table (from `tables`): the vocabulary axis
  becomes `count` (unsharded), the other axes keep their names."""
  out = {}
  for path, leaf in table_leaves.items():
    names, shape = _names(leaf), tuple((leaf.value if isinstance(leaf, nn.LogicallyPartitioned) else leaf).shape)
    axis = _vocab_axis(names, path)
    out[path + (MARKERS,)] = nn.LogicallyPartitioned(
        jnp.zeros(shape[:axis] + (count,) + shape[axis + 1:], jnp.float32), names[:axis] + (None,) + names[axis + 1:])
  return flax.traverse_util.unflatten_dict(out)


def deltas(adapters: Params) -> Dict[Tuple[str, ...], Any]:
  """{table path: marker-row delta} of an adapter tree."""
  return {path[:-1]: leaf for path, leaf in flax.traverse_util.flatten_dict(adapters or {}).items()
          if path[-1] == MARKERS}


def add(params: Params, adapters: Params, marker_ids: tuple) -> Params:
  """`params` with each marker delta added to its table's rows (columns of lm_head/kernel) `marker_ids`.

  Raises:
    ValueError: deltas without ids, a count that differs from the ids', or a table the model lacks.
  """
  found = deltas(adapters)
  if not found:
    return params
  flat = flax.traverse_util.flatten_dict(params)
  ids = jnp.asarray(marker_ids, jnp.int32)
  for path, delta in found.items():
    if path not in flat:
      raise ValueError(f"marker rows for '{path_name(path)}', which the base model does not have")
    w = flat[path]
    axis = 1 if path[0] == "lm_head" else 0
    if delta.shape[axis] != len(marker_ids):
      raise ValueError(f"'{path_name(path)}': {delta.shape[axis]} marker rows stored for {len(marker_ids)} marker "
                       f"token ids {tuple(marker_ids)} (LoRA metadata lora.marker_ids)")
    index = (slice(None),) * axis + (ids,)
    flat[path] = jnp.asarray(w).at[index].add(jnp.asarray(delta, w.dtype))
  return flax.traverse_util.unflatten_dict(flat)
