"""MoE auxiliary losses under the post-training objectives: DPO, the reward model and distillation add the policy's
(student's) load-balancing and router z-losses as per-token means, exactly what its forward pass sowed, and the
router gets their gradient."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import test_dpo
from tests import test_parallelism as layouts

from t5x_like.model import decoder as model_lib
from t5x_like.model import heads
from t5x_like.posttrain import distill
from t5x_like.posttrain import preference
from t5x_like.posttrain import reward

MOE = dataclasses.replace(test_dpo.SMALL, num_experts=4, moe_top_k=2, moe_capacity_factor=1.0)


def init(config, seed=0, score_head=False):
  model = heads.model_for(config, scored=score_head)
  variables = model.init(jax.random.key(seed), jnp.zeros((1, layouts.SEQ), jnp.int32))
  return model, jax.tree.map(lambda x: x.value, variables, is_leaf=lambda x: hasattr(x, "value"))["params"]


def token_aux(model, params, batch) -> np.ndarray:
  """(B, L) each token's auxiliary loss (load balancing + router z, weighted), the mean over MoE layers: read from
  the forward pass's sown statistics directly."""
  _, state = model.apply({"params": params}, batch["inputs"], batch["positions"], batch["segment_ids"],
                         mutable=["intermediates"])
  stats = model_lib.moe_stats(state)
  return np.asarray(stats.token[..., 0]) / stats.load.shape[0]


def objective_for(name, model, params):
  """(objective with MoE terms, the same without, its batch, its frozen models)."""
  if name == "distill":
    teacher, teacher_params = init(test_dpo.SMALL, seed=3)
    rng = np.random.RandomState(0)
    tokens = rng.randint(2, MOE.vocab_size, (layouts.BATCH, layouts.SEQ + 1)).astype(np.int32)
    weights = (rng.rand(layouts.BATCH, layouts.SEQ) < 0.7).astype(np.float32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights,
             "segment_ids": np.ones((layouts.BATCH, layouts.SEQ), np.int32),
             "positions": np.tile(np.arange(layouts.SEQ, dtype=np.int32), (layouts.BATCH, 1))}
    make = lambda moe: distill.Distill(model.apply, model_lib.logits_projection(MOE), teacher.apply,
                                       model_lib.logits_projection(test_dpo.SMALL), alpha=0.5, moe=moe)
    return make(True), make(False), batch, {distill.TEACHER: teacher_params}
  batch = test_dpo.synthetic_pair_batch()
  if name == "reward":
    make = lambda moe: reward.Reward(model.apply, lambda p, h: heads.project_scores(p, h, MOE), max_pairs=2, moe=moe)
    return make(True), make(False), batch, {}
  make = lambda moe: preference.Preference(model.apply, beta=0.5, max_pairs=2, moe=moe)
  reference = jax.tree.map(lambda x: x * 1.01, params)
  return make(True), make(False), batch, {preference.REFERENCE: reference}


@pytest.mark.parametrize("name", ["dpo", "reward", "distill"])
def test_the_policys_auxiliary_losses_are_added_as_per_token_means(name):
  model, params = init(MOE, score_head=name == "reward")
  with_moe, without, batch, frozen = objective_for(name, model, params)
  loss_fn = lambda objective: jax.jit(jax.value_and_grad(lambda p: objective.loss(p, batch, frozen)[0]))
  (loss, grads), (plain, plain_grads) = loss_fn(with_moe)(params), loss_fn(without)(params)
  _, weight, metrics = jax.jit(with_moe.loss)(params, batch, frozen)
  aux = token_aux(model, params, batch)
  if name == "distill":  # token-weighted like the cross-entropy: Σ weight · aux
    expected = np.sum(aux * batch["weights"])
  else:  # per pair: the mean over every non-padding token (prompts too), times the pairs
    tokens = batch["segment_ids"] > 0
    expected = aux[tokens].mean() * float(weight)
  assert expected > 0
  np.testing.assert_allclose(float(loss) - float(plain), expected, rtol=2e-4)
  per_token = float(metrics["moe/load_balancing_loss"]) / float(weight)  # what the step logs: Σ / Σ weight
  assert 0.5 < per_token < 4.0  # ≈ 1 for a near-balanced router (Switch's normalisation)
  assert {"moe/router_z_loss", "moe/dropped_fraction", "moe/expert_load_max"} <= set(metrics)
  router = lambda g: np.asarray(g["blocks"]["moe"]["router"]["kernel"])
  assert not np.allclose(router(grads), router(plain_grads))  # the auxiliary losses reach the router


def test_the_recipes_turn_the_terms_on_for_a_model_with_experts(tmp_path):
  """dpo, reward and distill build their objective with the MoE terms exactly when the run's model has experts."""
  from t5x_like.recipes import distill as distill_recipe  # pylint: disable=g-import-not-at-top
  from t5x_like.recipes import dpo as dpo_recipe  # pylint: disable=g-import-not-at-top
  from t5x_like.recipes import reward as reward_recipe  # pylint: disable=g-import-not-at-top
  from t5x_like.training import config as config_lib  # pylint: disable=g-import-not-at-top
  from t5x_like.training import checkpointing  # pylint: disable=g-import-not-at-top
  from t5x_like.interop import hf_config  # pylint: disable=g-import-not-at-top
  teacher_dir = str(tmp_path / "teacher")
  checkpointing.save_params(teacher_dir, init(test_dpo.SMALL)[1])
  with open(f"{teacher_dir}/model.gin", "w") as f:
    f.write(hf_config.model_gin(test_dpo.SMALL, "tests/test_moe_objectives.py"))
  for config in (MOE, test_dpo.SMALL):
    run = type("Run", (), dict(model=heads.model_for(config), model_config=config, manifest={"format": "preference"},
                               config=config_lib.TrainConfig(seq_len=layouts.SEQ)))()
    recipes = (dpo_recipe.DpoConfig(), reward_recipe.RewardConfig(),
               distill_recipe.DistillConfig(teacher_checkpoint=teacher_dir))
    for recipe in recipes:
      if isinstance(recipe, distill_recipe.DistillConfig):
        run.manifest = {"format": "text"}
      assert recipe.make_objective(run, loss_scaled=False).moe == (config.num_experts > 0), (recipe, config)
