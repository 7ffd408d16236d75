"""Metric writers, FLOPs/MFU, Prometheus, profiling, plots; `ObserveConfig` (gin: `observe.ObserveConfig`)."""

import dataclasses
from typing import Optional

from t5x_like.observe import trackers


@dataclasses.dataclass(frozen=True)
class ObserveConfig:
  """Live figures and traces beyond metrics.jsonl / TensorBoard."""
  prometheus_port: int = 0  # serve the logged figures at http://prometheus_host:PORT/metrics; 0 = off
  prometheus_host: str = "127.0.0.1"  # address the Prometheus endpoint binds; '0.0.0.0' exposes it
  profile_steps: Optional[tuple] = None  # (first, last): jax.profiler trace of these steps to MODEL_DIR/profile
  trackers: tuple = ("tensorboard",)  # also 'mlflow' (MODEL_DIR/mlruns or tracking_uri), 'wandb' (offline unless logged in)
  tracking_uri: str = ""  # MLflow server or database, e.g. 'http://host:5000'; '' = MODEL_DIR/mlruns
  experiment: str = ""  # MLflow experiment / W&B project grouping runs ('' = t5x_like; a sweep sets its folder's name)

  def __post_init__(self):
    trackers.validate(self.trackers)
