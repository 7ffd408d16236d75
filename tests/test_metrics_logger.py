"""The metric sinks every run writes (the log line, TensorBoard's event files, metrics.jsonl), and the start-up
that keeps Keras out of every entry point."""

import json
import logging
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from t5x_like.observe import metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _event_scalars(model_dir) -> dict:
  """{(step, tag): value} of the event files, each value a scalar tensor that TensorBoard's Scalars dashboard
  shows (the scalars plugin's metadata, as tf.summary.scalar writes it)."""
  out = {}
  for path in tf.io.gfile.glob(os.path.join(model_dir, "events.out.tfevents*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        assert value.metadata.plugin_data.plugin_name == "scalars", value
        assert value.tensor.dtype == tf.float32.as_datatype_enum and not value.tensor.tensor_shape.dim, value
        out[(event.step, value.tag)] = float(tf.make_ndarray(value.tensor))
  return out


def test_one_write_reaches_the_log_the_event_file_and_metrics_jsonl(tmp_path, caplog):
  """Sorted keys, floats to 6 significant digits in the log; the same numbers in TensorBoard; full precision and
  the strings in metrics.jsonl. Another process (is_primary=False) logs the line and writes no file."""
  primary, other = tmp_path / "primary", tmp_path / "other"
  primary.mkdir()
  other.mkdir()
  scalars = {"loss": np.float32(2.123456789), "eval/tokens": 128, "bad": float("nan"), "note": "text"}
  with caplog.at_level(logging.INFO):
    for model_dir, is_primary in ((primary, True), (other, False)):
      logger = metrics.MetricsLogger(str(model_dir), is_primary=is_primary)
      logger.write(3, scalars)
      logger.write(4, {"loss": 1.5})
      logger.flush()
      logger.close()
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[")]
  assert lines == ["[3] bad=nan, eval/tokens=128, loss=2.12346", "[4] loss=1.5"] * 2
  events = _event_scalars(str(primary))
  assert sorted(events) == [(3, "bad"), (3, "eval/tokens"), (3, "loss"), (4, "loss")]
  assert events[(3, "loss")] == np.float32(2.123456789) and events[(3, "eval/tokens")] == 128
  assert math.isnan(events[(3, "bad")]) and events[(4, "loss")] == 1.5
  records = [json.loads(line) for line in (primary / "metrics.jsonl").read_text().splitlines()]
  assert records == [{"step": 3, "loss": float(np.float32(2.123456789)), "eval/tokens": 128, "bad": "nan",
                      "note": "text"}, {"step": 4, "loss": 1.5}]
  assert os.listdir(other) == []


@pytest.mark.slow  # Python processes of its own
def test_entry_points_import_tensorflow_without_keras_and_keras_still_imports_after():
  """TF's __init__ imports Keras (and scikit-learn) eagerly but optionally; the package hides it for that import
  (t5x_like/__init__.py), and nothing an entry point imports loads it. `import keras` and tf.keras work later."""
  script = ("import sys\n"
            "from t5x_like import cli, train, infer, serve, preprocess  # (evaluate defines the flags train does)\n"
            "import tensorflow as tf\n"
            "print(sorted(m for m in ('keras', 'sklearn', 'clu') if m in sys.modules))\n"
            "import keras\n"
            "print(tf.keras.layers.Dense.__name__, 'keras' in sys.modules)\n")
  out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.splitlines() == ["[]", "Dense True"]
