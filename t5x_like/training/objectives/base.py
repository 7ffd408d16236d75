"""The objective seam: the interface every training objective implements."""

from typing import Any, Dict, Mapping, Protocol, Tuple

import jax

Batch = Mapping[str, jax.Array]
Frozen = Mapping[str, Any]  # name → parameter tree of a frozen model (reference, teacher); no optimizer state


class Objective(Protocol):
  """A loss over one (micro)batch, as sums so accumulation over microbatches is exact.

  `loss` returns (Σ loss, Σ weight, {name: Σ value}); the step reports loss = Σ loss / Σ weight and
  each metric as its sum over the step's microbatches divided by Σ weight. `features` names the batch
  keys it reads (each a (B, L) array, B on the batch mesh axes), so the step shards exactly those.
  """
  features: Tuple[str, ...]

  def loss(self, params: Any, batch: Batch, frozen: Frozen) -> Tuple[jax.Array, jax.Array, Dict[str, jax.Array]]:
    ...
