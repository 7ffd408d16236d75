"""Fine-tuning: warm start from INITIAL_CHECKPOINT_PATH with shape checks, selective updates, and the data, model and
SFT run of a generated chat task the base cannot do and the fine-tuned model can (the test is in tests/test_grpo.py,
sharing its SFT run). LoRA: tests/test_lora.py (sharing this file's base)."""

import dataclasses
import os

import jax
import numpy as np
import pytest

from t5x_like.data import chat_synth
from t5x_like.data import preprocessing
from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.model import decoder as model_lib
from t5x_like.parallel import global_batch
from t5x_like.parallel import partitioning
from t5x_like.training import checkpointing
from t5x_like.training import config as config_lib
from t5x_like import data as data_lib
from t5x_like.recipes import experiment as experiment_lib
from t5x_like.posttrain import lora
from t5x_like.training import optimizer as optimizer_lib
from t5x_like.training import trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = model_lib.GPTConfig(num_layers=2, num_heads=2, d_model=32, d_ff=64, max_len=32, dtype="float32")
OPT = optimizer_lib.OptimizerConfig(learning_rate=1e-2, warmup_steps=0)
LORA = lora.LoraConfig(rank=4, alpha=8.0)


def run_config(model_dir, data_dir, *, base="", lora_config=lora.LoraConfig(), **overrides):
  fields = dict(
      model_dir=str(model_dir), data_dir=data_dir, train_steps=4, batch_size=8, seq_len=16, log_every=1,
      eval_every=0, checkpoint_every=2, mesh_shape={"data": -1}, lora=lora_config,
      data=data_lib.DataConfig(eval_batches=1, shuffle_buffer=64),
      checkpoint=checkpointing.CheckpointConfig(async_save=False, warm_start_from=base, warm_start_required=True))
  return config_lib.TrainConfig(**{**fields, **overrides})


def random_params(abstract, seed: int):
  """Random host parameters shaped like `abstract` (a stand-in for a pre-trained base; nothing compiles):
  norm scales around 1, everything else around 0."""
  rng = np.random.RandomState(seed)
  return {k: random_params(v, seed + i + 1) if isinstance(v, dict) else
          ((k == "scale") + rng.normal(0.0, 0.05, v.shape)).astype(np.float32)
          for i, (k, v) in enumerate(sorted(abstract.items()))}


def model_params(exp, seed: int):
  return random_params(partitioning.unbox(exp.boxed_params), seed)


@pytest.fixture(scope="module")
def base(corpus, tmp_path_factory):
  """A base MODEL_DIR holding random TINY parameters at step 0 (a parameters-only checkpoint)."""
  exp = experiment_lib.Experiment(run_config("unused", corpus), TINY, OPT)
  params = model_params(exp, seed=1)
  base_dir = str(tmp_path_factory.mktemp("base"))
  checkpointing.save_params(base_dir, params)
  return base_dir, params


@pytest.fixture(scope="module")
def batch(corpus):
  exp = experiment_lib.Experiment(run_config("unused", corpus), TINY, OPT)
  return global_batch.tf_to_numpy(next(iter(exp.eval_dataset(repeat=False))))


def digest(params) -> str:
  return checkpointing.params_digest(params)


# ----------------------------------------------------------------------------------------------------
# Warm start from INITIAL_CHECKPOINT_PATH; shape checks; resume from the run's own checkpoint.


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
def test_warm_start_gives_the_base_then_a_resumed_run_continues_from_its_own_checkpoint(corpus, base, tmp_path):
  base_dir, base_params = base
  exp = experiment_lib.Experiment(run_config(tmp_path / "ft", corpus, base=base_dir), TINY, OPT)
  manager = checkpointing.make_manager(str(tmp_path / "ft"), async_save=False)
  start, state, _, origin = trainer.initial_state(exp, manager, None)
  assert start == 0 and int(state.step) == 0
  assert digest(state.params) == digest(base_params)
  assert origin == {"initial_checkpoint": os.path.join(base_dir, "checkpoints", "0")}
  moved = state.replace(step=state.step + 3, params=jax.tree.map(lambda x: x + 1.0, state.params))
  checkpointing.save(manager, 3, moved, None, {"step": 3})
  manager.wait_until_finished()
  start, state, _, _ = trainer.initial_state(exp, manager, None)
  assert start == 3 and digest(state.params) == digest(moved.params) != digest(base_params)
  manager.close()
  # a frozen model (reference, teacher) from a checkpoints/<step> path, shape-checked the same way
  assert digest(exp.add_frozen("reference", os.path.join(base_dir, "checkpoints", "0"))) == digest(base_params)


def test_empty_initial_checkpoint_path_is_refused(corpus, tmp_path):
  exp = experiment_lib.Experiment(run_config(tmp_path / "ft", corpus), TINY, OPT)
  with pytest.raises(ValueError, match="INITIAL_CHECKPOINT_PATH is empty"):
    exp.validate(resuming=False)  # trainer.train's one pass before anything compiles
  exp.validate(resuming=True)  # a resumed run reads its own checkpoints, not INITIAL_CHECKPOINT_PATH


@pytest.mark.parametrize("base_change, run_change, message", [
    (dict(vocab_size=1024), {}, r"token_embedding: checkpoint \(1024, 32\) vs model config \(512, 32\) — "
                                r"GPTConfig.vocab_size"),
    (dict(d_ff=128), {}, r"blocks/mlp_in/bias: checkpoint \(2, 128\) vs model config \(2, 64\) — GPTConfig.d_ff"),
    ({}, dict(num_kv_heads=1, use_bias=False), r"blocks/attn/key_value/kernel: missing from the checkpoint"),
    (dict(num_experts=4), dict(num_experts=2), r"blocks/moe/mlp_in/bias: checkpoint \(2, 4, 64\) vs model config "
                                               r"\(2, 2, 64\) — GPTConfig.num_experts$"),
])
def test_base_of_another_shape_is_refused_naming_the_parameter(corpus, tmp_path, base_change, run_change, message):
  """The run's vocabulary (the dataset's 400 pieces, padded to 512) and shapes against a differing base;
  then a GQA run over an MHA base (the base has qkv, the run needs query / key_value), and a 2-expert run
  over a 4-expert base."""
  config, base_config = dataclasses.replace(TINY, **run_change), dataclasses.replace(TINY, **base_change)
  base_dir = str(tmp_path / "base")
  checkpointing.save_params(base_dir, model_params(
      experiment_lib.Experiment(run_config("unused", corpus), base_config, OPT), seed=0))
  for lora_config in (lora.LoraConfig(), LORA):  # a full fine-tune's warm start, and a LoRA base
    exp = experiment_lib.Experiment(run_config(tmp_path / "ft", corpus, base=base_dir, lora_config=lora_config),
                                    config, OPT)
    manager = checkpointing.make_manager(str(tmp_path / "ft"), async_save=False)
    with pytest.raises(ValueError, match=message) as raised:
      trainer.initial_state(exp, manager, None)
    assert "\n" not in str(raised.value) and os.path.join(base_dir, "checkpoints", "0") in str(raised.value)
    manager.close()


# ----------------------------------------------------------------------------------------------------
# Selective updates (LoRA: tests/test_lora.py).


def test_attention_preset_trains_only_attention_and_reports_its_optimizer_bytes(corpus, tmp_path):
  exp = experiment_lib.Experiment(run_config(tmp_path, corpus, trainable="attention"), TINY, OPT)
  names = {lora.path_name(p) for p in exp.trainable_paths}
  assert names == {"blocks/attn/qkv/kernel", "blocks/attn/qkv/bias", "blocks/attn/out/kernel",
                   "blocks/attn/out/bias"}
  report = exp.startup_report()
  d, layers = TINY.d_model, TINY.num_layers
  attention = layers * (d * 3 * d + 3 * d + d * d + d)
  assert report["params/trainable"] == attention
  assert report["params/total"] == lora.count(exp.abstract_state.params)
  # AdamW's two moments of the trainable leaves (replicated over the data-parallel mesh), plus step counters
  assert 8 * attention <= report["memory/opt_state_bytes_per_device"] <= 8 * attention + 64
  fsdp = experiment_lib.Experiment(run_config(tmp_path, corpus, trainable="attention", mesh_shape={"fsdp": 8}),
                                   TINY, OPT).startup_report()
  kernels = layers * (d * 3 * d + d * d)  # split 8 ways on their embed axis; the biases are replicated
  assert 8 * (kernels // 8 + attention - kernels) <= fsdp["memory/opt_state_bytes_per_device"] <= (
      8 * (kernels // 8 + attention - kernels) + 64)
  mu_shapes = [x.shape for x in jax.tree.leaves(exp.abstract_state.opt_state) if x.ndim]
  assert sorted(mu_shapes) == sorted(2 * [(layers, d, 3, 2, d // 2), (layers, 3, 2, d // 2), (layers, 2, d // 2, d),
                                          (layers, d)])


def test_regex_matching_nothing_is_a_one_line_error(corpus, tmp_path):
  with pytest.raises(ValueError, match=r"LoraConfig.targets='blocks/attn/qkvz/kernel' matches no parameter"):
    experiment_lib.Experiment(run_config(tmp_path, corpus, lora_config=dataclasses.replace(
        LORA, targets="blocks/attn/qkvz/kernel")), TINY, OPT)
  with pytest.raises(ValueError, match=r"LoraConfig.targets matches 'blocks/attn/qkv/bias'.*not a weight matrix"):
    experiment_lib.Experiment(run_config(tmp_path, corpus, lora_config=dataclasses.replace(
        LORA, targets="blocks/attn/qkv/.*")), TINY, OPT)
  with pytest.raises(ValueError, match=r"TrainConfig.trainable='blocks/atn/.\*' matches no parameter"):
    experiment_lib.Experiment(run_config(tmp_path, corpus, trainable="blocks/atn/.*"), TINY, OPT)
  with pytest.raises(ValueError, match=r"LoraConfig.dropout=1.0 must be in \[0, 1\)"):
    lora.LoraConfig(rank=4, dropout=1.0)
  with pytest.raises(ValueError, match="LoraConfig.dropout=0.1 with 2 pipeline stages"):
    lora.validate(lora.LoraConfig(rank=4, dropout=0.1), dataclasses.replace(TINY, num_stages=2))


# ----------------------------------------------------------------------------------------------------
# A generated task the base cannot do and the fine-tuned model can: its data, model and SFT run. The test that the
# SFT model answers what the base cannot is in tests/test_grpo.py, which starts GRPO from that SFT run.

CHAT_MODEL = model_lib.GPTConfig(num_layers=2, num_heads=2, d_model=32, d_ff=64, max_len=32, dtype="float32",
                                 tie_embeddings=False, position_embedding="rope", norm="rmsnorm",
                                 mlp_activation="swiglu", use_bias=False)


def reverse_chat_data(root, num_train: int, num_test: int, validation_fraction: float):
  """(chat DATA_DIR, train file, test file) of "reverse two words" with a small tokenizer of its words."""
  texts = [" ".join(chat_synth.WORDS) + "\nreverse: value of\n"] * 20
  tok = tokenizer_lib.train_tokenizer(texts, os.path.join(str(root), "tok.model"), vocab_size=360, num_threads=1)
  train_file, test_file = chat_synth.write_synthetic_chat(os.path.join(str(root), "task"), "reverse", num_train,
                                                         num_test, min_words=2, max_words=2)
  data_dir = os.path.join(str(root), "data")
  preprocessing.preprocess([train_file], data_dir, tokenizer=tok.path, data_format="chat", num_train_shards=1,
                           validation_fraction=validation_fraction, progress=False, cache_dir=None)
  return data_dir, train_file, test_file


def chat_sft_run(model_dir: str, data_dir: str, base_dir: str, steps: int):
  """(TrainConfig, OptimizerConfig) of SFT from INITIAL_CHECKPOINT_PATH=base_dir on CHAT_MODEL."""
  run = config_lib.TrainConfig(
      model_dir=model_dir, data_dir=data_dir, train_steps=steps, batch_size=16, seq_len=32, log_every=50,
      eval_every=0, checkpoint_every=steps, mesh_shape={"data": -1},
      data=data_lib.DataConfig(eval_batches=0, shuffle_buffer=256),
      checkpoint=checkpointing.CheckpointConfig(async_save=False, warm_start_from=base_dir, warm_start_required=True))
  return run, optimizer_lib.OptimizerConfig(learning_rate=1e-2, warmup_steps=10, decay="constant")
