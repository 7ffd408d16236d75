"""Host numpy batch → global jax.Array with the batch sharding (each process supplies its own rows)."""

from typing import Mapping

import jax
import numpy as np


def to_global(local_batch: Mapping[str, np.ndarray], sharding: jax.sharding.NamedSharding) -> dict:
  """Assembles per-process rows into global arrays; rows are stacked in process order.

  With P processes each holding (B/P, L), the result is (B, L) sharded by `sharding`.
  """
  return {key: jax.make_array_from_process_local_data(sharding, np.asarray(value))
          for key, value in local_batch.items()}


def tf_to_numpy(batch) -> dict:
  """tf.Tensor dict → numpy dict without copies where TF allows it."""
  return {key: value._numpy() if hasattr(value, "_numpy") else np.asarray(value)  # pylint: disable=protected-access
          for key, value in batch.items()}
