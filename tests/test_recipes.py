"""Recipes: found by name (TrainConfig.recipe), each config bound in gin under its module's name with no field meaning
two things, and a LoRA DPO run's reference = its base with the adapters off (the same arrays, no second copy)."""

import dataclasses
import os
import tokenize

import gin
import jax
import numpy as np
import pytest

from tests.test_dpo import OPT, TINY, host_params, prefs, run_config  # pylint: disable=unused-import  (prefs: a fixture)

from t5x_like import cli
from t5x_like import recipes
from t5x_like.parallel import global_batch
from t5x_like.posttrain import lora
from t5x_like.posttrain import preference
from t5x_like.recipes import dpo as dpo_recipe
from t5x_like.recipes import grpo as grpo_recipe
from t5x_like.recipes import online_dpo as online_dpo_recipe
from t5x_like.recipes import ppo as ppo_recipe
from t5x_like.training import checkpointing
from t5x_like.training import config as config_lib
from t5x_like.recipes import experiment as experiment_lib
from t5x_like.training import trainer


def test_every_recipe_module_is_found_by_name_and_an_unknown_one_is_a_one_line_error():
  assert {"language_model", "dpo", "reward", "grpo", "distill", "ppo", "online_dpo"} <= set(recipes.RECIPES)
  assert recipes.get("dpo").CONFIG is dpo_recipe.DpoConfig
  with pytest.raises(ValueError, match=r"TrainConfig.recipe='rlhf' is not a recipe \(t5x_like/recipes/: distill, dpo"):
    recipes.get("rlhf")


RUN = ["MODEL_DIR = '/tmp/x'", "DATA_DIR = '/tmp/d'"]


@pytest.mark.parametrize("gin_file, bindings, expected", [
    ("configs/runs/dpo.gin", ["DPO_BETA = 0.3", "dpo.DpoConfig.gamma = 0.7", "INITIAL_CHECKPOINT_PATH = '/b'"],
     dpo_recipe.DpoConfig(beta=0.3, gamma=0.7)),
    ("configs/runs/grpo.gin", ["GRPO_KL = 0.02", "GRPO_GROUP = 4", "INITIAL_CHECKPOINT_PATH = '/b'"],
     grpo_recipe.GrpoConfig(kl_beta=0.02, num_generations=4, max_new_tokens=32)),
    ("configs/runs/ppo.gin", ["PPO_KL = 0.1", "PPO_EPOCHS = 2", "PPO_REWARD = 'reward_model'",
                              "REWARD_CHECKPOINT_PATH = '/rm'", "INITIAL_CHECKPOINT_PATH = '/b'"],
     ppo_recipe.PpoConfig(kl_coef=0.1, ppo_epochs=2, reward="reward_model", reward_checkpoint="/rm",
                          max_new_tokens=32)),
    ("configs/runs/online_dpo.gin",
     ["DPO_BETA = 0.2", "REWARD_CHECKPOINT_PATH = '/rm'", "INITIAL_CHECKPOINT_PATH = '/b'"],
     online_dpo_recipe.OnlineDpoConfig(beta=0.2, reward="reward_model", reward_checkpoint="/rm", max_new_tokens=32)),
    ("configs/runs/pretrain.gin", [], config_lib.LanguageModelConfig()),
])
def test_a_run_file_picks_its_recipe_and_binds_its_config_under_the_recipe_name(gin_file, bindings, expected):
  gin.clear_config()
  try:
    cli.parse_gin([f"{cli.REPO_ROOT}/configs/models/gpt_tiny.gin", f"{cli.REPO_ROOT}/{gin_file}"],
                  RUN + bindings)
    config = cli.train_config()
  finally:
    gin.clear_config()
  assert config.recipe_config == expected
  assert recipes.get(config.recipe).CONFIG is type(expected)


def _lora_dpo(prefs_dir, model_dir, base_dir, base_precision="float32"):
  config = run_config(model_dir, prefs_dir, base=base_dir, train_steps=2,
                      lora=lora.LoraConfig(rank=4, alpha=8.0, base_precision=base_precision))
  exp = experiment_lib.Experiment(config, TINY, OPT)
  manager = checkpointing.make_manager(str(model_dir), async_save=False)
  _, state, _, origin = trainer.initial_state(exp, manager, None)
  return exp, state, origin


def test_a_lora_dpo_reference_is_the_base_itself_and_the_losses_are_unchanged(prefs, tmp_path):
  base_dir = str(tmp_path / "base")
  checkpointing.save_params(base_dir, host_params(dataclasses.replace(TINY, vocab_size=512), seed=2))
  exp, state, origin = _lora_dpo(prefs[0], tmp_path / "run", base_dir)
  assert origin["reference_checkpoint"] == origin["lora"]["base"]
  # one copy: the reference's arrays are the base's, and the start-up report counts no frozen reference bytes
  assert all(r is b for r, b in zip(jax.tree.leaves(exp.frozen[preference.REFERENCE]),
                                    jax.tree.leaves(exp.frozen[lora.BASE])))
  report = exp.startup_report()
  assert "memory/frozen_reference_bytes_per_device" not in report and report["memory/frozen_base_bytes_per_device"]
  batch = exp.global_batch(global_batch.tf_to_numpy(next(iter(exp.eval_dataset(repeat=True)))))
  loss = jax.jit(exp.objective.loss)
  with exp.context():
    shared = loss(state.params, batch, exp.frozen)
    # the same objective with a separately restored copy of the reference (the old behaviour)
    copy = dict(exp.frozen)
    copy[preference.REFERENCE] = checkpointing.restore_newest_params(origin["reference_checkpoint"],
                                                                     exp.abstract_model_params())[1]
    separate = loss(state.params, batch, copy)
  assert not any(r is b for r, b in zip(jax.tree.leaves(copy[preference.REFERENCE]),
                                        jax.tree.leaves(exp.frozen[lora.BASE])))
  assert float(shared[0]) == float(separate[0]) and float(shared[1]) == float(separate[1]) > 0
  for name in shared[2]:
    assert float(shared[2][name]) == float(separate[2][name]), name


def test_a_qlora_dpo_starts_at_log_2_against_its_quantised_base(prefs, tmp_path):
  """DPO over an nf4 base (QLoRA): the reference is the quantised base itself, the policy at B = 0 computes the same
  log-probabilities through the same dequantising projections, so every margin is 0 and the loss is log 2; a step
  moves the adapters."""
  base_dir = str(tmp_path / "base")
  checkpointing.save_params(base_dir, host_params(dataclasses.replace(TINY, vocab_size=512), seed=2))
  exp, state, _ = _lora_dpo(prefs[0], tmp_path / "run", base_dir, base_precision="nf4")
  assert exp.frozen[preference.REFERENCE] is exp.frozen[lora.BASE]
  batch = exp.global_batch(global_batch.tf_to_numpy(next(iter(exp.eval_dataset(repeat=True)))))
  with exp.context():
    loss_sum, weight, _ = jax.jit(exp.objective.loss)(state.params, batch, exp.frozen)
    new_state, _ = exp.jit_train_step()(state, batch, exp.frozen)
  assert float(loss_sum / weight) == pytest.approx(np.log(2.0), abs=1e-6)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(state.params)))


OLD_CONFIG = os.path.join(os.path.dirname(__file__), "data", "config_813c6e2_era.gin")  # a run's config.gin, f9706bf


@pytest.mark.parametrize("name, beta, expected", [
    ("language_model", "0.1", config_lib.LanguageModelConfig()),
    ("preference", "0.3", dpo_recipe.DpoConfig(beta=0.3)),
    ("grpo", "0.02", grpo_recipe.GrpoConfig(kl_beta=0.02)),
])
def test_an_older_runs_config_gin_still_parses_with_its_objective_mapped_to_the_recipe(name, beta, expected, tmp_path,
                                                                                       caplog):
  text = open(OLD_CONFIG, encoding="utf-8").read()
  assert "ObjectiveConfig.name = 'language_model'" in text and "GPTConfig.score_head = False" in text
  path = tmp_path / "config.gin"
  path.write_text(text.replace("ObjectiveConfig.name = 'language_model'", f"ObjectiveConfig.name = '{name}'")
                  .replace("ObjectiveConfig.beta = 0.1", f"ObjectiveConfig.beta = {beta}"))
  gin.clear_config()
  try:
    cli.parse_gin([str(path)])
    config = cli.train_config()
  finally:
    gin.clear_config()
  assert config.recipe_config == expected and config.seq_len == 128
  assert "bindings of an older version" in caplog.text and "GPTConfig.score_head" in caplog.text


def test_the_assembly_and_the_loop_name_no_method():
  """A method lives in its recipe: the assembly (recipes/experiment.py), the frozen-model loader and the loop import
  no method's objective and branch on none (a new method touches none of them)."""
  methods = {"preference", "grpo", "distill", "reward", "rollout", "rollouts", "is_grpo", "needs_teacher",
             "needs_reference", "teacher", "reference", "Preference", "Grpo", "Distill", "Reward", "REFERENCE",
             "TEACHER"}
  for path in ("t5x_like/recipes/experiment.py", "t5x_like/posttrain/frozen_models.py",
               "t5x_like/training/trainer.py", "t5x_like/training/step.py"):
    with open(os.path.join(cli.REPO_ROOT, path), encoding="utf-8") as f:  # names in the code, not its comments
      names = {tok.string for tok in tokenize.generate_tokens(f.readline) if tok.type == tokenize.NAME}
    assert not names & methods, (path, names & methods)


def test_check_validates_the_whole_run_in_one_pass_and_writes_nothing(prefs, tmp_path):
  base_dir, ref_dir = str(tmp_path / "base"), str(tmp_path / "ref")
  checkpointing.save_params(base_dir, host_params(dataclasses.replace(TINY, vocab_size=512), seed=2))
  model_dir = tmp_path / "run"
  report = trainer.check(run_config(model_dir, prefs[0], base=base_dir), TINY, OPT)
  assert report["params/trainable_fraction"] == 1.0 and report["memory/frozen_reference_bytes_per_device"] > 0
  assert not model_dir.exists()  # nothing written, nothing compiled
  # a reference of another shape: one line naming the parameter, before anything compiles or restores
  checkpointing.save_params(ref_dir, host_params(dataclasses.replace(TINY, vocab_size=512, d_ff=32), seed=2))
  with pytest.raises(ValueError, match=r"reference model \(REFERENCE_CHECKPOINT_PATH\).*mlp_in.*GPTConfig.d_ff"):
    trainer.check(run_config(model_dir, prefs[0], base=base_dir, reference=ref_dir), TINY, OPT)
  with pytest.raises(ValueError, match=r"INITIAL_CHECKPOINT_PATH is empty"):
    trainer.check(run_config(model_dir, prefs[0]), TINY, OPT)
  with pytest.raises(ValueError, match=r"initial checkpoint \(INITIAL_CHECKPOINT_PATH\).*token_embedding"):
    trainer.check(run_config(model_dir, prefs[0], base=_other_vocab(tmp_path)), TINY, OPT)
  assert not model_dir.exists()


def _other_vocab(tmp_path):
  path = str(tmp_path / "vocab1024")
  checkpointing.save_params(path, host_params(dataclasses.replace(TINY, vocab_size=1024), seed=2))
  return path


# `python -m t5x_like.train --check` (the report, 'configuration OK', nothing written): test_fault_tolerance.py's
# test_train_check_flag_prints_the_report_and_configuration_ok_and_writes_nothing, in its reference run's launch.
