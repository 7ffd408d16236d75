"""orbax CheckpointManager over MODEL_DIR/checkpoints: train state, per-process data-iterator state, metadata.

Every file operation on MODEL_DIR goes through orbax, etils.epath or tf.io.gfile, so it may be gs://.
`python -m t5x_like.checkpoints list|digest|inspect MODEL_DIR [--step N]` looks into one (checkpoints.py).
"""

import dataclasses
import functools
import hashlib
import os
import subprocess
import time
from typing import Any, Optional

from absl import logging
from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorflow as tf

import t5x_like
from t5x_like import errors
from t5x_like.data import input_pipeline
from t5x_like.training.trainable import path_name

STATE, DATA_ITER, METADATA = "state", "data_iter", "metadata"
CORRUPT_DIR = "checkpoints.corrupt"  # unreadable steps are moved here (MODEL_DIR/checkpoints.corrupt/<step>-<time>)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Which checkpoints are written and kept, and where a fresh run takes its first parameters from."""
  keep: int = 3  # newest checkpoints kept
  keep_period: int = 0  # also keep every checkpoint whose step is a multiple of this; 0 = none
  async_save: bool = True  # write checkpoints in the background while training continues
  warm_start_from: str = ""  # another run's MODEL_DIR or checkpoints/<step>: initial params when MODEL_DIR has none
  warm_start_optimizer: bool = False  # also take its optimizer state (same optimizer); False = fresh, step 0
  # Fine-tuning (configs/runs/finetune.gin): refuse to start a fresh run from random parameters when
  # warm_start_from (INITIAL_CHECKPOINT_PATH) is empty.
  warm_start_required: bool = False


class DataIteratorHandler(ocp.CheckpointHandler):
  """Saves each process's tf.data iterator with tf.train.Checkpoint (exact position, shuffle buffer too).

  A plain (synchronous) handler: orbax writes it on the calling thread inside `manager.save()`, so the
  iterator is captured before the loop draws the next batch.
  """

  def save(self, directory: epath.Path, args: "DataIteratorSave") -> None:
    prefix = os.path.join(os.fspath(directory), f"process_{jax.process_index()}-of-{jax.process_count()}")
    tf.train.Checkpoint(iterator=args.iterator).write(prefix)

  def restore(self, directory: epath.Path, args: "DataIteratorRestore") -> Any:
    prefix = os.path.join(os.fspath(directory), f"process_{jax.process_index()}-of-{jax.process_count()}")
    if tf.io.gfile.exists(prefix + ".index"):
      tf.train.Checkpoint(iterator=args.iterator).read(prefix).assert_consumed()
      return args.iterator
    saved = tf.io.gfile.glob(os.path.join(os.fspath(directory), "process_*.index"))
    if not saved:
      raise FileNotFoundError(f"no data-iterator state in {directory}")
    # Saved by another number of processes: the streams are deterministic, so replay one batch per
    # step to the same position (exact, and costs reading `step` batches once).
    step = int(epath.Path(directory).parent.name)
    logging.warning("data-iterator state in %s was written by %d process(es), this run has %d: replaying "
                    "%d batches to reach the same position", directory, len(saved), jax.process_count(), step)
    for _ in range(step):
      next(args.iterator)
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


class NoUsableCheckpointError(ValueError):
  """Checkpoints exist but none restores with this configuration (a changed model, or all corrupt)."""


def checkpoint_dir(model_dir: str) -> str:
  """MODEL_DIR/checkpoints, made absolute for local paths (orbax refuses relative ones)."""
  if "://" not in model_dir:
    model_dir = os.path.abspath(model_dir)
  return os.path.join(model_dir, "checkpoints")


@functools.lru_cache(maxsize=None)
def _use_replica_parallel(parallel: bool) -> None:
  """orbax saves a replicated array replica-parallel by default: each replica copies a slice of it to its host. In
  one process every replica is local, so that buys no parallel writes and costs a compiled slice program per array
  shape and device (40 of the 45 XLA programs of bench/startup.py's run on 4 devices) and a copy per slice."""
  absl_logger = logging.get_absl_logger()  # orbax warns on every override of a registered handler
  level = absl_logger.level  # its own level (often NOTSET), restored as it was
  absl_logger.setLevel(logging.converter.STANDARD_ERROR)
  try:
    ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=parallel),
                                            override=True)
  finally:
    absl_logger.setLevel(level)


def make_manager(model_dir: str, max_to_keep: Optional[int] = 3, keep_period: Optional[int] = None,
                 async_save: bool = True) -> ocp.CheckpointManager:
  """A manager that keeps the last `max_to_keep` steps plus every `keep_period`-th.

  orbax deletes old steps only after the newer one is committed, and leftovers of a killed or failed
  save (`<step>.orbax-checkpoint-tmp*`) are removed when the manager opens.
  """
  _use_replica_parallel(jax.process_count() > 1)
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, keep_period=keep_period or None,
                                         create=True, enable_async_checkpointing=async_save,
                                         cleanup_tmp_directories=True)
  return ocp.CheckpointManager(checkpoint_dir(model_dir), options=options,
                               item_names=(STATE, DATA_ITER, METADATA))


def save(manager: ocp.CheckpointManager, step: int, state, iterator=None, metadata: Optional[dict] = None,
         force: bool = False) -> bool:
  """Starts a save (returns once the state is copied to host and the iterator written; async writes go on)."""
  items = {STATE: ocp.args.StandardSave(state), METADATA: ocp.args.JsonSave(metadata or {})}
  if iterator is not None:
    items[DATA_ITER] = DataIteratorSave(iterator)
  return manager.save(step, args=ocp.args.Composite(**items), force=force)


def abstract_with_shardings(abstract_state, shardings):
  """ShapeDtypeStructs carrying the target shardings, so orbax restores (and reshards) onto this mesh."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)


def restore_latest(manager: ocp.CheckpointManager, abstract_state, iterator=None, step=None,
                   quarantine: bool = False):
  """Restores the newest step that reads back whole (or exactly `step`), falling back to older ones.

  Args:
    manager: from `make_manager`.
    abstract_state: ShapeDtypeStructs with the target shardings (`abstract_with_shardings`).
    iterator: a tf.data iterator to restore in place, or None.
    step: restore exactly this step.
    quarantine: move unreadable steps newer than the restored one out of checkpoints/ (to
      MODEL_DIR/checkpoints.corrupt/), so the run can write those steps again. Only done once an older
      step restored, which proves the failures are corruption and not a changed configuration.

  Returns:
    (step, state, metadata), or (None, None, None) when there is no checkpoint at all.

  Raises:
    NoUsableCheckpointError: checkpoints exist but none restores (never silently start over).
  """
  steps = sorted(manager.all_steps(), reverse=True) if step is None else [step]
  bad, last_error = [], None
  for candidate in steps:
    items = {STATE: ocp.args.StandardRestore(abstract_state), METADATA: ocp.args.JsonRestore()}
    if iterator is not None:
      items[DATA_ITER] = DataIteratorRestore(iterator)
    try:
      restored = manager.restore(candidate, args=ocp.args.Composite(**items))
    except Exception as e:  # pylint: disable=broad-except  # orbax surfaces corruption as many types
      logging.warning("checkpoint step %d in %s is unreadable (%s); trying an older one",
                      candidate, manager.directory, errors.first_line(e, with_type=True))
      bad.append(candidate)
      last_error = e
      continue
    if bad:
      logging.warning("restored step %d of %s; skipped unreadable newer step(s) %s",
                      candidate, manager.directory, bad)
      if quarantine:
        for b in bad:
          quarantine_step(manager, b)
    return candidate, restored[STATE], restored[METADATA]
  if bad:
    raise NoUsableCheckpointError(
        f"{manager.directory} holds checkpoint step(s) {bad} but none restores with this configuration "
        f"(last error {errors.first_line(last_error, with_type=True)}): use another MODEL_DIR, or fix the model/mesh config")
  return None, None, None


def quarantine_step(manager: ocp.CheckpointManager, step: int) -> Optional[str]:
  """Moves an unreadable step to MODEL_DIR/checkpoints.corrupt/<step>-<unix time> (process 0) and reloads."""
  target = None
  if jax.process_index() == 0:
    source = epath.Path(manager.directory) / str(step)
    target = source.parent.parent / CORRUPT_DIR / f"{step}-{int(time.time())}"
    try:
      target.parent.mkdir(parents=True, exist_ok=True)
      source.rename(target)
      logging.warning("moved unreadable checkpoint step %d to %s", step, target)
      target = os.fspath(target)
    except (OSError, tf.errors.OpError) as e:
      logging.error("could not move unreadable checkpoint %s aside: %s", source, e)
      target = None
  _sync("quarantine")
  manager.reload()
  return target


def remove_tmp_dirs(manager: ocp.CheckpointManager, step: Optional[int] = None) -> None:
  """Deletes leftovers of failed saves, freeing the space they hold: what orbax calls a temporary step
  (`<step>.orbax-checkpoint-tmp*` locally; on GCS a step directory without its commit file)."""
  if jax.process_index() == 0:
    for tmp in unfinished_saves(os.fspath(manager.directory)):
      if step is None or ocp.utils.step_from_checkpoint_name(tmp.name) == step:
        try:
          tmp.rmtree(missing_ok=True)
        except (OSError, tf.errors.OpError) as e:
          logging.error("could not delete the unfinished checkpoint %s: %s", tmp, e)
  _sync("remove_tmp")


def unfinished_saves(directory: str) -> list:
  """Paths of the temporary (uncommitted) step directories orbax left in `directory` (MODEL_DIR/checkpoints)."""
  if not tf.io.gfile.isdir(directory):
    return []
  return sorted((t.get() for t in ocp.utils.tmp_checkpoints(directory)), key=lambda p: p.name)


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(f"t5x_like.checkpoints.{name}")


# ----------------------------------------------------------------------------------------------------
# Metadata, warm start, digest.


@functools.lru_cache(maxsize=None)
def code_version() -> str:
  """'<package version>+g<git sha>[.dirty]' when the package is a git checkout, else the version."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                         text=True, timeout=5, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True, timeout=5).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return t5x_like.__version__
  return f"{t5x_like.__version__}+g{sha}" + (".dirty" if dirty else "")


def file_sha256(path: str) -> Optional[str]:
  return input_pipeline.file_sha256(path) if tf.io.gfile.exists(path) else None


def run_metadata(*, mesh_shape, data_dir: str, gin_config: str, **extra) -> dict:
  """What a checkpoint records about its run (JSON): mesh, data manifest hash, config, code version."""
  return {"mesh_shape": {k: int(v) for k, v in dict(mesh_shape).items()},
          "manifest_sha256": file_sha256(os.path.join(data_dir, "manifest.json")) if data_dir else None,
          "gin_config": gin_config, "code_version": code_version(), "jax_version": jax.__version__,
          "process_count": jax.process_count(), **extra}


def check_resume_metadata(saved: Optional[dict], current: dict) -> list:
  """Differences that make a resume inexact (other data, other batch); logged as warnings, returned."""
  saved = saved or {}
  problems = [f"{key}: checkpoint has {saved[key]!r}, this run {current.get(key)!r}"
              for key in ("manifest_sha256", "batch_size", "seq_len")
              if key in saved and saved[key] != current.get(key)]
  for p in problems:
    logging.warning("resuming from a checkpoint of a different run setup (%s): losses will not "
                    "match an uninterrupted run", p)
  return problems


def step_dir(model_dir: str, step: Optional[int] = None) -> tuple:
  """(step, MODEL_DIR/checkpoints/<step>) of `step`, or of the newest committed one."""
  steps = committed_steps(model_dir)
  if not steps:
    raise FileNotFoundError(f"no committed checkpoint in {checkpoint_dir(model_dir)}")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise FileNotFoundError(f"no committed checkpoint step {step} in {checkpoint_dir(model_dir)} "
                            f"(steps: {steps})")
  return step, os.path.join(checkpoint_dir(model_dir), str(step))


def committed_steps(model_dir: str) -> list:
  """Steps orbax finalised, by orbax's own test: locally a killed save leaves only
  `<step>.orbax-checkpoint-tmp*`; on GCS a half-written `<step>/` has no commit file and is left out."""
  return sorted(ocp.utils.checkpoint_steps(checkpoint_dir(model_dir)))


def resolve_checkpoint(model_dir: str, step: Optional[int] = None) -> tuple:
  """(step, MODEL_DIR/checkpoints/<step>) of a run directory (its newest committed step, or `step`) or
  of a path that already names one of its `checkpoints/<step>` directories."""
  path = epath.Path(model_dir)
  if path.parent.name == "checkpoints":  # MODEL_DIR/checkpoints/<step>
    if not path.name.isdigit():
      raise ValueError(f"{model_dir}: a path inside checkpoints/ must name a step directory, e.g. "
                       f"{path.parent}/1000")
    step, model_dir = int(path.name), os.fspath(path.parent.parent)
  return step_dir(model_dir, step)


def check_param_shapes(source: str, expected, axis_hints: Optional[dict] = None, what: str = "checkpoint") -> str:
  """Compares the parameter shapes saved in `source` with `expected` before anything is restored.

  Args:
    source: a MODEL_DIR (newest step) or a `checkpoints/<step>` directory.
    expected: the model config's parameter tree (arrays or ShapeDtypeStructs).
    axis_hints: {parameter path name: per-axis config field} ('token_embedding': ('GPTConfig.vocab_size',
      'GPTConfig.d_model')): the field named after the first axis that differs.
    what: the checkpoint's role in the message ('base checkpoint').

  Returns:
    The `checkpoints/<step>` directory checked (pin it to reload exactly this step later).

  Raises:
    ValueError: one line naming the checkpoint, the first differing parameter path and both shapes, e.g.
      "token_embedding: checkpoint (8192, 64) vs model config (4096, 64) — GPTConfig.vocab_size".
  """
  _, path = resolve_checkpoint(source)
  saved_tree = state_tree_metadata(path)
  if not isinstance(saved_tree, dict) or "params" not in saved_tree:
    raise ValueError(f"{what} {path} holds no 'params' tree")
  saved = {path_name(p): tuple(m.shape) for p, m in jax.tree_util.tree_flatten_with_path(saved_tree["params"])[0]}
  wanted = {path_name(p): tuple(a.shape) for p, a in jax.tree_util.tree_flatten_with_path(expected)[0]}
  for name, shape in wanted.items():
    if name not in saved:
      raise ValueError(f"{what} {path}: {name}: missing from the checkpoint (model config {shape}); "
                       "the model config differs from the checkpoint's model")
    if saved[name] != shape:
      hint = ""
      fields = (axis_hints or {}).get(name, ())
      if len(saved[name]) == len(shape):
        differing = [i for i, (x, y) in enumerate(zip(saved[name], shape)) if x != y]
        if differing and differing[0] < len(fields) and fields[differing[0]]:
          hint = f" — {fields[differing[0]]}"
      raise ValueError(f"{what} {path}: {name}: checkpoint {saved[name]} vs model config {shape}{hint}")
  extra = sorted(set(saved) - set(wanted))
  if extra:
    raise ValueError(f"{what} {path}: {extra[0]}: in the checkpoint {saved[extra[0]]} but not in the model "
                     f"config{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}")
  return path


def save_params(model_dir: str, params, step: int = 0, metadata: Optional[dict] = None) -> str:
  """Writes a parameters-only checkpoint MODEL_DIR/checkpoints/<step> ({'params': ...}, no optimizer state
  or data iterator): what restore_params / warm_start_from / INITIAL_CHECKPOINT_PATH read. Returns its path."""
  manager = make_manager(model_dir, max_to_keep=None, async_save=False)
  try:
    if step in manager.all_steps():
      raise FileExistsError(f"{checkpoint_dir(model_dir)}/{step} already exists: write to an empty directory")
    if not save(manager, step, {"params": params}, metadata=metadata):
      raise OSError(f"orbax did not save step {step} in {checkpoint_dir(model_dir)}")
    manager.wait_until_finished()
  finally:
    manager.close()
  return os.path.join(checkpoint_dir(model_dir), str(step))


def state_tree_metadata(path: str):
  """The saved state's tree of array metadata (shape, dtype, sharding); reads no array bytes."""
  meta = ocp.PyTreeCheckpointer().metadata(os.path.join(path, STATE))
  tree = getattr(meta, "item_metadata", meta)
  return getattr(tree, "tree", tree)


def restore_params(model_dir: str, step: Optional[int] = None, abstract_params=None,
                   with_opt_state_of=None):
  """Parameters (and optionally optimizer state) of MODEL_DIR's checkpoint, without its data iterator.

  Args:
    model_dir: a run directory (or a path to one of its `checkpoints/<step>` directories).
    step: default the newest committed step.
    abstract_params: ShapeDtypeStructs with shardings to restore onto; None = host numpy arrays.
    with_opt_state_of: also restore `opt_state` against this abstract tree (shardings included).

  Returns:
    (step, params) or (step, params, opt_state) when `with_opt_state_of` is given.
  """
  step, path = resolve_checkpoint(model_dir, step)
  if abstract_params is None:
    abstract_params = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), state_tree_metadata(path)["params"])
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), abstract_params)
  else:
    args = ocp.checkpoint_utils.construct_restore_args(abstract_params)
  item, restore_args = {"params": abstract_params}, {"params": args}
  if with_opt_state_of is not None:
    item["opt_state"] = with_opt_state_of
    restore_args["opt_state"] = ocp.checkpoint_utils.construct_restore_args(with_opt_state_of)
  out = ocp.PyTreeCheckpointer().restore(
      os.path.join(path, STATE),
      args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True))
  if with_opt_state_of is not None:
    return step, out["params"], out["opt_state"]
  return step, out["params"]


def restore_newest_params(model_dir: str, abstract_params, step: Optional[int] = None):
  """(step, params) of the newest readable checkpoint (or exactly `step`), onto `abstract_params`' shardings.

  Reads the parameters only (not the optimizer state, twice their size); an unreadable newest step
  falls back to the one before it, as `restore_latest` does for training.
  """
  if epath.Path(model_dir).parent.name == "checkpoints":  # names one step: no older one to fall back to
    return restore_params(model_dir, step, abstract_params=abstract_params)
  steps = [step] if step is not None else sorted(committed_steps(model_dir), reverse=True)
  for candidate in steps:
    try:
      return restore_params(model_dir, candidate, abstract_params=abstract_params)
    except FileNotFoundError:
      raise
    except Exception as e:  # pylint: disable=broad-except  # orbax surfaces corruption as many types
      logging.warning("checkpoint step %d is unreadable (%s); trying an older one", candidate,
                      errors.first_line(e, with_type=True))
  raise FileNotFoundError(f"no readable checkpoint in {checkpoint_dir(model_dir)}"
                          + (f" at step {step}" if step is not None else ""))


def host_array(x) -> np.ndarray:
  """The whole array on this host, whatever its sharding (all processes must call for global arrays)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def params_digest(params) -> str:
  """SHA-256 over every parameter's name, dtype, shape and bytes (C order), leaves sorted by name.

  Independent of the sharding and mesh: each array is gathered whole to the host first.
  """
  digest = hashlib.sha256()
  leaves = sorted((path_name(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0])
  for name, leaf in leaves:
    arr = np.ascontiguousarray(host_array(leaf))
    digest.update(f"{name}|{arr.dtype.str}|{arr.shape}\n".encode())
    digest.update(arr.tobytes())
  return digest.hexdigest()


def read_metadata(path: str) -> dict:
  """The JSON metadata item of one `checkpoints/<step>` directory ({} if absent)."""
  return ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(
      os.path.join(path, METADATA), args=ocp.args.JsonRestore()) or {}
