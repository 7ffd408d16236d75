"""Host numpy batch → global jax.Array with the batch sharding (each process supplies its own rows)."""

from typing import Callable, Mapping

import jax
import numpy as np
import tensorflow as tf

# tf.data functions traced as written, without AutoGraph's rewrite (data/input_pipeline.graph_fn says why)
_graph_fn = tf.autograph.experimental.do_not_convert


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
  [s·B/S, (s+1)·B/S) of every global batch; process p keeps rows [p·B/P, (p+1)·B/P) and `to_global`
  stacks processes in order. So the global batch depends on S alone: 1 process × 4 devices and
  2 processes × 2 devices train on identical batches with the same S. When P divides S each process
  reads only its own S/P streams; otherwise (e.g. S = 1) it reads every stream its rows fall in and
  keeps its slice: the same batches, at the cost of reading more than its share.

  Args:
    make_stream: (stream_index, num_streams, batch_size) → tf.data.Dataset of row dicts.
    num_streams: S, dividing the global batch (DataConfig.data_streams).
    global_batch_size: B, rows per global batch; divisible by P.
    process_index, process_count: this process, of P.
  """
  if global_batch_size % num_streams:
    raise ValueError(f"BATCH_SIZE={global_batch_size} is not divisible by {num_streams} data streams "
                     f"(DataConfig.data_streams)")
  if global_batch_size % process_count:
    raise ValueError(f"BATCH_SIZE={global_batch_size} is not divisible by {process_count} processes")
  per_stream = global_batch_size // num_streams
  lo = process_index * (global_batch_size // process_count)
  hi = lo + global_batch_size // process_count
  first, last = lo // per_stream, (hi - 1) // per_stream  # the streams holding rows lo..hi-1
  streams = [make_stream(stream_index=s, num_streams=num_streams, batch_size=per_stream)
             for s in range(first, last + 1)]
  ds = streams[0] if len(streams) == 1 else tf.data.Dataset.zip(tuple(streams)).map(_graph_fn(
      lambda *parts: {key: tf.concat([part[key] for part in parts], axis=0) for key in parts[0]}))
  start, stop = lo - first * per_stream, hi - first * per_stream
  if (start, stop) == (0, per_stream * len(streams)):
    return ds
  return keep_rows(ds, start, stop)


def keep_rows(ds: "tf.data.Dataset", start: int, stop: int) -> "tf.data.Dataset":
  """Rows [start, stop) of every batch of `ds` (dicts of arrays batched on axis 0)."""
  return ds.map(_graph_fn(lambda batch: {key: value[start:stop] for key, value in batch.items()}))
