"""Text → tokens → TFRecord shards (preprocessing) and shards → batches (the tf.data pipeline).

`DataConfig` (gin: `data.DataConfig`) says how a run reads its batches; it lives here, at the package's root.
"""

import dataclasses
from typing import Mapping, Optional


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """How the training and evaluation batches are read."""
  shuffle_buffer: int = 1024  # rows permuted together in the training stream
  # An ordered DATA_DIR (preprocess --order_by) is read in its easy-to-hard order, never shuffled across
  # it (shuffle_buffer does not apply): rows are permuted only within blocks of this many; 0 = strict order.
  order_window: int = 0
  # Readers the global batch is drawn from. The batches depend on this number only, never on the
  # process count: 1 (default) → identical batches on any number of hosts, each host reading the
  # whole stream and keeping its rows; a multiple of the host count (e.g. 32) → each host reads only
  # its own streams. 0 = one stream per process (batches then change with the process count).
  data_streams: int = 1
  eval_batches: int = 0  # validation batches per evaluation; 0 = the whole validation split
  # A weighted mixture of DATA_DIRs read instead of DATA_DIR, e.g. {'/data/web': 0.8, '/data/code': 0.2}
  # (weights normalised; every source preprocessed with one tokenizer); None = DATA_DIR alone. Each batch
  # holds each source's share of rows, give or take one (data/mixture.py); eval reports each source's loss.
  mixture: Optional[Mapping[str, float]] = None
  # Weights that change during training instead: ((first step, {DATA_DIR: weight}), ...), from step 0, the
  # first stage naming every DATA_DIR (weight 0 allowed).
  mixture_stages: tuple = ()
  report_unigram_baseline: bool = False  # with the final eval, log the context-free unigram loss to beat
