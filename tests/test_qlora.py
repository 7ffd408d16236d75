"""QLoRA (lora.LoraConfig.base_precision): NF4 levels and blockwise round trips, a quantised frozen base whose
first LoRA step is the quantised base's exactly, the bytes of llama3_8b's base in nf4 against bfloat16, and SFT on
an nf4 base within 5% of bfloat16 LoRA's held-out loss. The tiny base and helpers are tests/test_finetune.py's."""

import dataclasses
import json
import os
import sys

import flax
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_finetune import LORA, OPT, TINY, run_config
from tests.test_finetune import base  # pylint: disable=unused-import  (a fixture this file's tests take)
from tests.test_llama import _model_config

from t5x_like.model import decoder as model_lib
from t5x_like.parallel import global_batch
from t5x_like.planning import memory_model
from t5x_like.posttrain import lora
from t5x_like.posttrain import quantize
from t5x_like.recipes import experiment as experiment_lib
from t5x_like.training import checkpointing
from t5x_like.training import runtime as runtime_lib
from t5x_like.training import trainer

# QLoRA's published NF4 levels (Dettmers et al. 2023, appendix E), which nf4_levels() derives from N(0, 1).
PUBLISHED_NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                 -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                 0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0)


def test_nf4_levels_and_blockwise_round_trips():
  """The levels are QLoRA's; each weight comes back within half the gap between the levels around it (nf4) or half
  a step of 1/127 (int8) of its block's absolute maximum; re-quantising the dequantised kernel gives the same codes
  (the packing is exact); a block of zeros stays zero."""
  np.testing.assert_allclose(quantize.NF4, PUBLISHED_NF4, atol=1e-6)
  rng = np.random.RandomState(0)
  w = jnp.asarray(rng.standard_t(4, size=(3, 16, 128)).astype(np.float32))  # heavy-tailed, 2 blocks a row
  w = w.at[0, 0, :64].set(0.0)
  absmax = jnp.repeat(jnp.max(jnp.abs(w.reshape(3, 16, 2, 64)), axis=-1), 64, axis=-1)
  half_gap = np.diff(quantize.NF4).max() / 2
  for precision, bound in (("nf4", half_gap), ("int8", 0.5 / 127)):
    stored = quantize.quantize_kernel(w, precision)
    assert stored[quantize.CODES].shape == ((3, 16, 64) if precision == "nf4" else (3, 16, 128))
    back = quantize.dequantize_kernel(stored[quantize.CODES], stored[quantize.SCALES])
    assert float(jnp.max(jnp.abs(back - w) / jnp.maximum(absmax, 1e-12))) <= bound + 1e-6
    assert float(jnp.abs(back[0, 0, :64]).max()) == 0.0
    again = quantize.quantize_kernel(back, precision)
    np.testing.assert_array_equal(np.asarray(again[quantize.CODES]), np.asarray(stored[quantize.CODES]))


@pytest.mark.parametrize("precision", ["nf4", "int8"])
def test_qlora_stores_the_base_quantised_and_its_first_step_is_the_quantised_base(precision, corpus, base, tmp_path):
  """The frozen base holds codes and scales for every block projection (bfloat16 elsewhere), fewer bytes than the
  float32 base; B = 0, so the first LoRA step's loss is the model's on the dequantised base bit for bit, and the
  metadata records the precision a merge must reproduce."""
  base_dir, base_params = base
  config = dataclasses.replace(LORA, base_precision=precision)
  exp = experiment_lib.Experiment(run_config(tmp_path, corpus, base=base_dir, lora_config=config), TINY, OPT)
  manager = checkpointing.make_manager(str(tmp_path), async_save=False)
  _, state, _, origin = trainer.initial_state(exp, manager, None)
  assert origin["lora"]["base_precision"] == precision
  stored = flax.traverse_util.flatten_dict(exp.frozen[lora.BASE])
  codes = {p[:-1] for p in stored if p[-1] == quantize.CODES}
  assert codes == {("blocks", "attn", "qkv"), ("blocks", "attn", "out"), ("blocks", "mlp_in"), ("blocks", "mlp_out")}
  assert {leaf.dtype for p, leaf in stored.items() if p[-1] not in (quantize.CODES, quantize.SCALES)} == {
      jnp.dtype(jnp.bfloat16)}
  report = exp.startup_report()
  float_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(base_params))
  assert report["memory/frozen_base_bytes_per_device"] < 0.5 * float_bytes
  batch = exp.global_batch(global_batch.tf_to_numpy(next(iter(exp.eval_dataset(repeat=False)))))
  with exp.context():
    _, metrics = exp.jit_train_step()(state, batch, exp.frozen)
    loss, weight, _ = jax.jit(exp.model_objective.loss)(lora.computed_base(base_params, precision), batch, {})
    full, full_weight, _ = jax.jit(exp.model_objective.loss)(base_params, batch, {})
  assert float(metrics["loss"]) == float(loss / weight)
  assert float(loss / weight) != float(full / full_weight)  # the quantised base is not the float one


@pytest.mark.parametrize("precision", ["nf4", "bfloat16"])
def test_the_planner_counts_a_lora_runs_bytes_as_the_start_up_report_does(precision, corpus, base, tmp_path):
  """memory_model.lora_bytes_per_device (python -m t5x_like.plan with --gin.lora.LoraConfig.*) on
  data2×fsdp2×tensor2: the stored frozen base, the adapters and their optimizer state per device equal the
  start-up report of the run itself, byte for byte; the estimate's parameters and optimizer state are those."""
  config = dataclasses.replace(LORA, base_precision=precision)
  run = run_config(tmp_path, corpus, base=base[0], lora_config=config, mesh_shape={"data": 2, "fsdp": 2, "tensor": 2})
  exp = experiment_lib.Experiment(run, TINY, OPT)
  report, cfg = exp.startup_report(), exp.model_config
  layout = memory_model.Layout(data=2, fsdp=2, tensor=2)
  planned = memory_model.lora_bytes_per_device(cfg, layout, config)
  assert (planned.base, planned.adapters, planned.optimizer) == (
      report["memory/frozen_base_bytes_per_device"], report["memory/params_bytes_per_device"],
      report["memory/opt_state_bytes_per_device"])
  estimate = memory_model.estimate(cfg, layout, 8, 16, lora=config)
  assert (estimate.params, estimate.optimizer) == (planned.base + planned.adapters, planned.optimizer)
  assert estimate.optimizer < memory_model.estimate(cfg, layout, 8, 16).optimizer / 4  # full training's


def test_llama3_8b_base_in_nf4_is_about_a_third_of_bfloat16():
  """Bytes of llama3_8b's frozen base as stored (abstract, nothing allocated): the 32 layers' projections in
  4 bits + a float32 scale per 64, the embedding and lm_head in bfloat16."""
  cfg = _model_config("llama3_8b")
  boxed = jax.eval_shape(lambda: model_lib.GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
  sizes = {p: int(np.prod(leaf.value.shape)) for p, leaf in flax.traverse_util.flatten_dict(boxed).items()}
  projections = sum(n for p, n in sizes.items() if quantize.is_projection(p))
  others = sum(sizes.values()) - projections
  stored = {precision: quantize.stored_bytes(quantize.boxed_stored(boxed, precision)) for precision in
            ("bfloat16", "int8", "nf4")}
  assert stored["bfloat16"] == 2 * sum(sizes.values()) == 2 * 8_030_261_248
  assert stored["nf4"] == projections // 2 + 4 * projections // 64 + 2 * others
  assert stored["int8"] == projections + 4 * projections // 64 + 2 * others
  ratio = stored["nf4"] / stored["bfloat16"]
  assert 0.37 < ratio < 0.38, ratio  # 0.375: the untied 128,256-row tables stay bfloat16 (1.05 of 8.03 B weights)


@pytest.mark.slow  # two abstract compiles of llama3_8b's LoRA step on 8 fake CPU devices (nothing allocated): ≈ 20 s
def test_llama3_8b_qlora_step_takes_the_nf4_base_in_xla_memory_analysis():
  """bench/finetune_memory.py's compile of llama3_8b's LoRA step (finetune.gin, rank 8, data4×tensor2, 8 × 1,024,
  remat full): XLA's memory analysis of the compiled step counts, per device, the stored base and nothing else
  different between bfloat16 and nf4 among its arguments; nf4's is 0.39× bfloat16's (the untied 128,256-row
  tables stay bfloat16)."""
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
  import finetune_memory  # pylint: disable=g-import-not-at-top,import-outside-toplevel  (bench/finetune_memory.py)
  try:
    model_config, optimizer_config, lora_config = finetune_memory.configs("llama3_8b", 8)
  finally:
    gin.clear_config()
  model_config = dataclasses.replace(model_config, remat_policy="full")
  got = {p: finetune_memory.compile_mode(f"lora-{p}", model_config, optimizer_config, lora_config,
                                         {"data": 4, "tensor": 2}, 8, 1024) for p in ("bfloat16", "nf4")}
  assert got["bfloat16"]["arguments"] - got["bfloat16"]["base"] == got["nf4"]["arguments"] - got["nf4"]["base"]
  assert got["bfloat16"]["base"] == memory_model.lora_bytes_per_device(
      model_config, memory_model.Layout(data=4, tensor=2), dataclasses.replace(lora_config, base_precision="bfloat16")).base
  ratio = got["nf4"]["arguments"] / got["bfloat16"]["arguments"]
  assert 0.385 < got["nf4"]["base"] / got["bfloat16"]["base"] < 0.395 and 0.395 < ratio < 0.41, ratio


def test_bad_precisions_are_one_line_errors():
  with pytest.raises(ValueError, match=r"LoraConfig.base_precision='fp4' is not supported; supported: \["):
    lora.LoraConfig(rank=4, base_precision="fp4")
  with pytest.raises(ValueError, match=r"'blocks/attn/out/kernel' has an odd last axis \(33\)"):
    quantize.quantize_kernel(jnp.zeros((4, 33)), "nf4", "blocks/attn/out/kernel")


@pytest.mark.slow  # two 40-step LoRA runs (≈ 20 s on 2 cores)
def test_qlora_sft_reaches_the_held_out_loss_of_bfloat16_lora(corpus, base, tmp_path):
  """Equal steps from the same base: LoRA over an nf4 base ends within 5% of LoRA over a bfloat16 base on the
  held-out split, and both learn."""
  base_dir, _ = base

  def held_out(precision):
    config = dataclasses.replace(LORA, base_precision=precision)
    run = run_config(tmp_path / precision, corpus, base=base_dir, lora_config=config, train_steps=40,
                     eval_every=10, checkpoint_every=40)
    trainer.train(run, TINY, OPT)
    with open(os.path.join(tmp_path / precision, "metrics.jsonl"), encoding="utf-8") as f:
      records = [json.loads(line) for line in f]
    losses = [r["eval/loss"] for r in records if "eval/loss" in r]
    return losses[0], losses[-1]

  (bf16_start, bf16_end), (nf4_start, nf4_end) = held_out("bfloat16"), held_out("nf4")
  assert bf16_end < bf16_start - 0.05 and nf4_end < nf4_start - 0.05  # step 10 → 40
  assert abs(nf4_end - bf16_end) <= 0.05 * bf16_end, (nf4_end, bf16_end)
  # infer / evaluate / serve (a plain Runtime) and merge_lora read the run over the base as it trained: nf4
  run = run_config(tmp_path / "nf4", corpus, base=base_dir)
  served = jax.tree.map(np.asarray, runtime_lib.Runtime(dataclasses.replace(run, lora=None), TINY).restore_params()[1])
  merged = checkpointing.restore_params(lora.merge_checkpoint(str(tmp_path / "nf4"), str(tmp_path / "merged")))[1]
  for path, leaf in flax.traverse_util.flatten_dict(served).items():
    np.testing.assert_allclose(leaf, flax.traverse_util.flatten_dict(merged)[path], rtol=1e-6, atol=1e-6)
  adapters = checkpointing.restore_params(str(tmp_path / "nf4"))[1]
  over_float = lora.merge(checkpointing.restore_params(base_dir)[1], adapters, LORA.scale)
  assert not np.allclose(served["blocks"]["mlp_in"]["kernel"], over_float["blocks"]["mlp_in"]["kernel"], atol=1e-4)
