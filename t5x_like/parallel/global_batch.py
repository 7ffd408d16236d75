"""Host numpy batch → global jax.Array with the batch sharding (each process supplies its own rows)."""

from typing import Callable, Mapping

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


def process_rows(make_stream: Callable[..., "tf.data.Dataset"], *, num_streams: int, global_batch_size: int,
                 process_index: int, process_count: int) -> "tf.data.Dataset":
  """This process's rows of each global batch, drawn from `num_streams` independent data streams.

  Stream s reads the data shards dealt to reader s of `num_streams` and supplies rows
  [s·B/S, (s+1)·B/S) of every global batch. Process p owns streams [p·S/P, (p+1)·S/P), and
  `to_global` stacks processes in order, so the global batch depends on S only: 1 process × 4 devices
  and 2 processes × 2 devices train on identical batches when they use the same S.

  Args:
    make_stream: (stream_index, num_streams, batch_size) → tf.data.Dataset of row dicts.
    num_streams: S, a multiple of the process count that divides the global batch.
    global_batch_size: B, rows per global batch.
    process_index, process_count: this process, of P.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  if num_streams % process_count:
    raise ValueError(f"data streams={num_streams} is not a multiple of the {process_count} processes "
                     f"(TrainConfig.data_streams)")
  if global_batch_size % num_streams:
    raise ValueError(f"BATCH_SIZE={global_batch_size} is not divisible by {num_streams} data streams "
                     f"(TrainConfig.data_streams)")
  per_process = num_streams // process_count
  rows = global_batch_size // num_streams
  streams = [make_stream(stream_index=s, num_streams=num_streams, batch_size=rows)
             for s in range(process_index * per_process, (process_index + 1) * per_process)]
  if len(streams) == 1:
    return streams[0]
  return tf.data.Dataset.zip(tuple(streams)).map(
      lambda *parts: {key: tf.concat([part[key] for part in parts], axis=0) for key in parts[0]})
