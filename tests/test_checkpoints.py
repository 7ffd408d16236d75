"""Checkpoints: reshard on restore, corrupt-step fallback, failed saves keep the last good step, CLI, warm start."""

import errno
import functools
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import conftest
from tests import forkserver
import tensorflow as tf

from t5x_like.training import checkpointing as checkpoints
from t5x_like import checkpoints as checkpoints_cli
from t5x_like.training import fault_tolerance
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.model import decoder as model_lib
from t5x_like.training import optimizer as optimizer_lib
from t5x_like.parallel import partitioning
from t5x_like.training import train_state as train_state_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA8 = {"pipeline": 1, "data": 8, "fsdp": 1, "tensor": 1}
FSDP4_TENSOR2 = {"pipeline": 1, "data": 1, "fsdp": 4, "tensor": 2}
CONFIG = model_lib.GPTConfig(vocab_size=128, max_len=16, num_layers=2, num_heads=2, d_model=32, d_ff=64)


@functools.lru_cache(maxsize=None)
def _sharded_state(mesh_items, seed):
  mesh = mesh_lib.create_mesh(dict(mesh_items))
  model = model_lib.GPT(CONFIG)
  tx = optimizer_lib.make_optimizer(optimizer_lib.OptimizerConfig(), 10)
  with jax.set_mesh(mesh), nn.logical_axis_rules(partitioning.DEFAULT_RULES):
    abstract, shardings = train_state_lib.state_shardings(model, tx, mesh)
    state, _ = train_state_lib.init_state(model, tx, jax.random.key(seed), mesh)
  return state, checkpoints.abstract_with_shardings(abstract, shardings)


def sharded_state(mesh_shape, seed=0):
  """(TrainState initialised into the mesh's shardings, its abstract tree with shardings); cached."""
  return _sharded_state(tuple(mesh_shape.items()), seed)


def host(tree):
  return jax.tree.map(np.asarray, tree)


def assert_trees_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, host(a), host(b))


class _Iterator(tf.Module):  # stands in for the tf.data iterator: trackable by tf.train.Checkpoint
  def __init__(self):
    super().__init__()
    self.position = tf.Variable(0, dtype=tf.int64)


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
def test_reshard_on_restore_data8_to_fsdp4_tensor2(tmp_path):
  state, _ = sharded_state(DATA8)
  manager = checkpoints.make_manager(str(tmp_path), async_save=True)
  assert checkpoints.save(manager, 7, state, metadata={"step": 7})
  manager.close()
  digest = checkpoints.params_digest(state.params)

  _, abstract = sharded_state(FSDP4_TENSOR2, seed=1)
  step, restored, metadata = checkpoints.restore_latest(checkpoints.make_manager(str(tmp_path)), abstract)
  assert (step, metadata) == (7, {"step": 7})
  assert_trees_equal(restored, state)
  kernel = restored.params["blocks"]["mlp_in"]["kernel"]  # (layers, embed→fsdp, mlp→tensor)
  assert kernel.sharding.spec == abstract.params["blocks"]["mlp_in"]["kernel"].sharding.spec
  assert kernel.sharding.mesh.shape["fsdp"] == 4 and kernel.sharding.mesh.shape["tensor"] == 2
  assert len({str(s.index) for s in kernel.addressable_shards}) == 8  # really split 4×2
  assert checkpoints.params_digest(restored.params) == digest  # the digest ignores the layout


def _corrupt(step_path, how):
  files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_path, "state")) for f in fs]
  for f in files:
    if how == "truncate" and ("/d/" in f or f.endswith("manifest.ocdbt")):
      with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
    elif how == "garbage" and f.endswith("_METADATA"):
      with open(f, "w") as fh:
        fh.write("{not json")


@pytest.mark.parametrize("how", ["truncate", "garbage"])
def test_corrupt_latest_falls_back_reports_and_moves_it_aside(tmp_path, caplog, how):
  state, abstract = sharded_state(DATA8)
  manager = checkpoints.make_manager(str(tmp_path), max_to_keep=None, async_save=False)
  for step in (1, 2, 3):
    checkpoints.save(manager, step, state.replace(step=state.step + step), _Iterator(), {"step": step})
  _corrupt(os.path.join(checkpoints.checkpoint_dir(str(tmp_path)), "3"), how)

  step, restored, metadata = checkpoints.restore_latest(manager, abstract, _Iterator(), quarantine=True)
  assert step == 2 and metadata == {"step": 2} and int(restored.step) == 2
  assert "checkpoint step 3" in caplog.text and "unreadable" in caplog.text  # reported
  assert checkpoints.committed_steps(str(tmp_path)) == [1, 2]
  assert os.listdir(os.path.join(str(tmp_path), checkpoints.CORRUPT_DIR))[0].startswith("3-")
  assert checkpoints.save(manager, 3, state, _Iterator(), {"step": 3})  # step 3 can be written again


def test_unrestorable_checkpoints_raise_instead_of_starting_over(tmp_path):
  state, _ = sharded_state(DATA8)
  manager = checkpoints.make_manager(str(tmp_path), async_save=False)
  checkpoints.save(manager, 5, state)
  other = jax.tree.map(lambda a: jax.ShapeDtypeStruct((3,) + a.shape, a.dtype), state)  # another model
  with pytest.raises(checkpoints.NoUsableCheckpointError, match=r"step\(s\) \[5\] but none restores"):
    checkpoints.restore_latest(manager, other, quarantine=True)
  assert checkpoints.committed_steps(str(tmp_path)) == [5]  # nothing moved or deleted


def test_keep_last_k_plus_every_mth(tmp_path):
  manager = checkpoints.make_manager(str(tmp_path), max_to_keep=2, keep_period=4, async_save=True)
  for step in range(1, 11):
    checkpoints.save(manager, step, {"w": np.full((4,), step, np.float32)})
  manager.close()
  assert checkpoints.committed_steps(str(tmp_path)) == [4, 8, 9, 10]


def test_failed_save_is_reported_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, caplog):
  """A write that fails (ENOSPC) leaves the previous step restorable; too many failures stop the run."""
  manager = checkpoints.make_manager(str(tmp_path), max_to_keep=1, async_save=False)
  saver = fault_tolerance.Saver(manager, max_failures=1)
  state = {"w": np.arange(8, dtype=np.float32)}
  saver.save(1, state, _Iterator(), {})
  saver.save(2, state, _Iterator(), {})
  real_write = tf.train.Checkpoint.write

  def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(tf.train.Checkpoint, "write", full_disk)
  saver.save(3, state, _Iterator(), {})  # reported, run goes on
  assert "checkpoint save at step 3 FAILED" in caplog.text and "newest committed checkpoint is step 2" in caplog.text
  assert checkpoints.committed_steps(str(tmp_path)) == [2]
  assert not [n for n in os.listdir(checkpoints.checkpoint_dir(str(tmp_path))) if "tmp" in n]
  with pytest.raises(fault_tolerance.CheckpointSaveError, match="2 checkpoint saves in a row failed") as info:
    saver.save(4, state, _Iterator(), {})
  assert info.value.exit_code == fault_tolerance.EXIT_SAVE_FAILED == 74
  monkeypatch.setattr(tf.train.Checkpoint, "write", real_write)
  step, restored, _ = checkpoints.restore_latest(checkpoints.make_manager(str(tmp_path)),
                                                 {"w": np.zeros(8, np.float32)}, _Iterator())
  assert step == 2
  np.testing.assert_array_equal(restored["w"], state["w"])


def _mount_tmpfs(path, size):
  os.makedirs(path)
  if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                    capture_output=True).returncode:
    pytest.skip("cannot mount a small tmpfs here (needs root); the simulated ENOSPC test covers the logic")


def test_full_disk_async_save_keeps_last_good_and_final_save_error(tmp_path):
  """A real full file system: the async write fails in the background, is reported at the next save."""
  root = str(tmp_path / "small")
  _mount_tmpfs(root, "1m")
  try:
    manager = checkpoints.make_manager(root, max_to_keep=1, async_save=True)
    saver = fault_tolerance.Saver(manager, max_failures=5)
    saver.save(1, {"w": np.ones(16, np.float32)}, None, {})
    big = {"w": np.random.default_rng(0).random(1 << 19).astype(np.float32)}  # 2 MB, incompressible
    saver.save(2, big, None, {})
    with pytest.raises(fault_tolerance.CheckpointSaveError, match=r"final checkpoint \(step 2\)"):
      saver.finish(2)
    assert saver.failures == 1 and checkpoints.committed_steps(root) == [1]
    manager.close()
    step, restored, _ = checkpoints.restore_latest(checkpoints.make_manager(root), {"w": np.zeros(16, np.float32)})
    assert step == 1 and restored["w"].sum() == 16
  finally:
    subprocess.run(["umount", root], check=False)


def test_read_only_model_dir_is_a_clear_error_and_loses_nothing(tmp_path):
  model_dir = str(tmp_path / "run")
  manager = checkpoints.make_manager(model_dir, async_save=False)
  checkpoints.save(manager, 1, {"w": np.ones(4, np.float32)})
  if os.geteuid() == 0:
    locked = subprocess.run(["chattr", "+i", model_dir], capture_output=True).returncode == 0
    unlock = ["chattr", "-i", model_dir]
  else:
    os.chmod(model_dir, 0o555)
    locked, unlock = True, ["chmod", "755", model_dir]
  if not locked:
    pytest.skip("cannot make a directory read-only here")
  try:
    with pytest.raises(fault_tolerance.CheckpointSaveError,
                       match=r"MODEL_DIR '.*/run' is not writable \(.*\): no checkpoint could be saved") as info:
      fault_tolerance.check_writable(model_dir)
    assert info.value.exit_code == 74
  finally:
    subprocess.run(unlock, check=True)
  assert checkpoints.restore_latest(manager, {"w": np.zeros(4, np.float32)})[0] == 1


def state_around(mesh_shape, opt_config, abstract, params):
  """train_state.state_around on `mesh_shape` with `opt_config`'s optimizer, laid out as `abstract`."""
  tx = optimizer_lib.make_optimizer(opt_config, 10)
  with jax.set_mesh(mesh_lib.create_mesh(mesh_shape)), nn.logical_axis_rules(partitioning.DEFAULT_RULES):
    return train_state_lib.state_around(params, tx, jax.tree.map(lambda a: a.sharding, abstract))


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_a_state_around_given_parameters_is_init_states_with_them(name):
  """A warm start's fresh state (no random initialisation to replace) equals init_state's with its parameters
  replaced, on a sharded layout: the same optimizer state (Adafactor's factored moments too), step, layout."""
  opt_config = optimizer_lib.OptimizerConfig(name=name)
  tx = optimizer_lib.make_optimizer(opt_config, 10)
  mesh = mesh_lib.create_mesh(FSDP4_TENSOR2)
  with jax.set_mesh(mesh), nn.logical_axis_rules(partitioning.DEFAULT_RULES):
    model = model_lib.GPT(CONFIG)
    abstract, shardings = train_state_lib.state_shardings(model, tx, mesh)
    init, _ = train_state_lib.init_state(model, tx, jax.random.key(4), mesh)
  params = sharded_state(DATA8, seed=3)[0].params  # another layout's: resharded by the restore in a warm start
  params = jax.device_put(params, shardings.params)
  state = state_around(FSDP4_TENSOR2, opt_config, checkpoints.abstract_with_shardings(abstract, shardings),
                       jax.tree.map(jnp.copy, params))
  assert_trees_equal(state.params, params)
  assert_trees_equal(state.opt_state, init.opt_state)
  assert int(state.step) == 0 and state.loss_scale is None
  assert jax.tree.structure(state) == jax.tree.structure(init)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(init)):
    assert a.sharding == b.sharding and a.dtype == b.dtype


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_state_shardings_from_the_runtimes_boxed_parameters_equal_the_models_own(name):
  """state_shardings given the model's abstract boxed parameters (Runtime.boxed_params, not traced again) gives
  the abstract state and shardings it gives by tracing the model's init: Adafactor's factored moments replicated."""
  tx = optimizer_lib.make_optimizer(optimizer_lib.OptimizerConfig(name=name), 10)
  mesh = mesh_lib.create_mesh(FSDP4_TENSOR2)
  with jax.set_mesh(mesh), nn.logical_axis_rules(partitioning.DEFAULT_RULES):
    model = model_lib.GPT(CONFIG)
    boxed = model_lib.abstract_params(CONFIG, mesh, partitioning.DEFAULT_RULES)  # what Runtime.boxed_params gives
    traced = train_state_lib.state_shardings(model, tx, mesh, trainable=".*(attn|mlp).*")
    given = train_state_lib.state_shardings(model, tx, mesh, trainable=".*(attn|mlp).*", boxed_params=boxed)
  assert jax.tree.structure(given) == jax.tree.structure(traced)
  for a, b in zip(jax.tree.leaves(given), jax.tree.leaves(traced)):
    assert a == b
  assert any(s.spec != jax.sharding.PartitionSpec() for s in jax.tree.leaves(given[1].opt_state))  # sharded moments


def test_warm_start_takes_params_and_optionally_optimizer_state(tmp_path):
  source, _ = sharded_state(DATA8, seed=3)
  # a trained-looking optimizer state (non-zero moments), so taking it or not is visible
  moments = jax.tree.map(lambda x: x + 0.25 if jnp.issubdtype(x.dtype, jnp.floating) else x + 3, source.opt_state)
  source = source.replace(step=source.step + 9, opt_state=moments)
  manager = checkpoints.make_manager(str(tmp_path), async_save=False)
  checkpoints.save(manager, 9, source)
  fresh, abstract = sharded_state(FSDP4_TENSOR2, seed=4)
  fresh_opt = jax.device_get(fresh.opt_state)
  around = functools.partial(state_around, FSDP4_TENSOR2, optimizer_lib.OptimizerConfig(), abstract)
  warm = fault_tolerance.warm_start(str(tmp_path), abstract, False, around)
  assert_trees_equal(warm.params, source.params)
  assert_trees_equal(warm.opt_state, fresh_opt)  # a fresh optimizer (init_state's): nothing taken from the source
  assert int(warm.step) == 0
  path = os.path.join(checkpoints.checkpoint_dir(str(tmp_path)), "9")
  warm = fault_tolerance.warm_start(path, abstract, True, around)
  assert_trees_equal(warm.params, source.params)
  assert_trees_equal(warm.opt_state, source.opt_state)  # the source's moments and counts, resharded
  assert int(warm.step) == 0
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(source.opt_state)),
                                                      jax.tree.leaves(fresh_opt)))


@pytest.mark.slow  # end to end: the CLI on a saved state
def test_cli_list_inspect_digest_and_errors(tmp_path, capsys, monkeypatch):
  state, _ = sharded_state(DATA8)
  manager = checkpoints.make_manager(str(tmp_path), async_save=False)
  checkpoints.save(manager, 4, state, metadata=checkpoints.run_metadata(
      mesh_shape=DATA8, data_dir="", gin_config="x = 1", step=4))
  checkpoints_cli.look("list", str(tmp_path))
  out = capsys.readouterr().out
  assert "step 4: mesh={'pipeline': 1, 'data': 8, 'fsdp': 1, 'tensor': 1}" in out and "[4]" in out
  checkpoints_cli.look("inspect", str(tmp_path), step=4)
  out = capsys.readouterr().out
  assert "params/blocks/mlp_in/kernel" in out and "(2, 32, 64)" in out and "'fsdp', 'tensor'" in out
  assert '"code_version": "0.1.0' in out

  run = lambda *args: forkserver.run([sys.executable, "-m", "t5x_like.checkpoints", *args], cwd=REPO,
                                     capture_output=True, text=True, env=dict(os.environ, XLA_FLAGS=conftest.xla_flags(0)))
  digest = run("digest", str(tmp_path))
  assert digest.returncode == 0, digest.stderr
  assert digest.stdout.strip().splitlines()[-1] == checkpoints.params_digest(state.params)
  assert conftest.run_cli_in_process(monkeypatch, checkpoints_cli.run,
                                     ["checkpoints", "digest", str(tmp_path), "--step", "5"]) == 1
  assert capsys.readouterr().err.strip().splitlines()[-1] == (
      f"error: no committed checkpoint step 5 in {tmp_path}/checkpoints (steps: [4])")


def test_one_process_saves_replicated_arrays_without_slicing_them_per_replica(tmp_path):
  """In one process every replica of a replicated array is local: the save copies each array once, compiling no
  program (orbax's replica-parallel default would slice every replica's copy, one compiled slice program per array
  shape and device). A fresh shape whose 24 rows split over the 8 replicas, as orbax's slicing needs, that no
  earlier save in this process compiled slices of."""
  import jax.monitoring  # pylint: disable=g-import-not-at-top
  mesh = mesh_lib.create_mesh(DATA8)
  state = {"w": jax.device_put(np.arange(72, dtype=np.float32).reshape(24, 3),
                               jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))}
  lowered = []
  listener = lambda event, duration, **kw: lowered.append(event) if event.endswith(
      "jaxpr_to_mlir_module_duration") else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  level = absl_logging.get_absl_logger().level
  checkpoints._use_replica_parallel.cache_clear()  # pylint: disable=protected-access  (registers again below)
  try:
    manager = checkpoints.make_manager(str(tmp_path), async_save=False)
    assert absl_logging.get_absl_logger().level == level  # quieting orbax's override warning changed no log level
    assert checkpoints.save(manager, 1, state)
    manager.wait_until_finished()
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert not lowered
  abstract = checkpoints.abstract_with_shardings(jax.eval_shape(lambda: state), {"w": state["w"].sharding})
  assert_trees_equal(checkpoints.restore_latest(checkpoints.make_manager(str(tmp_path)), abstract)[1], state)
