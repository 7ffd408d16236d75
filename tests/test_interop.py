"""Hugging Face interop against the real transformers (CPU): imported models compute HF's logits and greedy
tokens, exports load in transformers bit-exact, and bad folders fail with one named reason, writing nothing."""

import copy
import dataclasses
import json
import os
import shutil

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
from safetensors import safe_open  # pylint: disable=g-import-not-at-top
from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top

from t5x_like import cli as gin_utils  # pylint: disable=g-import-not-at-top
from t5x_like import convert  # pylint: disable=g-import-not-at-top
from t5x_like.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
from t5x_like.interop import hf  # pylint: disable=g-import-not-at-top
from t5x_like.interop import hf_config  # pylint: disable=g-import-not-at-top
from t5x_like.model import decoder  # pylint: disable=g-import-not-at-top
from t5x_like.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
from t5x_like.inference import sampling  # pylint: disable=g-import-not-at-top
from t5x_like.parallel import partitioning  # pylint: disable=g-import-not-at-top
from tests.decode_reference import engine_tokens  # pylint: disable=g-import-not-at-top
from t5x_like.training import checkpointing  # pylint: disable=g-import-not-at-top
from t5x_like.posttrain import lora  # pylint: disable=g-import-not-at-top
from t5x_like.training import config as config_lib  # pylint: disable=g-import-not-at-top
from t5x_like import data as data_lib  # pylint: disable=g-import-not-at-top
from t5x_like.training import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top
from t5x_like.training import trainer  # pylint: disable=g-import-not-at-top
from t5x_like.data import chat_synth  # pylint: disable=g-import-not-at-top
from t5x_like.data import preprocessing  # pylint: disable=g-import-not-at-top
from tests import conftest  # pylint: disable=g-import-not-at-top
from tests import test_parallelism  # pylint: disable=g-import-not-at-top
from tests.hf_reference import (  # pylint: disable=g-import-not-at-top,unused-import  (fixtures too)
    VOCAB, TEXT, MODELS, padded_batch, hf_logits, our_logits, hf_models, imported, tokenizer)


@pytest.mark.parametrize("name", list(MODELS))
def test_imported_logits_equal_transformers(name, hf_models, imported):
  model_dir, config, params = imported[name]
  assert config.vocab_size == 384 and config.valid_vocab_size == VOCAB
  assert np.all(params["token_embedding"][VOCAB:] == 0)  # padding rows
  tokens, segment_ids = padded_batch()
  ours = our_logits(config, params, tokens, segment_ids)
  theirs = hf_logits(hf_models[name][0], tokens, segment_ids)
  valid = segment_ids.astype(bool)
  assert np.abs(theirs[valid]).max() > 1.0  # logits big enough that a mapping error would show
  np.testing.assert_allclose(ours[..., :VOCAB][valid], theirs[valid], atol=1e-4, rtol=0)
  assert ours[..., VOCAB:].max() < -1e9  # padding rows are masked out of the softmax
  with open(os.path.join(model_dir, "model.gin"), encoding="utf-8") as f:
    assert f"model.GPTConfig.valid_vocab_size = {VOCAB}" in f.read()


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa", "mixtral"])  # learned positions; rope + GQA kv cache; MoE
def test_greedy_generation_equals_transformers(name, hf_models, imported):
  _, config, params = imported[name]
  prompts = [[5, 17, 42, 9, 250, 33], [7, 260, 11]]  # left-padded to 6
  tokens, segment_ids = sampling.left_pad(prompts)
  ours = engine_tokens(config, params, prompts, 10)
  with torch.no_grad():
    theirs = hf_models[name][0].generate(torch.tensor(tokens, dtype=torch.long),
                                         attention_mask=torch.tensor(segment_ids, dtype=torch.long),
                                         max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
  np.testing.assert_array_equal(np.asarray(ours), theirs[:, tokens.shape[1]:].numpy())


def _tensors(folder):
  out = {}
  for name in sorted(os.listdir(folder)):
    if name.endswith(".safetensors"):
      with safe_open(os.path.join(folder, name), framework="np") as f:
        out.update({k: f.get_tensor(k) for k in f.keys()})
  return out


@pytest.mark.parametrize("name", list(MODELS))
def test_export_loads_in_transformers_bit_exact(name, hf_models, imported, tokenizer, tmp_path):
  model, folder = hf_models[name]
  model_dir, config, params = imported[name]
  out = str(tmp_path / "exported")
  shard = 20_000 if name == "llama_gqa" else 4 << 30  # the GQA model is written as shards + index
  assert hf.export_hf(model_dir, out, config, max_shard_bytes=shard) == 0
  assert os.path.isfile(os.path.join(out, "model.safetensors.index.json")) == (name == "llama_gqa")
  original, exported = _tensors(folder), _tensors(out)
  assert sorted(exported) == sorted(original)
  for key, value in original.items():
    assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key
  loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(loaded) is type(model)
  tokens, segment_ids = padded_batch()
  valid = segment_ids.astype(bool)
  np.testing.assert_allclose(hf_logits(loaded, tokens, segment_ids)[valid],
                             our_logits(config, params, tokens, segment_ids)[..., :VOCAB][valid], atol=1e-4, rtol=0)
  loaded_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  assert loaded_tokenizer(TEXT).input_ids == tokenizer(TEXT).input_ids
  if name == "llama3_scaled":
    assert loaded.config.rope_parameters["rope_type"] == "llama3"
    assert loaded.config.rope_parameters["factor"] == 8.0


def test_export_with_a_sentencepiece_tokenizer(imported, tmp_path):
  """A model trained from scratch ships the SentencePiece model of its DATA_DIR, as tokenizer.json."""
  model_dir, config, _ = imported["gpt2"]
  sp = tokenizer_lib.train_tokenizer([TEXT * 20], str(tmp_path / "sp.model"), vocab_size=150,
                                     byte_fallback=False)
  assert sp.vocab_size <= VOCAB
  out = str(tmp_path / "exported")
  hf.export_hf(model_dir, out, config, tokenizer=sp.path)
  loaded = transformers.AutoTokenizer.from_pretrained(out)
  assert loaded(TEXT, add_special_tokens=False).input_ids == sp.encode(TEXT)
  with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
    assert json.load(f)["eos_token_id"] == sp.eos_id


def test_sharded_bfloat16_and_float16_inputs_import_exactly(hf_models, imported, tmp_path):
  model, _ = hf_models["llama_gqa"]
  _, _, f32_params = imported["llama_gqa"]
  for torch_dtype, np_dtype in ((torch.bfloat16, jnp.bfloat16), (torch.float16, np.float16)):
    folder = str(tmp_path / str(torch_dtype))
    copy.deepcopy(model).to(torch_dtype).save_pretrained(folder, max_shard_size="20KB")
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    hf.import_hf(folder, folder + ".converted")
    _, params = checkpointing.restore_params(folder + ".converted")
    want = jax.tree.map(lambda a: np.asarray(a).astype(np_dtype).astype(np.float32), f32_params)
    jax.tree.map(np.testing.assert_array_equal, params, want)
    assert jax.tree.leaves(jax.tree.map(lambda a: a.dtype == np.float32, params)) == [True] * len(jax.tree.leaves(params))


class _RunsCode:
  """A pickled object whose unpickling would call os.system: what a malicious .bin holds."""

  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return (os.system, (f"touch {self.marker}",))


def test_pytorch_bin_checkpoints_import_like_safetensors_and_code_in_them_never_runs(hf_models, imported, tmp_path):
  """pytorch_model.bin (zip, as torch.save writes it) and bin shards with an index (one in the legacy pickle
  format) import to the same parameters as the safetensors folder; a .bin that pickles code, or holds a number
  where a tensor goes, is a one-line refusal, and the code is never run."""
  model, folder = hf_models["llama_gqa"]
  _, _, want = imported["llama_gqa"]
  state = {k: v.detach().clone() for k, v in model.state_dict().items()}
  keys = sorted(state)

  def bin_folder(name, shards):
    out = str(tmp_path / name)
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    for file_name, part, legacy in shards:
      torch.save(part, os.path.join(out, file_name), _use_new_zipfile_serialization=not legacy)
    return out

  single = bin_folder("single", [("pytorch_model.bin", state, False)])
  halves = [keys[:len(keys) // 2], keys[len(keys) // 2:]]
  sharded = bin_folder("sharded", [(f"pytorch_model-0000{i + 1}-of-00002.bin", {k: state[k] for k in half}, i == 1)
                                   for i, half in enumerate(halves)])
  with open(os.path.join(sharded, "pytorch_model.bin.index.json"), "w", encoding="utf-8") as f:
    json.dump({"weight_map": {k: f"pytorch_model-0000{i + 1}-of-00002.bin" for i, half in enumerate(halves)
                              for k in half}}, f)
  for source in (single, sharded):
    hf.import_hf(source, source + ".converted")
    _, params = checkpointing.restore_params(source + ".converted")
    jax.tree.map(np.testing.assert_array_equal, params, want)

  marker = tmp_path / "code_ran"
  for name, payload, message in (("code", {"w": _RunsCode(str(marker))}, "refused: not a PyTorch file of tensors"),
                                 ("number", {"model.embed_tokens.weight": 3}, "entry 'model.embed_tokens.weight' "
                                                                              "holds a int, not a tensor")):
    bad = bin_folder(name, [("pytorch_model.bin", payload, False)])
    with pytest.raises(ValueError, match=message) as error:
      hf.import_hf(bad, bad + ".converted")
    assert "\n" not in str(error.value) and os.path.join(bad, "pytorch_model.bin") in str(error.value)
    assert not os.path.exists(bad + ".converted")
  assert not marker.exists()  # the pickled os.system call was refused before it was made


def test_imported_checkpoint_restores_onto_a_sharded_mesh(imported):
  """What a warm start does: restore onto abstract params carrying a (data, tensor) mesh's shardings."""
  model_dir, config, params = imported["llama_gqa"]
  mesh = mesh_lib.create_mesh({"pipeline": 1, "data": 2, "fsdp": 2, "tensor": 2})
  boxed = jax.eval_shape(lambda: decoder.GPT(config).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
  shardings = partitioning.shardings_from_boxed(boxed["params"], mesh, partitioning.DEFAULT_RULES)
  abstract = checkpointing.abstract_with_shardings(partitioning.unbox(boxed["params"]), shardings)
  _, restored = checkpointing.restore_params(model_dir, abstract_params=abstract)
  kernel = restored["blocks"]["attn"]["key_value"]["kernel"]
  assert kernel.sharding == shardings["blocks"]["attn"]["key_value"]["kernel"]
  jax.tree.map(lambda r, p: np.testing.assert_array_equal(np.asarray(r), p), restored, params)


def test_model_gin_drives_training_and_export(imported, tmp_path):
  """train/infer/evaluate parse model.gin + a run config; to_hf reads model.gin, or a run's config.gin."""
  model_dir, config, _ = imported["llama3_scaled"]
  fields = lambda c: {name: getattr(c, name) for name in hf_config.MODEL_FIELDS}
  gin.clear_config()
  try:
    gin_utils.parse_gin([os.path.join(model_dir, "model.gin"), "configs/runs/finetune.gin"],
                        ["MODEL_DIR='/run'", "DATA_DIR='/data'", f"INITIAL_CHECKPOINT_PATH='{model_dir}'"])
    trained = gin_utils.configured(decoder.GPTConfig, "model")
    operative = gin.operative_config_str()  # what the trainer writes to MODEL_DIR/config.gin
    gin.clear_config()
    exported = convert.export_config(model_dir, [], [], ["."])
    gin.clear_config()
    (tmp_path / "config.gin").write_text(operative)
    from_run = convert.export_config(str(tmp_path), [], [], ["."])
  finally:
    gin.clear_config()
  assert fields(trained) == fields(exported) == fields(from_run) == fields(config)
  assert trained.dtype == "bfloat16"  # the run config's, not the converted model's


def test_export_refuses_a_nonzero_output_bias(imported, tmp_path):
  model_dir, config, params = imported["llama_gqa"]
  assert "bias" in params["lm_head"]  # our untied head has a bias; HF Llama's has none
  changed = jax.tree.map(np.copy, params)
  changed["lm_head"]["bias"][3] = 0.5
  run_dir = str(tmp_path / "run")
  manager = checkpointing.make_manager(run_dir, async_save=False)
  checkpointing.save(manager, 7, {"params": changed})
  manager.close()
  with pytest.raises(ValueError, match="lm_head/bias is nonzero"):
    hf.export_hf(run_dir, str(tmp_path / "out"), config)
  assert not os.path.exists(tmp_path / "out")


def test_export_merges_a_lora_run_into_its_base(imported, tokenizer, tmp_path):
  """A LoRA run's checkpoint holds adapters and its base's path: the export is W + alpha/rank · A·B, and
  the tokenizer comes from the base (the converted model), which the run folder lacks."""
  model_dir, config, params = imported["llama_gqa"]
  boxed = jax.eval_shape(lambda: decoder.GPT(config).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
  lora_config = lora.LoraConfig(rank=2, alpha=4.0, targets="blocks/attn/(query|out)/kernel")
  kernels = lora.target_kernels(boxed["params"], lora_config.targets)
  adapters = nn.meta.unbox(lora.init_adapters(jax.random.key(1), kernels, lora_config))
  rng = np.random.default_rng(0)
  adapters = jax.tree.map(lambda a: np.asarray(a) + 0.2 * rng.standard_normal(a.shape).astype(np.float32), adapters)
  run = str(tmp_path / "lora_run")
  checkpointing.save_params(run, adapters, 5, {"lora": {"base": os.path.join(model_dir, "checkpoints", "0"),
                                                        "rank": 2, "alpha": 4.0, "targets": lora_config.targets}})
  out = str(tmp_path / "merged")
  assert hf.export_hf(run, out, config) == 5
  merged = lora.merge(params, adapters, 2.0)
  tokens, segment_ids = padded_batch()
  valid = segment_ids.astype(bool)
  ours = our_logits(config, merged, tokens, segment_ids)[..., :VOCAB][valid]
  assert np.abs(ours - our_logits(config, params, tokens, segment_ids)[..., :VOCAB][valid]).max() > 0.1
  loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  np.testing.assert_allclose(hf_logits(loaded, tokens, segment_ids)[valid], ours, atol=1e-4, rtol=0)
  assert transformers.AutoTokenizer.from_pretrained(out)(TEXT).input_ids == tokenizer(TEXT).input_ids


def test_imported_mixtral_routes_like_transformers(imported):
  """The config mapping of a Mixtral (the logits and export tests above run it like the other models): dropless
  top-2 routing over 4 experts in every layer, HF's load-balancing coefficient scaled to our per-choice-averaged
  loss, no router z-loss; to_hf writes the config back."""
  model_dir, config, params = imported["mixtral"]
  assert (config.num_experts, config.moe_top_k, config.moe_every, config.expert_d_ff) == (4, 2, 1, 48)
  assert config.moe_dropless and config.moe_router_z_weight == 0.0 and not config.use_bias
  assert config.moe_load_balancing_weight == pytest.approx(0.04)  # router_aux_loss_coef 0.02 × top_k 2
  assert params["blocks"]["moe"]["mlp_gate"]["kernel"].shape == (2, 4, 32, 48)
  with open(os.path.join(model_dir, "model.gin"), encoding="utf-8") as f:
    assert "model.GPTConfig.moe_dropless = True" in f.read()
  written = hf_config.to_hf(config)
  assert written["router_aux_loss_coef"] == pytest.approx(0.02) and written["num_local_experts"] == 4
  assert hf_config.from_hf(written, "x")[1] == dataclasses.replace(config, dtype="bfloat16")


def test_export_refuses_models_no_hf_class_computes(imported):
  _, config, _ = imported["llama_gqa"]
  with pytest.raises(ValueError, match=r"GPTConfig.use_bias=True: .* \(MixtralForCausalLM needs no biases\)"):
    hf_config.export_architecture(dataclasses.replace(config, num_experts=4))
  mixtral = imported["mixtral"][1]
  for key, value in (("moe_top_k", 1), ("moe_every", 2)):
    with pytest.raises(ValueError, match=f"GPTConfig.{key}={value}: this mixture-of-experts model does not export"):
      hf_config.export_architecture(dataclasses.replace(mixtral, **{key: value}))
  with pytest.raises(ValueError, match="no Hugging Face architecture computes this model"):
    hf_config.export_architecture(dataclasses.replace(config, position_embedding="learned"))


# ---------------------------------------------------------------------------------------------------------
# Bad input: one named reason, nothing written.


def _edit_config(folder, drop=None, **changes):
  path = os.path.join(folder, "config.json")
  with open(path, encoding="utf-8") as f:
    config = json.load(f)
  config.update(changes)
  config.pop(drop, None)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(config, f)


def _edit_tensors(folder, edit):
  path = os.path.join(folder, "model.safetensors")
  with safe_open(path, framework="np") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  edit(tensors)
  save_file(tensors, path, metadata={"format": "pt"})


def _edit_tokenizer(folder):
  path = os.path.join(folder, "tokenizer.json")
  with open(path, encoding="utf-8") as f:
    spec = json.load(f)
  spec["added_tokens"].append({**spec["added_tokens"][0], "id": VOCAB + 5, "content": "<|extra|>"})
  with open(path, "w", encoding="utf-8") as f:
    json.dump(spec, f)


BAD = {
    "no_config": ("gpt2", lambda d: os.remove(os.path.join(d, "config.json")), "no config.json"),
    "no_weights": ("gpt2", lambda d: os.remove(os.path.join(d, "model.safetensors")), "no weights"),
    "architecture": ("gpt2", lambda d: _edit_config(d, architectures=["BertForMaskedLM"]),
                     r"'BertForMaskedLM'\] is not supported; supported: GPT2LMHeadModel .*LlamaForCausalLM"),
    "shape": ("gpt2", lambda d: _edit_tensors(d, lambda t: t.update(
        {"transformer.h.1.mlp.c_fc.bias": t["transformer.h.1.mlp.c_fc.bias"][:-1]})),
              r"'transformer.h.1.mlp.c_fc.bias' has shape \(63,\) but config.json gives \(64,\)"),
    "missing_tensor": ("gpt2", lambda d: _edit_tensors(d, lambda t: t.pop("transformer.h.0.ln_2.bias")),
                       "'transformer.h.0.ln_2.bias' is missing"),
    "extra_tensor": ("gpt2", lambda d: _edit_tensors(d, lambda t: t.update(score=np.zeros((2, 32), np.float32))),
                     r"have no place in this model, e.g. \['score'\]"),
    "quantized": ("gpt2", lambda d: _edit_tensors(d, lambda t: t.update(
        {"transformer.h.1.attn.c_proj.weight": t["transformer.h.1.attn.c_proj.weight"].astype(np.int8)})),
                  "'transformer.h.1.attn.c_proj.weight' has dtype I8"),
    "tokenizer": ("gpt2", _edit_tokenizer, "the tokenizer has 301 tokens but the embedding has 300 rows"),
    "missing_key": ("llama3_scaled", lambda d: _edit_config(d, drop="intermediate_size"),
                    "LlamaForCausalLM needs 'intermediate_size', which is missing"),
    "gelu": ("gpt2", lambda d: _edit_config(d, activation_function="gelu"), "activation_function='gelu'"),
    "rope_type": ("llama3_scaled", lambda d: _edit_config(d, rope_parameters={"rope_type": "yarn", "factor": 4.0}),
                  "rope_type='yarn' is not supported; supported: \\['default', 'llama3'\\]"),
    "sliding_window": ("llama3_scaled", lambda d: _edit_config(d, sliding_window=16), "sliding_window=16"),
    "bias_mismatch": ("llama3_scaled", lambda d: _edit_config(d, attention_bias=True, mlp_bias=False),
                      "attention_bias=True but mlp_bias=False"),
    "mixtral_top1": ("mixtral", lambda d: _edit_config(d, num_experts_per_tok=1),
                     "num_experts_per_tok=1 is not supported"),
    "mixtral_sliding_window": ("mixtral", lambda d: _edit_config(d, sliding_window=16),
                               r"sliding_window=16 is not supported .*max_position_embeddings=64"),
    "mixtral_missing_key": ("mixtral", lambda d: _edit_config(d, drop="num_local_experts"),
                            "MixtralForCausalLM needs 'num_local_experts', which is missing"),
    "mixtral_missing_expert": ("mixtral", lambda d: _edit_tensors(
        d, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight")),
                               "'model.layers.1.block_sparse_moe.experts.3.w2.weight' is missing"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_named_error_and_writes_nothing(case, hf_models, tmp_path):
  name, edit, message = BAD[case]
  folder = str(tmp_path / "hf")
  shutil.copytree(hf_models[name][1], folder)
  edit(folder)
  out = tmp_path / "out"
  with pytest.raises((ValueError, OSError), match=message) as error:
    hf.import_hf(folder, str(out))
  assert "\n" not in str(error.value)
  assert sorted(os.listdir(tmp_path)) == ["hf"]  # neither the output nor a temporary folder


def test_output_folder_is_never_overwritten(hf_models, tmp_path):
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "keep.txt").write_text("mine")
  with pytest.raises(FileExistsError, match="exists and is not empty"):
    hf.import_hf(hf_models["gpt2"][1], str(tmp_path / "out"))
  assert os.listdir(tmp_path / "out") == ["keep.txt"]


@pytest.mark.slow
def test_cli_exports_with_model_gin_and_fails_in_one_line(hf_models, imported, tmp_path):
  """to_hf from a converted model's folder (its model.gin) writes HF's tensors back exactly; from_hf on a folder
  without config.json exits 1 with one line on stderr and writes nothing."""
  done, failed = conftest.launch_each("t5x_like.convert", [
      ["to_hf", f"--model_dir={imported['llama_gqa'][0]}", f"--output_dir={tmp_path / 'hf'}"],
      ["from_hf", f"--hf_dir={tmp_path}", f"--output_dir={tmp_path / 'again'}"]])
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.startswith(f"wrote {tmp_path / 'hf'} from "), done.stdout
  original, exported = _tensors(hf_models["llama_gqa"][1]), _tensors(str(tmp_path / "hf"))
  assert sorted(original) == sorted(exported)
  assert all(np.array_equal(original[k], exported[k]) for k in original)
  assert failed.returncode == 1
  assert failed.stderr.strip().splitlines() == [f"error: {tmp_path}: no config.json: not a Hugging Face model folder"]
  assert not os.path.exists(tmp_path / "again")


# ----------------------------------------------------------------------------------------------------
# An imported model is an ordinary t5x_like model: every kind of layout, exact resume, fine-tuning.


@pytest.fixture(scope="module")
def imported_llama_reference(imported):
  _, config, params = imported["llama_gqa"]
  initial = test_parallelism.host_initial_state(config).replace(params=jax.tree.map(np.asarray, params))
  return config, initial, test_parallelism.train(initial, {"data": 1}, devices=jax.devices()[:1], base=config)


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
def test_imported_llama_trains_on_every_kind_of_split_like_one_device(imported_llama_reference):
  """The imported grouped-query Llama (padded vocabulary rows masked) from its converted weights: one layout that
  splits over pipeline (2 layers: one stage a device), fsdp and tensor trains exactly like one device
  (test_parallelism's tolerances, test_llama's parameter atol; the generic layouts are test_parallelism's)."""
  config, initial, reference = imported_llama_reference
  result = test_parallelism.train(initial, {"pipeline": 2, "fsdp": 2, "tensor": 2}, base=config)
  test_parallelism.assert_same_training(result, reference, param_atol=5e-6)


@pytest.mark.slow  # preprocesses a chat corpus and launches two short fine-tuning runs
def test_imported_llama_fine_tunes_on_chat_data_and_resumes_bit_exactly(imported, tmp_path):
  """SFT of the imported Llama with its own Hugging Face tokenizer (INITIAL_CHECKPOINT_PATH = the converted
  folder): the loss on the assistant tokens falls, and its step-3 checkpoint resumed to 6 equals 6 straight
  steps."""
  model_dir, config, _ = imported["llama_gqa"]
  train_file, _ = chat_synth.write_synthetic_chat(str(tmp_path / "chat"), task="reverse", num_train=300,
                                                 num_test=10, seed=0)
  data_dir = str(tmp_path / "data")
  preprocessing.preprocess_chat([train_file], data_dir, tokenizer=model_dir, validation_fraction=0.05)
  opt = optimizer_lib.OptimizerConfig(learning_rate=3e-3, warmup_steps=1, decay="constant")

  def run(run_dir, steps):
    run_config = config_lib.TrainConfig(
        model_dir=str(run_dir), data_dir=data_dir, train_steps=steps, batch_size=8, seq_len=32, log_every=1,
        eval_every=0, checkpoint_every=3, mesh_shape={"data": -1},
        data=data_lib.DataConfig(eval_batches=1, shuffle_buffer=64),
        checkpoint=checkpointing.CheckpointConfig(async_save=False, warm_start_from=model_dir, warm_start_required=True))
    trainer.train(run_config, config, opt)
    return {r["step"]: r["loss"] for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))
            if "loss" in r}

  straight = run(tmp_path / "straight", 6)
  resumed = run(conftest.rewind(tmp_path / "straight", tmp_path / "resumed", 3), 6)  # its step-3 checkpoint on
  assert resumed == {step: straight[step] for step in (4, 5, 6)}
  assert straight[6] < straight[1] - 0.2, straight
  digests = [checkpointing.params_digest(checkpointing.restore_params(str(tmp_path / name))[1])
             for name in ("straight", "resumed")]
  assert digests[0] == digests[1]
