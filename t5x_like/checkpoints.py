"""orbax CheckpointManager over MODEL_DIR/checkpoints: train state, per-process data-iterator state, metadata."""

import dataclasses
import os
from typing import Any, Optional

from absl import logging
from etils import epath
import jax
import orbax.checkpoint as ocp
import tensorflow as tf

STATE, DATA_ITER, METADATA = "state", "data_iter", "metadata"


class DataIteratorHandler(ocp.CheckpointHandler):
  """Saves each process's tf.data iterator with tf.train.Checkpoint (exact position, shuffle buffer too)."""

  def save(self, directory: epath.Path, args: "DataIteratorSave") -> None:
    prefix = os.path.join(os.fspath(directory), f"process_{jax.process_index()}-of-{jax.process_count()}")
    tf.train.Checkpoint(iterator=args.iterator).write(prefix)

  def restore(self, directory: epath.Path, args: "DataIteratorRestore") -> Any:
    prefix = os.path.join(os.fspath(directory), f"process_{jax.process_index()}-of-{jax.process_count()}")
    if not tf.io.gfile.exists(prefix + ".index"):
      raise FileNotFoundError(f"no data-iterator state {prefix}.index (saved with another process count?)")
    tf.train.Checkpoint(iterator=args.iterator).read(prefix).assert_consumed()
    return args.iterator

  def structure(self, directory):  # pragma: no cover - orbax introspection hook
    return {}


@ocp.args.register_with_handler(DataIteratorHandler, for_save=True)
@dataclasses.dataclass
class DataIteratorSave(ocp.args.CheckpointArgs):
  iterator: Any


@ocp.args.register_with_handler(DataIteratorHandler, for_restore=True)
@dataclasses.dataclass
class DataIteratorRestore(ocp.args.CheckpointArgs):
  iterator: Any


def checkpoint_dir(model_dir: str) -> str:
  return os.path.join(model_dir, "checkpoints")


def make_manager(model_dir: str, max_to_keep: Optional[int] = 3, keep_period: Optional[int] = None,
                 async_save: bool = True) -> ocp.CheckpointManager:
  """A manager that keeps the last `max_to_keep` steps plus every `keep_period`-th."""
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, keep_period=keep_period, create=True,
                                         enable_async_checkpointing=async_save)
  return ocp.CheckpointManager(checkpoint_dir(model_dir), options=options,
                               item_names=(STATE, DATA_ITER, METADATA))


def save(manager: ocp.CheckpointManager, step: int, state, iterator=None, metadata: Optional[dict] = None,
         force: bool = False) -> bool:
  items = {STATE: ocp.args.StandardSave(state), METADATA: ocp.args.JsonSave(metadata or {})}
  if iterator is not None:
    items[DATA_ITER] = DataIteratorSave(iterator)
  return manager.save(step, args=ocp.args.Composite(**items), force=force)


def abstract_with_shardings(abstract_state, shardings):
  """ShapeDtypeStructs carrying the target shardings, so orbax restores (and reshards) onto this mesh."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)


def restore_latest(manager: ocp.CheckpointManager, abstract_state, iterator=None, step=None):
  """Restores the newest step that reads back whole (or exactly `step`), falling back to older ones.

  Returns:
    (step, state, metadata), or (None, None, None) when there is no usable checkpoint.
  """
  steps = sorted(manager.all_steps(), reverse=True) if step is None else [step]
  for step in steps:
    items = {STATE: ocp.args.StandardRestore(abstract_state), METADATA: ocp.args.JsonRestore()}
    if iterator is not None:
      items[DATA_ITER] = DataIteratorRestore(iterator)
    try:
      restored = manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # pylint: disable=broad-except  # orbax surfaces corruption as many types
      logging.warning("checkpoint step %d in %s is unreadable (%s: %s); trying an older one",
                      step, manager.directory, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
      continue
    return step, restored[STATE], restored[METADATA]
  return None, None, None
