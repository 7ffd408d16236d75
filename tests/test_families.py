"""Qwen2, Qwen3, Mistral, Gemma 2 and Gemma 3 on the one decoder (qkv_bias, qk_norm, sliding_window; Gemma's (1 + w)
norms before and after each sublayer, GeGLU, scaled embeddings, query scale, soft-capping, local layers between
global ones with their own rotary base) against the real transformers (CPU, small random models built here, no hub
download): imported logits on left- and right-padded batches, exports that transformers reloads bit-exact, greedy
tokens, decoding past the sliding window, packed documents under the window, and every option training on mesh
layouts like one device. Configs, parameter counts, cost models and refusals: tests/test_family_configs.py."""

import dataclasses
import os
import shutil

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from t5x_like.inference import sampling  # pylint: disable=g-import-not-at-top
from t5x_like.interop import hf  # pylint: disable=g-import-not-at-top
from t5x_like.interop import hf_config  # pylint: disable=g-import-not-at-top
from t5x_like.model import decoder  # pylint: disable=g-import-not-at-top
from t5x_like.model import layers  # pylint: disable=g-import-not-at-top
from t5x_like.observe import flops  # pylint: disable=g-import-not-at-top
from t5x_like.training import checkpointing  # pylint: disable=g-import-not-at-top
from tests import interrupt  # pylint: disable=g-import-not-at-top
from tests import test_fault_tolerance  # pylint: disable=g-import-not-at-top
from tests import test_parallelism  # pylint: disable=g-import-not-at-top
from tests.decode_reference import engine_tokens, generate_by_recompute  # pylint: disable=g-import-not-at-top
from tests.hf_reference import COMMON, INIT, VOCAB, padded_batch, save_tokenizer  # pylint: disable=g-import-not-at-top
from tests.test_interop import _tensors  # pylint: disable=g-import-not-at-top

WINDOW = 5  # Mistral's window: shorter than every test sequence
ARCH = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64)
FAMILIES = {
    # multi-head (our fused qkv slots carry the biases), tied embeddings as the small Qwen2.5 models have them
    "qwen2": (transformers.Qwen2Config, dict(ARCH, num_key_value_heads=4, tie_word_embeddings=True,
                                             rope_theta=1000.0)),
    # grouped-query, untied; heads of 16 while hidden_size / heads = 8 (as Qwen3-0.6B..4B: 128 apart from d_model)
    "qwen3": (transformers.Qwen3Config, dict(ARCH, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)),
    "mistral": (transformers.MistralConfig, dict(ARCH, num_key_value_heads=2, sliding_window=WINDOW,
                                                 tie_word_embeddings=False)),
    # Qwen2's window on every layer (max_window_layers 0): qkv_bias and sliding_window together
    "qwen2_window": (transformers.Qwen2Config, dict(ARCH, num_key_value_heads=2, tie_word_embeddings=False,
                                                    use_sliding_window=True, sliding_window=WINDOW,
                                                    max_window_layers=0)),
    # local, global (layer_types' default for Gemma 2); caps low enough that tanh bends the logits of this model
    "gemma2": (transformers.Gemma2Config, dict(ARCH, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                                               query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                               final_logit_softcapping=3.0)),
    # local, local, global; the global layers' rotary base linearly scaled, the local ones' their own base
    "gemma3": (transformers.Gemma3TextConfig, dict(
        ARCH, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
        query_pre_attn_scalar=12, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
}
GEMMA = dict(norm="rmsnorm_plus_one", post_norms=True, mlp_activation="geglu", scale_embeddings=True, use_bias=False,
             tie_embeddings=True, attention_head_dim=16, sliding_window=WINDOW)
OPTIONS = {"qwen2": dict(qkv_bias=True, use_bias=False, tie_embeddings=True),
           "qwen3": dict(qk_norm=True, use_bias=False, tie_embeddings=False, attention_head_dim=16),
           "mistral": dict(sliding_window=WINDOW, use_bias=False, tie_embeddings=False),
           "qwen2_window": dict(qkv_bias=True, sliding_window=WINDOW, use_bias=False, tie_embeddings=False),
           "gemma2": dict(GEMMA, sliding_window_pattern=2, attention_scale_dim=24, attention_softcap=2.0,
                          final_logit_softcap=3.0, rope_local_theta=0.0),
           "gemma3": dict(GEMMA, qk_norm=True, sliding_window_pattern=3, attention_scale_dim=12, rope_theta=1000.0,
                          rope_scaling="linear", rope_scaling_factor=2.0, rope_local_theta=100.0)}
LEFT_PADDED = [[5, 17, 42, 9, 250, 33, 8, 71, 120, 3, 99, 64], [7, 260, 11, 40, 2, 19, 77], [31, 6, 210, 45]]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
  """name → (HF model in float32 eval mode, its folder, our MODEL_DIR, float32 GPTConfig, params)."""
  tokenizer = save_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))
  out = {}
  for i, (name, (config_cls, kwargs)) in enumerate(FAMILIES.items()):
    torch.manual_seed(10 + i)
    config = config_cls(**COMMON, initializer_range=INIT, **kwargs)
    config._attn_implementation = "eager"  # pylint: disable=protected-access
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # transformers starts biases at 0 and norm scales at 1: a mapping error would not show
      for key, p in model.named_parameters():
        if key.endswith("bias") or "norm" in key:
          p.normal_(1.0 if "norm" in key else 0.0, 0.5)
    folder = str(tmp_path_factory.mktemp(name))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model_dir = str(tmp_path_factory.mktemp("imported") / name)
    ours = hf.import_hf(folder, model_dir)
    _, params = checkpointing.restore_params(model_dir)
    out[name] = (model, folder, model_dir, dataclasses.replace(ours, dtype="float32"), params)
  return out


def _logits_pair(model, config, params, tokens, segment_ids):
  """(ours, transformers') float32 logits, the positions counting each row's real tokens from 0."""
  positions = np.maximum(np.cumsum(segment_ids, axis=1) - 1, 0).astype(np.int32)
  ours = np.asarray(jax.jit(decoder.GPT(config).apply)({"params": params}, tokens, positions, segment_ids))
  with torch.no_grad():
    theirs = model(torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(segment_ids),
                   position_ids=torch.tensor(positions, dtype=torch.long)).logits.numpy()
  return ours[..., :VOCAB], theirs


@pytest.mark.parametrize("name", list(FAMILIES))
def test_imported_logits_equal_transformers(name, families):
  model, _, model_dir, config, params = families[name]
  assert {k: getattr(config, k) for k in OPTIONS[name]} == OPTIONS[name]
  for tokens, segment_ids in (sampling.left_pad(LEFT_PADDED), padded_batch()):  # left-, then right-padded
    tokens, segment_ids = np.asarray(tokens), np.asarray(segment_ids)
    ours, theirs = _logits_pair(model, config, params, tokens, segment_ids)
    valid = segment_ids.astype(bool)
    assert np.abs(theirs[valid]).max() > 1.0  # logits big enough that a mapping error would show
    np.testing.assert_allclose(ours[valid], theirs[valid], atol=1e-4, rtol=0)
  with open(os.path.join(model_dir, "model.gin"), encoding="utf-8") as f:
    gin_text = f.read()
  assert all(f"model.GPTConfig.{k} = {v!r}" in gin_text for k, v in OPTIONS[name].items())


def test_xla_attention_keeps_the_attention_softcap(families):
  """attention_impl='xla' (pretrain.gin's) on Gemma 2: jax.nn.dot_product_attention cannot cap, so the einsum path
  runs and the logits still equal transformers'."""
  model, _, _, config, params = families["gemma2"]
  tokens, segment_ids = (np.asarray(a) for a in padded_batch())
  ours, theirs = _logits_pair(model, dataclasses.replace(config, attention_impl="xla"), params, tokens, segment_ids)
  valid = segment_ids.astype(bool)
  np.testing.assert_allclose(ours[valid], theirs[valid], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_the_window_is_what_makes_long_sequences_match(name, families):
  """12 tokens through a window of 5 (Gemma 2: in its local layer only): the same model with full causal attention
  is far from transformers."""
  model, _, _, config, params = families[name]
  tokens, segment_ids = (np.asarray(a) for a in sampling.left_pad(LEFT_PADDED))
  full_causal = dataclasses.replace(config, sliding_window=0, sliding_window_pattern=0)
  full, theirs = _logits_pair(model, full_causal, params, tokens, segment_ids)
  late = np.zeros_like(segment_ids, bool)
  late[0, WINDOW:] = True  # the first row's tokens that have more than WINDOW predecessors
  assert np.abs(full[late] - theirs[late]).max() > 1e-2
  early = np.zeros_like(late)
  early[0, :WINDOW] = True  # ... and those that do not are unaffected
  np.testing.assert_allclose(full[early], theirs[early], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_export_reloads_in_transformers_bit_exact(name, families, tmp_path):
  model, folder, model_dir, config, _ = families[name]
  out = str(tmp_path / "exported")
  assert hf.export_hf(model_dir, out, config) == 0
  original, exported = _tensors(folder), _tensors(out)
  assert sorted(exported) == sorted(original)
  for key, value in original.items():
    assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key
  loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
  assert type(loaded) is type(model)
  assert loaded.config.tie_word_embeddings == model.config.tie_word_embeddings
  assert loaded.config.sliding_window == model.config.sliding_window


# Fast subset: Mistral (decoding past its window); CI runs the Qwen models too.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n != "mistral" else n for n in FAMILIES])
def test_greedy_generation_equals_transformers(name, families):
  """Left-padded prompts; Mistral's rows decode past the window (7 + 6 tokens, window 5)."""
  model, _, _, config, params = families[name]
  prompts = LEFT_PADDED[1:]
  tokens, segment_ids = sampling.left_pad(prompts)
  ours = engine_tokens(config, params, prompts, 6)
  with torch.no_grad():
    theirs = model.generate(torch.tensor(tokens, dtype=torch.long),
                            attention_mask=torch.tensor(segment_ids, dtype=torch.long),
                            max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
  np.testing.assert_array_equal(ours, theirs[:, tokens.shape[1]:].numpy())


@pytest.mark.slow  # fast subset: test_greedy_generation_equals_transformers[mistral] decodes past the window
@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_decoding_past_the_window_equals_recompute(name, families):
  """The KV cache keeps every column; the window mask must hide those more than W − 1 behind the query (Gemma 3:
  in its local layers, while its global layer reads them all)."""
  _, _, _, config, params = families[name]
  prompts = np.array([LEFT_PADDED[0][:4], LEFT_PADDED[1][:4]], np.int32)
  cached = engine_tokens(config, params, prompts, 7)
  recomputed = generate_by_recompute(params, prompts, config=config, max_new_tokens=7)
  np.testing.assert_array_equal(cached, np.asarray(recomputed))


def test_packed_documents_stay_isolated_under_the_window(families):
  """A document packed after another sees only its own last W tokens: its logits are those it has alone."""
  _, _, _, config, params = families["mistral"]
  rng = np.random.RandomState(1)
  doc_a, doc_b = rng.randint(0, VOCAB, 6), rng.randint(0, VOCAB, 10)
  packed = np.concatenate([doc_a, doc_b])[None].astype(np.int32)
  segments = np.array([[1] * 6 + [2] * 10], np.int32)
  positions = np.array([list(range(6)) + list(range(10))], np.int32)
  apply = jax.jit(decoder.GPT(config).apply)
  packed_logits = apply({"params": params}, packed, positions, segments)
  alone = apply({"params": params}, doc_b[None].astype(np.int32))
  np.testing.assert_allclose(packed_logits[0, 6:], alone[0], rtol=1e-5, atol=1e-5)


def test_projection_flops_count_the_real_head_width(families):
  """With attention_head_dim (16 ≠ d_model / H = 8) the FLOP count's projections are the parameters' real
  shapes (every matmul weight once, q/k norms and the untied head included) and attention spans H·Dh."""
  cfg = families["qwen3"][3]
  l, d, dh, v = cfg.num_layers, cfg.d_model, cfg.head_dim, cfg.vocab_size
  assert cfg.num_heads * dh != d
  assert flops.matmul_params(cfg) == l * (flops.block_projection_params(cfg) + 2 * d + 2 * dh) + d + v * d
  attention = flops.forward_flops_per_token(cfg, 12) - 2.0 * flops.matmul_params(cfg)
  assert attention == 4.0 * l * 12 * cfg.num_heads * dh  # QKᵀ and probs·V over the H·Dh query width


LAYOUT_BASE = dataclasses.replace(test_parallelism.CFG, num_layers=2, norm="rmsnorm", mlp_activation="swiglu",
                                  position_embedding="rope", num_kv_heads=4, use_bias=False, qkv_bias=True,
                                  qk_norm=True, sliding_window=6)


# Every Gemma option at once (Gemma 2's soft-capping with Gemma 3's qk-norm and per-kind rotary bases): 4 layers with
# every third global (local, local, global, local), so a pipeline stage that took its chunk for the first layers would
# make layer 2 local and fail the comparison.
GEMMA_LAYOUT = dataclasses.replace(
    test_parallelism.CFG, num_layers=4, norm="rmsnorm_plus_one", post_norms=True, mlp_activation="geglu",
    scale_embeddings=True, position_embedding="rope", num_kv_heads=4, use_bias=False, qk_norm=True, sliding_window=6,
    sliding_window_pattern=3, rope_theta=1000.0, rope_scaling="linear", rope_scaling_factor=2.0,
    rope_local_theta=100.0, attention_scale_dim=12, attention_softcap=5.0, final_logit_softcap=10.0)


@pytest.mark.slow  # ~30 s on 2 cores
def test_gemma_options_train_on_data_fsdp_tensor_and_interleaved_pipeline_like_one_device():
  """On data2×fsdp2×tensor2 and on pipeline2×data2×tensor2 with two virtual stages a device (chunks of one layer:
  stage 0 runs layers 0 and 2, stage 1 layers 1 and 3)."""
  initial = test_parallelism.host_initial_state(GEMMA_LAYOUT)
  reference = test_parallelism.train(initial, {"data": 1}, devices=jax.devices()[:1], base=GEMMA_LAYOUT)
  test_parallelism.assert_same_training(
      test_parallelism.train(initial, {"data": 2, "fsdp": 2, "tensor": 2}, base=GEMMA_LAYOUT), reference)
  test_parallelism.assert_same_training(
      test_parallelism.train(initial, {"pipeline": 2, "data": 2, "tensor": 2}, pipeline_microbatches=2,
                             pipeline_repeats=2, base=GEMMA_LAYOUT), reference,
      param_atol=test_parallelism.NEAR_ZERO_GRAD_PARAM_ATOL)


@pytest.mark.slow  # two in-process trainings, ~25 s on 2 cores
def test_gemma_options_resume_bit_for_bit(tmp_path, corpus):
  """A 6-step run of a model with every Gemma option (2 layers: local, global) checkpointed at 2, 4 and 6 loses
  checkpoints 4 and 6; the relaunch redoes steps 3..6 with the same losses and ends on the same parameters."""
  model = {k: getattr(GEMMA_LAYOUT, k) for k in hf_config.MODEL_FIELDS if k not in ("vocab_size", "max_len")}
  model.update(num_layers=2, sliding_window_pattern=2, d_model=32, num_heads=2, num_kv_heads=0, d_ff=64)
  test_fault_tolerance._train(tmp_path, corpus, model_overrides=model)  # pylint: disable=protected-access
  digest = lambda: checkpointing.params_digest(checkpointing.restore_params(str(tmp_path))[1])
  first, losses = digest(), interrupt.losses(str(tmp_path))
  for step in (4, 6):
    shutil.rmtree(os.path.join(checkpointing.checkpoint_dir(str(tmp_path)), str(step)))
  test_fault_tolerance._train(tmp_path, corpus, model_overrides=model)  # pylint: disable=protected-access
  resumed = interrupt.losses(str(tmp_path))
  assert [resumed[s] for s in range(3, 7)] == [[losses[s][0]] * 2 for s in range(3, 7)]
  assert losses[6][0] < losses[1][0] and digest() == first


@pytest.mark.slow  # ~40 s on 2 cores
def test_all_three_options_train_on_data_fsdp_tensor_and_pipeline_like_one_device():
  """qkv_bias + qk_norm + sliding_window (6 < the 16-token rows of packed documents) on data2×fsdp2×tensor2 and on
  pipeline2×data2×tensor2 (each stage rebuilds the windowed mask of its microbatch)."""
  initial = test_parallelism.host_initial_state(LAYOUT_BASE)
  reference = test_parallelism.train(initial, {"data": 1}, devices=jax.devices()[:1], base=LAYOUT_BASE)
  for mesh_shape in ({"data": 2, "fsdp": 2, "tensor": 2}, {"pipeline": 2, "data": 2, "tensor": 2}):
    test_parallelism.assert_same_training(test_parallelism.train(initial, mesh_shape, base=LAYOUT_BASE), reference)


def test_blocked_causal_attention_skips_only_keys_outside_the_window():
  """causal_attention by blocks of 4 query rows with window 3 equals plain attention under the window mask."""
  rng = np.random.RandomState(0)
  q, k, v = (jax.numpy.asarray(rng.normal(size=(2, 16, 4, 8)), jax.numpy.float32) for _ in range(3))
  segment_ids = np.array([[1] * 16, [1] * 7 + [2] * 7 + [0] * 2], np.int32)
  mask = layers.causal_segment_mask(jax.numpy.asarray(segment_ids), 3)
  assert int(mask[0, 0, 10].sum()) == 3 and bool(mask[0, 0, 10, 8]) and not bool(mask[0, 0, 10, 7])
  blocked = layers.causal_attention(q, k, v, mask, block=4, window=3)
  real = np.asarray(segment_ids != 0)
  np.testing.assert_allclose(np.asarray(blocked)[real], np.asarray(layers.reference_attention(q, k, v, mask))[real],
                             rtol=1e-6, atol=1e-6)
