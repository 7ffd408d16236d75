"""The objective seam: trainable masks (frozen leaves get no optimizer state and never move), frozen
models passed to an objective through the jitted step, objective metrics, sums across microbatches."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.model import decoder as model_lib
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.parallel import partitioning
from t5x_like.training import optimizer
from t5x_like.training import step as train_step
from t5x_like.training import train_state
from t5x_like.training import trainable
from t5x_like.training.objectives import language_model

CFG = model_lib.GPTConfig(vocab_size=128, max_len=16, num_layers=2, num_heads=2, d_model=32, d_ff=64,
                          dtype="float32")
BATCH, SEQ = 8, 8
OPT = optimizer.OptimizerConfig(learning_rate=1e-2, warmup_steps=0)


def batch(seed=0):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(0, CFG.vocab_size, (BATCH, SEQ + 1)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((BATCH, SEQ), np.int32),
          "positions": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ)).copy(),
          "weights": np.ones((BATCH, SEQ), np.float32)}


def init(pattern, mesh_shape=None):
  mesh = mesh_lib.create_mesh(mesh_shape or {"data": 8})
  model, tx = model_lib.GPT(CFG), optimizer.make_optimizer(OPT, 10)
  with jax.set_mesh(mesh), nn.logical_axis_rules(partitioning.DEFAULT_RULES):
    state, shardings = train_state.init_state(model, tx, jax.random.key(0), mesh, trainable=pattern)
  return mesh, model, tx, state, shardings


def test_paths_and_parts():
  params = {"blocks": {"attn": {"qkv": {"kernel": 1}}, "mlp_in": {"kernel": 2}}, "token_embedding": 3}
  paths = trainable.trainable_paths(params, "blocks/attn/.*")
  assert paths == {("blocks", "attn", "qkv", "kernel")}
  part = trainable.trainable_part(params, paths)
  assert part == {"blocks": {"attn": {"qkv": {"kernel": 1}}}}
  assert trainable.merge(params, {"blocks": {"attn": {"qkv": {"kernel": 9}}}})["blocks"]["attn"]["qkv"]["kernel"] == 9
  assert trainable.merge(params, {"blocks": {"attn": {"qkv": {"kernel": 9}}}})["token_embedding"] == 3
  with pytest.raises(ValueError, match=r"TrainConfig.trainable='blocks/atn/.\*' matches no parameter"):
    trainable.trainable_paths(params, "blocks/atn/.*")
  with pytest.raises(ValueError, match="is not a regular expression"):
    trainable.trainable_paths(params, "blocks/(")


def test_frozen_leaves_get_no_optimizer_state_and_never_move():
  pattern = "blocks/attn/.*"
  mesh, model, tx, state, shardings = init(pattern)
  paths = trainable.trainable_paths(state.params, pattern)
  trained_size = sum(int(x.size) for x in jax.tree.leaves(trainable.trainable_part(state.params, paths)))
  all_size = sum(int(x.size) for x in jax.tree.leaves(state.params))
  mu_size = sum(int(x.size) for x in jax.tree.leaves(state.opt_state[1][0].mu))
  assert mu_size == trained_size < all_size / 2  # AdamW moments for the attention leaves only
  objective = language_model.LanguageModel(model.apply)
  step = jax.jit(train_step.make_train_step(objective, tx, optimizer.learning_rate_schedule(OPT, 10),
                                            trainable_paths=paths))
  before = jax.device_get(state.params)
  with jax.set_mesh(mesh):
    for i in range(3):
      state, metrics = step(state, batch(i))
  after = jax.device_get(state.params)
  flat_before, flat_after = (dict(jax.tree_util.tree_flatten_with_path(t)[0]) for t in (before, after))
  for path, value in flat_before.items():
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    moved = not np.array_equal(value, flat_after[path])
    assert moved == name.startswith("blocks/attn/"), name
  assert np.isfinite(metrics["loss"])


def test_all_trainable_is_the_plain_step_bit_for_bit():
  """trainable='.*' takes the unmasked path: the same state structure and updates as before masks."""
  mesh, model, tx, state, _ = init(".*")
  lr_fn = optimizer.learning_rate_schedule(OPT, 10)
  objective = language_model.LanguageModel(model.apply)
  everything = trainable.trainable_paths(state.params, ".*")
  with jax.set_mesh(mesh):
    a, _ = jax.jit(train_step.make_train_step(objective, tx, lr_fn))(jax.tree.map(jnp.copy, state), batch())
    b, _ = jax.jit(train_step.make_train_step(objective, tx, lr_fn, trainable_paths=everything))(state, batch())
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))


@dataclasses.dataclass(frozen=True)
class DistillLike:
  """A test objective reading a frozen model: CE plus a `kl` metric (Σ over tokens) to the frozen logits."""
  apply_fn: object
  features: tuple = language_model.FEATURES

  def loss(self, params, batch, frozen):
    args = (batch["inputs"], batch["positions"], batch["segment_ids"])
    logits = self.apply_fn({"params": params}, *args)
    teacher = self.apply_fn({"params": frozen["teacher"]}, *args)
    loss_sum, weight_sum = language_model.cross_entropy_sums(logits, batch["targets"], batch["weights"])
    p = jax.nn.softmax(teacher)
    kl = jnp.sum(p * (jax.nn.log_softmax(teacher) - jax.nn.log_softmax(logits)), axis=-1)
    return loss_sum, weight_sum, {"kl": jnp.sum(kl * batch["weights"])}


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
def test_frozen_model_reaches_the_objective_and_metrics_are_weighted_means():
  """Two accumulation microbatches: the frozen model reaches each, and the summed metrics are the whole batch's
  mean (one microbatch, the plain path, passes frozen models in every objective's training test: DPO, distill)."""
  num_microbatches = 2
  mesh, model, tx, state, shardings = init(".*", {"data": 4, "fsdp": 2})
  lr_fn = optimizer.learning_rate_schedule(OPT, 10)
  step = train_step.jit_train_step(
      train_step.make_train_step(DistillLike(model.apply), tx, lr_fn, num_microbatches=num_microbatches),
      shardings, partitioning.batch_sharding(mesh), language_model.FEATURES, {"teacher": shardings.params})
  same = jax.tree.map(jnp.copy, state.params)
  other = jax.tree.map(lambda x: x * 1.5, state.params)
  host_params = jax.device_get(state.params)
  with jax.set_mesh(mesh):
    _, m_same = step(jax.tree.map(jnp.copy, state), batch(), {"teacher": same})
    _, m_other = step(state, batch(), {"teacher": other})
  assert abs(float(m_same["kl"])) < 1e-6  # teacher == student: KL 0
  # reference: the mean KL over all tokens, computed directly
  logits = model.apply({"params": host_params}, batch()["inputs"])
  teacher = model.apply({"params": jax.device_get(other)}, batch()["inputs"])
  p = jax.nn.softmax(teacher)
  expected = jnp.mean(jnp.sum(p * (jax.nn.log_softmax(teacher) - jax.nn.log_softmax(logits)), axis=-1))
  np.testing.assert_allclose(float(m_other["kl"]), float(expected), rtol=1e-4)
  np.testing.assert_array_equal(jax.device_get(other["token_embedding"]),  # frozen: read, not donated
                                host_params["token_embedding"] * 1.5)
