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
  # lm-eval tasks run on the current parameters during training (evaluation/in_loop.py), logged as
  # tasks/<task>/<metric>: names from task_dir ('' = the shipped configs/tasks) or lm-eval's own; () = none
  tasks: tuple = ()
  task_every: int = 0  # steps between task evaluations; 0 = only at the end
  task_dir: str = ""  # a folder of lm-eval task YAMLs over local data files
  task_limit: int = 0  # documents per task; 0 = all
  task_batch_size: int = 8  # rows per scoring pass

  def __post_init__(self):
    trackers.validate(self.trackers)
    for key in ("task_every", "task_limit"):
      if getattr(self, key) < 0:
        raise ValueError(f"ObserveConfig.{key} must be >= 0, got {getattr(self, key)}")
    if isinstance(self.tasks, str):
      raise ValueError(f"ObserveConfig.tasks must be a tuple of task names, e.g. ('{self.tasks}',), got a string")
