"""attention_impl='splash': JAX's Pallas splash-attention kernel (TPU), run in interpret mode off TPU.

The kernel takes one example's (heads, length, head_dim) queries and a shared key/value head (the MQA form), a
causal or sliding-window mask, and document ids that keep packed documents apart; it never builds the (T, T) scores
in memory. Grouped-query attention runs it once per key/value head over that head's query group. Off TPU the same
kernel runs through Pallas' interpreter (slow, for checking numerics against 'reference' on CPU).
"""

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

LANES = 128  # the kernel's tiles are multiples of this: shorter or ragged lengths are padded up to one
MAX_BLOCK = 512  # query / key tile: the largest multiple of LANES dividing the padded length, up to this
PAD_SEGMENT = -1  # document id of the padding added here: no query of the batch reads it


def _block(length: int) -> int:
  return next(b for b in range(min(MAX_BLOCK, length), 0, -LANES) if length % b == 0)


def _kernel(length: int, group: int, window: int, softcap: float, interpret: bool):
  """The splash MQA kernel for `group` query heads per key/value head (built inside each trace: it holds the
  mask's block structure as arrays, which may not outlive the trace)."""
  shape = (length, length)
  base = mask_lib.LocalMask(shape, window_size=(window - 1, 0), offset=0) if window else mask_lib.CausalMask(shape)
  b = _block(length)
  sizes = kernel_lib.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                                block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
  return kernel_lib.make_splash_mqa(mask_lib.MultiHeadMask([base] * group), block_sizes=sizes, head_shards=1,
                                    q_seq_shards=1, attn_logits_soft_cap=softcap or None, interpret=interpret)


def attention(q, k, v, segment_ids, *, window: int = 0, scale: float, softcap: float = 0.0):
  """Causal (with `window` > 0: sliding-window) attention of q (B, T, H, Dh) over k, v (B, T, K, Dh) within each
  document of segment_ids (B, T). Rows of padding (id 0) attend among themselves; their outputs are never read.
  `scale` multiplies the queries (1/√head_dim or the model's attention_scale_dim); `softcap` > 0 caps the logits
  as cap·tanh(logits/cap) (Gemma 2)."""
  b, t, h, d = q.shape
  kv_heads = k.shape[2]
  padded = -(-t // LANES) * LANES
  if padded != t:
    pad = lambda x, value=0: jnp.pad(x, [(0, 0), (0, padded - t)] + [(0, 0)] * (x.ndim - 2), constant_values=value)
    out = attention(pad(q), pad(k), pad(v), pad(segment_ids, PAD_SEGMENT), window=window, scale=scale,
                    softcap=softcap)
    return out[:, :t]
  kernel = _kernel(t, h // kv_heads, window, float(softcap), jax.default_backend() != "tpu")
  qg = (q * scale).reshape(b, t, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)  # (B, K, G, T, Dh)
  kg, vg = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, K, T, Dh)
  segments = kernel_lib.SegmentIds(q=segment_ids, kv=segment_ids)
  per_head = jax.vmap(lambda qh, kh, vh, seg: kernel(qh, kh, vh, segment_ids=seg), in_axes=(0, 0, 0, None))
  out = jax.vmap(per_head)(qg, kg.astype(q.dtype), vg.astype(q.dtype), segments)  # (B, K, G, T, Dh)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)


def is_segments(mask) -> bool:
  """Whether the blocks' `mask` argument is (B, T) document ids (attention_masks under 'splash'), not a mask."""
  return isinstance(mask, jax.Array) and mask.ndim == 2  # tracers are jax.Arrays too
