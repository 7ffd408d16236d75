"""Optional Prometheus endpoint (extra `t5x_like[prometheus]`): each log step's figures as gauges at http://HOST:PORT/metrics."""

import threading
from typing import Mapping

from absl import logging

try:
  import prometheus_client
  from prometheus_client.core import GaugeMetricFamily
except ImportError:  # optional: only a run that asks for a Prometheus port needs it
  prometheus_client = None

# gauge name → (help text, key in the logged scalars). Names follow Prometheus conventions (base units).
GAUGES = {
    "t5x_like_step": ("Last completed optimizer step.", "step"),
    "t5x_like_train_steps": ("Optimizer steps the run trains to (TRAIN_STEPS).", "train_steps"),
    "t5x_like_loss": ("Training loss, token mean over the last log interval.", "loss"),
    "t5x_like_learning_rate": ("Learning rate of the last step.", "lr"),
    "t5x_like_grad_norm": ("Gradient global norm, mean over the last log interval.", "grad_norm"),
    "t5x_like_tokens_per_second": ("Global training throughput (tokens/s).", "tokens_per_sec"),
    "t5x_like_tokens_per_second_per_device": ("Training throughput per device (tokens/s).",
                                              "tokens_per_sec_per_device"),
    "t5x_like_step_seconds": ("Wall time per optimizer step.", "step_seconds"),
    "t5x_like_data_wait_seconds": ("Time per step waiting for the input pipeline.", "data_wait_seconds"),
    "t5x_like_compute_seconds": ("Time per step not waiting for data.", "compute_seconds"),
    "t5x_like_data_queue_depth": ("Batches ready in the input pipeline's prefetch buffer.",
                                  "data_queue_depth"),
    "t5x_like_mfu_ratio": ("Model FLOPs utilisation (0..1, PaLM appendix-B FLOPs).", "mfu"),
    "t5x_like_device_memory_bytes": ("Device memory in use (largest local device).",
                                     "memory/device_bytes_in_use"),
    "t5x_like_device_memory_peak_bytes": ("Peak device memory (largest local device).",
                                          "memory/device_peak_bytes"),
    "t5x_like_host_rss_bytes": ("Host resident set size of the training process.", "memory/host_rss_bytes"),
    "t5x_like_nonfinite_steps_total": ("Steps skipped for a non-finite loss or gradient since launch.",
                                       "nonfinite_steps_total"),
    "t5x_like_compile_seconds": ("Trace + compile + first run of the train step.", "compile_seconds"),
    "t5x_like_moe_load_balancing_loss": ("MoE load-balancing loss (1 = balanced), mean over MoE layers.",
                                         "moe/load_balancing_loss"),
    "t5x_like_moe_router_z_loss": ("MoE router z-loss, mean over MoE layers.", "moe/router_z_loss"),
    "t5x_like_moe_dropped_ratio": ("Share of (token, expert) assignments dropped at capacity (0..1).",
                                   "moe/dropped_fraction"),
    "t5x_like_moe_expert_load_min_ratio": ("Least-loaded expert's share × num_experts (1 = balanced).",
                                           "moe/expert_load_min"),
    "t5x_like_moe_expert_load_max_ratio": ("Most-loaded expert's share × num_experts (1 = balanced).",
                                           "moe/expert_load_max"),
    "t5x_like_eval_loss": ("Validation loss of the last evaluation.", "eval/loss"),
    "t5x_like_eval_perplexity": ("Validation perplexity of the last evaluation.", "eval/perplexity"),
}


class PrometheusExporter:
  """Serves the latest logged scalars as gauges; its own registry, so several can coexist in a process.

  A scrape sees one consistent snapshot: all gauges as of the same `update` call.

  Args:
    port: TCP port to listen on (0 picks a free one; see `.port`).
    host: address to bind; 127.0.0.1 keeps the endpoint private to the machine.
  """

  def __init__(self, port: int, host: str = "127.0.0.1"):
    if prometheus_client is None:
      raise ImportError(f"observe.ObserveConfig.prometheus_port={port} needs prometheus_client: "
                        "pip install 't5x_like[prometheus]' (or set prometheus_port = 0)")
    self._lock = threading.Lock()
    self._values = {}
    self.registry = prometheus_client.CollectorRegistry()
    self.registry.register(self)
    try:
      self._server, self._thread = prometheus_client.start_http_server(port, addr=host,
                                                                       registry=self.registry)
    except OSError as e:
      raise OSError(f"cannot serve Prometheus metrics on {host}:{port} "
                    f"(ObserveConfig.prometheus_port / prometheus_host): {e}") from e
    self.host, self.port = host, self._server.server_port
    logging.info("Prometheus metrics at http://%s:%d/metrics", host, self.port)

  def update(self, scalars: Mapping[str, float], **more: float) -> None:
    """Sets the gauges whose keys appear in `scalars` or `more` (e.g. step=, train_steps=)."""
    values = {**scalars, **more}
    fresh = {name: float(values[key]) for name, (_, key) in GAUGES.items()
             if isinstance(values.get(key), (int, float))}
    with self._lock:
      self._values = {**self._values, **fresh}

  def collect(self):
    """prometheus_client Collector protocol: one gauge family per figure seen so far."""
    with self._lock:
      values = dict(self._values)
    for name, value in values.items():
      yield GaugeMetricFamily(name, GAUGES[name][0], value=value)

  def close(self) -> None:
    self._server.shutdown()
    self._server.server_close()


class _Off:
  def update(self, scalars, **more) -> None:
    pass

  def close(self) -> None:
    pass


def start(port: int, host: str = "127.0.0.1", is_primary: bool = True):
  """An exporter on the primary process when `port` > 0, else one whose methods do nothing."""
  if port <= 0 or not is_primary:
    return _Off()
  return PrometheusExporter(port, host)
