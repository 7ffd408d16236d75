"""Attention fast paths match the reference einsum attention: jax.nn.dot_product_attention ('xla') gives
the same outputs and gradients, layer by layer and for the whole model, and so does the causal attention by
blocks of query rows (layers.causal_attention, the training path) and JAX's Pallas splash kernel ('splash', in
interpret mode here) on packed, padded, grouped-query, windowed and soft-capped batches; 'cudnn' is refused
off-GPU, 'auto' picks per backend.

Tolerances: float32 within 2e-6 absolute (both paths compute softmax in float32; only the order of
sums differs); bfloat16 within 2e-2 absolute on unit-scale outputs (8 mantissa bits) and the whole
model's loss within 1e-2 relative.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.model import config as config_lib
from t5x_like.model import layers
from t5x_like.model import decoder as model_lib
from t5x_like.training import step as train_step
from t5x_like.training.objectives import language_model

B, L, H, DH = 2, 16, 4, 8


def qkv_and_mask(dtype):
  q, k, v = (jax.random.normal(key, (B, L, H, DH), jnp.float32).astype(dtype)
             for key in jax.random.split(jax.random.key(0), 3))
  segment_ids = np.ones((B, L), np.int32)
  segment_ids[0, 6:] = 2  # two packed documents in row 0
  segment_ids[1, 12:] = 0  # padding tail in row 1
  return q, k, v, layers.causal_segment_mask(jnp.asarray(segment_ids)), segment_ids != 0


def xla_attention(q, k, v, mask):
  return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=None)


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
def test_xla_attention_matches_reference_outputs_and_grads(dtype, atol):
  q, k, v, mask, valid = qkv_and_mask(dtype)
  cotangent = jax.random.normal(jax.random.key(1), (B, L, H, DH), jnp.float32).astype(dtype)
  cotangent = cotangent * valid[:, :, None, None]  # padding queries' outputs are never used

  def value_and_grads(fn):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, mask), q, k, v)
    return out, vjp(cotangent)

  ref_out, ref_grads = value_and_grads(layers.reference_attention)
  out, grads = value_and_grads(xla_attention)
  assert out.dtype == ref_out.dtype == dtype
  np.testing.assert_allclose(np.asarray(out, np.float32)[valid], np.asarray(ref_out, np.float32)[valid], atol=atol)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), atol=atol)


@pytest.mark.parametrize("block", [4, 5])  # 4 blocks; ragged: 5 + 5 + 5 + 1 rows
def test_causal_attention_by_blocks_matches_reference(block):
  q, k, v, mask, valid = qkv_and_mask(jnp.float32)
  cotangent = jax.random.normal(jax.random.key(1), (B, L, H, DH), jnp.float32) * valid[:, :, None, None]
  kv_heads = 2  # and grouped-query: two query heads per key/value head
  for k_, v_ in ((k, v), (k[:, :, :kv_heads], v[:, :, :kv_heads])):
    # jitted: one compile each (op by op, the blocked attention's many small ops took ≈ 20 s to dispatch)
    ref_out, ref_vjp = jax.vjp(jax.jit(lambda q, k, v: layers.reference_attention(q, k, v, mask)), q, k_, v_)
    out, vjp = jax.vjp(jax.jit(lambda q, k, v: layers.causal_attention(q, k, v, mask, block)), q, k_, v_)
    np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(ref_out)[valid], atol=2e-6)
    for g, r in zip(vjp(cotangent), ref_vjp(cotangent)):
      np.testing.assert_allclose(g, r, atol=2e-6)


@pytest.mark.parametrize("dtype,rtol", [("float32", 1e-6), pytest.param("bfloat16", 1e-2, marks=pytest.mark.slow)])
def test_model_loss_and_grads_equal_across_attention_impls(dtype, rtol):
  cfg = model_lib.GPTConfig(vocab_size=128, max_len=L, num_layers=2, num_heads=H, d_model=H * DH, d_ff=64,
                            dtype=dtype)
  rng = np.random.RandomState(0)
  tokens = rng.randint(0, cfg.vocab_size, (B, L + 1)).astype(np.int32)
  _, _, _, _, valid = qkv_and_mask(jnp.float32)
  segment_ids = valid.astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segment_ids,
           "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy(),
           "weights": valid.astype(np.float32)}
  params = model_lib.GPT(cfg).init(jax.random.key(0), jnp.zeros((1, L), jnp.int32))["params"]
  params = jax.tree.map(lambda x: x.value, params, is_leaf=lambda x: hasattr(x, "value"))

  def loss_and_grads(impl):
    apply_fn = model_lib.GPT(dataclasses.replace(cfg, attention_impl=impl)).apply
    grads, loss_sum, weight_sum, _ = jax.jit(lambda p: train_step.accumulated_grads(
        language_model.LanguageModel(apply_fn).loss, p, batch, 1))(params)
    return loss_sum / weight_sum, grads

  ref_loss, ref_grads = loss_and_grads("reference")
  loss, grads = loss_and_grads("xla")
  np.testing.assert_allclose(loss, ref_loss, rtol=rtol)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref_grads))
  jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, atol=rtol * scale), grads, ref_grads)


def test_cudnn_attention_is_accepted_on_gpu_and_refused_elsewhere():
  config = model_lib.GPTConfig(attention_impl="cudnn")
  if jax.default_backend() == "gpu":
    config.validate()
    return
  with pytest.raises(ValueError, match="attention_impl='cudnn' needs an NVIDIA GPU"):
    config.validate()


# softcap: logits q·k/√1 (attention_scale_dim=1: Gemma's query scale) capped hard at 1, so capping changes them
@pytest.mark.parametrize("options", [{}, {"sliding_window": 8}, {"attention_softcap": 1.0, "attention_scale_dim": 1}],
                         ids=["causal", "window", "softcap"])
def test_splash_and_xla_kernels_equal_reference_on_packed_batches(options):
  """A grouped-query model (4 query heads over 2 key/value heads) on a batch of two packed documents and a padded
  row, 40 tokens (the splash kernel pads to its 128-wide tiles): 'splash' (JAX's Pallas kernel through its
  interpreter) and 'xla' give the reference's logits on every real token (float32, 1e-5 of the largest) and its
  gradients (1e-5 of the largest), causal, with a sliding window and with Gemma 2's logit soft-capping ('xla' then
  runs the einsum path: jax.nn.dot_product_attention cannot cap)."""
  cfg = model_lib.GPTConfig(num_layers=2, num_heads=4, num_kv_heads=2, d_model=32, d_ff=64, max_len=40,
                            vocab_size=128, dtype="float32", position_embedding="rope", norm="rmsnorm",
                            mlp_activation="swiglu", use_bias=False, **options)
  rng = np.random.RandomState(0)
  tokens = jnp.asarray(rng.randint(1, 128, (2, 40)), jnp.int32)
  segment_ids = jnp.asarray([[1] * 17 + [2] * 23, [1] * 30 + [0] * 10], jnp.int32)
  params = model_lib.GPT(cfg).init(jax.random.key(0), tokens)["params"]
  valid = np.asarray(segment_ids != 0)

  def logits_and_grads(impl):
    apply = model_lib.GPT(dataclasses.replace(cfg, attention_impl=impl)).apply
    logits_fn = lambda p: apply({"params": p}, tokens, segment_ids=segment_ids)
    loss = lambda p: jnp.sum(jax.nn.log_softmax(logits_fn(p))[..., 7] * valid)
    return jax.jit(logits_fn)(params), jax.jit(jax.grad(loss))(params)

  ref_logits, ref_grads = logits_and_grads("reference")
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref_grads))
  for impl in ("splash", "xla"):
    logits, grads = logits_and_grads(impl)
    np.testing.assert_allclose(np.asarray(logits)[valid], np.asarray(ref_logits)[valid],
                               atol=1e-5 * float(jnp.max(jnp.abs(ref_logits))))
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, atol=1e-5 * scale), grads, ref_grads)


def test_auto_picks_the_kernel_for_the_backend_and_splash_refuses_what_it_lacks(monkeypatch):
  """'auto' is cudnn on GPU (xla when the model soft-caps its logits), splash on TPU (xla with local and global
  layers interleaved, which one splash kernel per scan cannot do), xla on CPU; 'splash' itself is refused in one
  line for interleaved local/global layers and on a GPU."""
  auto = model_lib.GPTConfig(attention_impl="auto")
  gemma3 = dataclasses.replace(auto, sliding_window=4, sliding_window_pattern=2)
  assert auto.attention_kernel() == "xla"
  for backend, plain, capped, interleaved in (("gpu", "cudnn", "xla", "cudnn"), ("tpu", "splash", "splash", "xla")):
    monkeypatch.setattr(config_lib.jax, "default_backend", lambda b=backend: b)
    assert auto.attention_kernel() == plain and gemma3.attention_kernel() == interleaved
    assert dataclasses.replace(auto, attention_softcap=50.0).attention_kernel() == capped
  monkeypatch.setattr(config_lib.jax, "default_backend", lambda: "gpu")
  with pytest.raises(ValueError, match="attention_impl='splash' is a TPU kernel"):
    model_lib.GPTConfig(attention_impl="splash").validate()
  monkeypatch.setattr(config_lib.jax, "default_backend", lambda: "tpu")
  with pytest.raises(ValueError, match=r"attention_impl='splash' does not support sliding_window_pattern=2") as e:
    dataclasses.replace(gemma3, attention_impl="splash").validate()
  assert "\n" not in str(e.value)
