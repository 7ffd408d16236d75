"""Llama-family options on the one decoder: RMSNorm, SwiGLU, rotary positions (with Llama-3 scaling),
grouped-query attention, bias-free projections, untied head, padded vocabulary rows.

Equality with Hugging Face's LlamaForCausalLM is checked in test_interop.py; here: the options train
on an interleaved pipeline × data × tensor layout like one device (tolerances of test_parallelism.py), packed documents
stay isolated under rotary positions, the KV cache (K heads only) gives the recompute's tokens,
padding rows are never predicted, and parameter / FLOP counts match the published shapes.
"""

import dataclasses

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like import cli
from t5x_like.model import config as config_lib
from t5x_like.model import decoder as model_lib
from t5x_like.model import layers
from t5x_like.observe import flops
from t5x_like.parallel import partitioning
from tests import test_parallelism
from tests.decode_reference import engine_tokens, generate_by_recompute

pytestmark = pytest.mark.run_bound  # tests/conftest.py: 10 s longer at level 0 with the cache warm

LLAMA = dataclasses.replace(test_parallelism.CFG, norm="rmsnorm", mlp_activation="swiglu", position_embedding="rope",
                            num_kv_heads=4, use_bias=False, tie_embeddings=False)
SMALL = model_lib.GPTConfig(vocab_size=128, max_len=32, num_layers=2, num_heads=4, num_kv_heads=2, d_model=32,
                            d_ff=48, dtype="float32", norm="rmsnorm", mlp_activation="swiglu",
                            position_embedding="rope", use_bias=False, tie_embeddings=False)


@pytest.fixture(scope="module")
def llama_initial_state():
  return test_parallelism.host_initial_state(LLAMA)


@pytest.fixture(scope="module")
def llama_reference(llama_initial_state):
  return test_parallelism.train(llama_initial_state, {"data": 1}, devices=jax.devices()[:1], base=LLAMA)


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
def test_llama_layout_trains_like_one_device(llama_initial_state, llama_reference):
  """Grouped-query heads split over `tensor` with their query groups; positions travel through the interleaved
  pipeline. One layout: the generic layouts are tests/test_parallelism.py's."""
  layout = "pipeline2_data2_tensor2_v2"
  result = test_parallelism.train(llama_initial_state, **test_parallelism.LAYOUTS[layout], base=LLAMA)
  test_parallelism.assert_same_training(result, llama_reference, param_atol=test_parallelism.NEAR_ZERO_GRAD_PARAM_ATOL)


def test_llama_parameters_are_the_contract_tree():
  shapes = jax.eval_shape(lambda: model_lib.GPT(LLAMA).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
  tree = jax.tree.map(lambda x: x.shape, partitioning.unbox(shapes["params"]))
  l, d, h, k, dh, f, v = 4, 64, 8, 4, 8, 256, 256
  assert tree == {"token_embedding": (v, d), "ln_f": {"scale": (d,)}, "lm_head": {"kernel": (d, v)},
                  "blocks": {"ln_1": {"scale": (l, d)}, "ln_2": {"scale": (l, d)},
                             "attn": {"query": {"kernel": (l, d, h, dh)}, "key_value": {"kernel": (l, d, 2, k, dh)},
                                      "out": {"kernel": (l, h, dh, d)}},
                             "mlp_gate": {"kernel": (l, d, f)}, "mlp_in": {"kernel": (l, d, f)},
                             "mlp_out": {"kernel": (l, f, d)}}}
  names = jax.tree.map(lambda b: tuple(b.names), shapes["params"]["blocks"]["attn"]["key_value"],
                       is_leaf=lambda b: hasattr(b, "names"))
  assert names["kernel"] == ("layers", "embed", None, "kv_heads", "kv")


@pytest.fixture(scope="module")
def small_params():
  return partitioning.unbox(model_lib.GPT(SMALL).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])


def test_rotary_packed_documents_equal_each_document_alone(small_params):
  """Each document restarts its positions, so its rotary angles (and logits) are those it has alone."""
  rng = np.random.RandomState(1)
  doc_a, doc_b = rng.randint(0, 128, 6), rng.randint(0, 128, 10)
  packed = np.concatenate([doc_a, doc_b])[None].astype(np.int32)
  segments = np.array([[1] * 6 + [2] * 10], np.int32)
  positions = np.array([list(range(6)) + list(range(10))], np.int32)
  model = model_lib.GPT(SMALL)
  packed_logits = model.apply({"params": small_params}, packed, positions, segments)
  alone = model.apply({"params": small_params}, doc_b[None].astype(np.int32))
  np.testing.assert_allclose(packed_logits[0, 6:], alone[0], rtol=1e-5, atol=1e-5)
  # rotary attention sees only relative offsets: shifting a whole document changes nothing ...
  shifted = model.apply({"params": small_params}, doc_b[None].astype(np.int32), positions=np.arange(3, 13)[None])
  np.testing.assert_allclose(shifted, alone, rtol=1e-5, atol=1e-5)
  # ... while spreading the tokens apart does (the positions reach attention)
  spread = model.apply({"params": small_params}, doc_b[None].astype(np.int32), positions=2 * np.arange(10)[None])
  assert np.abs(np.asarray(spread) - np.asarray(alone)).max() > 1e-4  # measured 8e-4; float noise ~1e-8


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
def test_grouped_query_cache_holds_kv_heads_and_decodes_like_recompute(small_params):
  cache = model_lib.init_cache(SMALL, 2, 12)
  assert cache["k"].shape == (SMALL.num_layers, 2, 12, SMALL.num_kv_heads, SMALL.head_dim)
  prompts = np.random.RandomState(2).randint(4, 128, (2, 5)).astype(np.int32)
  cached = engine_tokens(SMALL, small_params, prompts, 6)
  recomputed = generate_by_recompute(small_params, prompts, config=SMALL, max_new_tokens=6)
  np.testing.assert_array_equal(np.asarray(cached), np.asarray(recomputed))
  # a left-padded shorter prompt continues exactly as it does alone (positions count from its first token)
  padded = engine_tokens(SMALL, small_params, [list(prompts[0]), list(prompts[1, :3])], 6)
  alone = generate_by_recompute(small_params, prompts[1:, :3], config=SMALL, max_new_tokens=6)
  np.testing.assert_array_equal(np.asarray(padded)[1], np.asarray(alone)[0])


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
def test_padding_vocabulary_rows_are_masked_out_of_the_softmax(small_params):
  masked_cfg = dataclasses.replace(SMALL, valid_vocab_size=100)
  tokens = np.random.RandomState(3).randint(0, 100, (2, 8)).astype(np.int32)
  full = np.asarray(model_lib.GPT(SMALL).apply({"params": small_params}, tokens))
  masked = np.asarray(model_lib.GPT(masked_cfg).apply({"params": small_params}, tokens))
  np.testing.assert_array_equal(masked[..., :100], full[..., :100])
  assert (masked[..., 100:] == np.finfo(np.float32).min).all()
  probs = jax.nn.softmax(masked, axis=-1)
  assert float(probs[..., 100:].max()) == 0.0
  # even when the padding rows' weights would win, generation never emits them
  boosted = jax.tree.map(np.array, small_params)
  boosted["lm_head"]["kernel"][:, 100:] = 50.0
  out = engine_tokens(masked_cfg, boosted, tokens, 4, temperature=1.0)
  assert np.asarray(out).max() < 100


def test_llama3_frequency_scaling():
  """Short wavelengths keep their frequency, long ones are divided by the factor, those between interpolate."""
  plain = layers.rope_frequencies(128, 500000.0)
  scaled = layers.rope_frequencies(128, 500000.0, 8.0, 1.0, 4.0, 8192)
  wavelength = 2 * np.pi / plain
  short, long = wavelength < 8192 / 4, wavelength > 8192 / 1
  np.testing.assert_array_equal(scaled[short], plain[short])
  np.testing.assert_allclose(scaled[long], plain[long] / 8.0, rtol=1e-12)
  middle = ~short & ~long
  assert middle.any() and ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8.0)).all()
  np.testing.assert_array_equal(layers.rope_frequencies(64, 10000.0, 1.0), layers.rope_frequencies(64, 10000.0))


def _model_config(name: str):
  gin.clear_config()
  cli.parse_gin([f"configs/models/{name}.gin"], [])
  try:
    return cli.configured(model_lib.GPTConfig, "model")
  finally:
    gin.clear_config()


@pytest.mark.parametrize("name, published", [("llama3_8b", 8_030_261_248), ("llama3_70b", 70_553_706_496)])
def test_llama3_shapes_have_the_published_parameter_counts(name, published):
  cfg = _model_config(name)
  cfg.validate()
  v, d, l, f = cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.d_ff
  kv = 2 * d * cfg.num_kv_heads * cfg.head_dim
  assert model_lib.count_params(cfg) == 2 * v * d + l * (2 * d * d + kv + 3 * d * f + 2 * d) + d == published
  # FLOPs count every matmul weight once: the blocks' projections, the norms and the untied head
  assert flops.matmul_params(cfg) == l * (flops.block_projection_params(cfg) + 2 * d) + d + v * d


def test_bad_llama_configs_name_the_field():
  with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
    dataclasses.replace(SMALL, num_kv_heads=3).validate()
  with pytest.raises(ValueError, match="GPTConfig.norm='batchnorm'"):
    dataclasses.replace(SMALL, norm="batchnorm").validate()
  with pytest.raises(ValueError, match="valid_vocab_size"):
    dataclasses.replace(SMALL, valid_vocab_size=129).validate()
  with pytest.raises(ValueError, match="GPTConfig.num_kv_heads"):
    config_lib.check_layout(SMALL, {"tensor": 4}, batch_size=8)  # 2 key/value heads cannot split 4 ways
