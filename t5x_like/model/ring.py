"""Ring attention: context parallelism (GPTConfig.context_parallelism='ring') without gathering keys and values.

With activations split along the sequence over a mesh axis of n devices, device i holds query, key and value block
i (T/n positions each). The key/value blocks travel around the ring (`ppermute` to the next device) in n steps;
at step j device i holds block (i − j) mod n and folds it into its queries' running softmax (the online-softmax
form of flash attention: running maximum, normaliser and weighted sum). A block that lies wholly after the queries'
(causal) or wholly before their sliding window is skipped. The backward pass goes around the ring once more,
recomputing each block's probabilities from the saved log-normaliser, with the key/value gradients travelling
with their block until they are home. No device ever holds more than one (T/n) × (T/n) block of scores or two
key/value blocks, so attention memory grows with T/n, not T (the all-gather form holds (T/n) × T scores and
the whole keys/values). Each step's permute is issued before its block is computed, so XLA may overlap them.

Masking is by slot, as layers.causal_segment_mask: causal over the sequence's slots, within one document of
`segment_ids` (0 = padding), optionally a sliding window of W slots.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from t5x_like.parallel import axis_names as ax

NEG = float(jnp.finfo(jnp.float32).min)


def split_length_axes() -> tuple:
  """The mesh axes of more than one device that the current logical-axis rules split activations' `length` over
  (read at trace time, under jax.set_mesh and nn.logical_axis_rules); () when the length is whole."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  spec = nn.logical_to_mesh_axes((ax.LENGTH,))
  axes = spec[0] if spec else None
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  return tuple(a for a in axes if mesh.shape.get(a, 1) > 1)


def ring_axis(cfg, length: int):
  """The mesh axis ring attention runs over for model config `cfg` and sequences of `length` here, or None
  (all-gather, a whole length, or one the axis cannot split: the 1-token trace of initialisation).

  Raises:
    ValueError: the length is split over more than one mesh axis.
  """
  if cfg.context_parallelism != "ring":
    return None
  axes = split_length_axes()
  if len(axes) > 1:
    raise ValueError(f"GPTConfig.context_parallelism='ring': activations' length is split over mesh axes {axes}; "
                     "the ring runs over one")
  if not axes or length % jax.sharding.get_abstract_mesh().shape[axes[0]]:
    return None
  return axes[0]


def attention(q, k, v, segment_ids, *, axis: str, window: int = 0, scale: float, softcap: float = 0.0):
  """Causal attention of q (B, T, H, Dh) over k, v (B, T, K, Dh) (K divides H) within the documents of
  segment_ids (B, T), T split over mesh axis `axis` (of the mesh in context, jax.set_mesh); other mesh axes stay
  as the arrays are sharded. `scale` multiplies the logits; `softcap` > 0 caps them as cap·tanh(logits/cap).
  Rows of padding (id 0) get zeros."""
  n = jax.sharding.get_abstract_mesh().shape[axis]
  if q.shape[1] % n:
    raise ValueError(f"ring attention: sequence length {q.shape[1]} is not divisible by the {n} devices of mesh "
                     f"axis {axis!r}")
  spec = P(None, axis)
  ring = _ring(axis, n, int(window), float(scale), float(softcap))
  ring = jax.shard_map(ring, in_specs=(spec, spec, spec, spec), out_specs=spec, axis_names={axis}, check_vma=False)
  # Rematerialised as a whole: inside a layer scan, JAX's partial evaluation would otherwise hoist what depends
  # only on the document ids (every step's block mask) out of the ring and keep it for the backward, n − 1 masks
  # of (T/s)² per layer. Saving nothing keeps the inputs only; the backward reruns the ring's forward first.
  return jax.checkpoint(ring, policy=jax.checkpoint_policies.nothing_saveable)(q, k, v, segment_ids)


@functools.lru_cache(maxsize=None)
def _ring(axis: str, n: int, window: int, scale: float, softcap: float):
  """The per-device ring function (custom gradient) for one configuration."""

  def logits_of(qh, kh):
    """(B, K, G, Tq, Dh) × (B, K, S, Dh) → float32 logits (B, K, G, Tq, S) and tanh(·/cap) (soft-capping) or None."""
    logits = jnp.einsum("bkgqd,bksd->bkgqs", qh, kh, preferred_element_type=jnp.float32) * scale
    if not softcap:
      return logits, None
    capped = jnp.tanh(logits / softcap)
    return softcap * capped, capped

  def block_mask(seg_q, seg_k, src):
    """(B, 1, 1, Tq, S) bool for this device's queries against key block `src`; and whether any of it may be true
    by position alone (a scalar: the block is not wholly in the future or wholly before the window)."""
    me, size = jax.lax.axis_index(axis), seg_q.shape[1]
    q_slots = me * size + jnp.arange(size)
    k_slots = src * size + jnp.arange(size)
    mask = k_slots[None, :] <= q_slots[:, None]
    reachable = src <= me
    if window:
      mask &= k_slots[None, :] > q_slots[:, None] - window
      reachable &= (me - src) * size - (size - 1) < window  # the block's last key is within its first query's
    mask = mask[None] & (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_q != 0)[:, :, None]
    return mask[:, None, None], reachable

  def on_block(j, seg_q, seg_k, compute, carry):
    """compute(carry, mask) for key/value block (me − j) mod n, or the carry as it is where that block is out of
    reach (lax.cond: skipped, not masked)."""
    mask, reachable = block_mask(seg_q, seg_k, (jax.lax.axis_index(axis) - j) % n)
    return jax.lax.cond(reachable, lambda c: compute(c, mask), lambda c: c, carry)

  def rotate(tree):
    return jax.lax.ppermute(tree, axis, perm=[(i, (i + 1) % n) for i in range(n)])

  def heads_first(q, k, v):
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    qh = q.reshape(b, t, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)  # (B, K, G, T, Dh)
    return qh, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, K, T, Dh)

  def forward(q, k, v, seg):
    qh, kh, vh = heads_first(q, k, v)
    b, kv_heads, group, t, d = qh.shape

    def fold(j, out, high, norm, kj, vj, seg_k):
      """Folds key/value block (me − j) mod n into the running (output sum, maximum, normaliser)."""

      def compute(carry, mask):
        out, high, norm = carry
        logits, _ = logits_of(qh, kj)
        logits = jnp.where(mask, logits, NEG)
        new_high = jnp.maximum(high, logits.max(-1))
        probs = jnp.exp(logits - new_high[..., None]) * mask  # masked entries 0 even in a row masked so far
        decay = jnp.exp(high - new_high)
        out = out * decay[..., None] + jnp.einsum("bkgqs,bksd->bkgqd", probs.astype(vj.dtype), vj,
                                                  preferred_element_type=jnp.float32)
        return out, new_high, norm * decay + probs.sum(-1)

      return on_block(j, seg, seg_k, compute, (out, high, norm))

    def step(j, carry):  # a rolled loop: one block's scores live at a time, whatever XLA's schedule
      out, high, norm, held = carry
      nxt = rotate(held)  # issued before the block's compute: the two may overlap
      return fold(j, out, high, norm, *held) + (nxt,)

    out = jnp.zeros((b, kv_heads, group, t, d), jnp.float32)
    high = jnp.full((b, kv_heads, group, t), NEG, jnp.float32)  # running maximum of the logits
    norm = jnp.zeros((b, kv_heads, group, t), jnp.float32)  # running softmax normaliser
    out, high, norm, held = jax.lax.fori_loop(0, n - 1, step, (out, high, norm, (kh.astype(q.dtype),
                                                                                 vh.astype(q.dtype), seg)))
    out, high, norm = fold(n - 1, out, high, norm, *held)  # the last block: nothing left to pass on
    seen = norm > 0
    out = out / jnp.where(seen, norm, 1.0)[..., None]
    log_norm = jnp.where(seen, high + jnp.log(jnp.where(seen, norm, 1.0)), 0.0)  # padding rows: 0, never NaN
    result = out.astype(q.dtype).transpose(0, 3, 1, 2, 4).reshape(q.shape)
    return result, (q, k, v, seg, out, log_norm)

  def backward(res, d_result):
    q, k, v, seg, out, log_norm = res
    qh, kh, vh = heads_first(q, k, v)
    b, kv_heads, group, t, d = qh.shape
    d_out = d_result.reshape(b, t, kv_heads, group, d).transpose(0, 2, 3, 1, 4).astype(jnp.float32)
    delta = (d_out * out).sum(-1)  # (B, K, G, Tq): Σ_d dO·O, the softmax backward's row term

    def grads(j, dq, kj, vj, seg_k, dk, dv):
      """Adds key/value block (me − j) mod n's terms to dq and to the block's travelling dk, dv."""

      def compute(carry, mask):
        dq, dk, dv = carry
        logits, capped = logits_of(qh, kj)
        probs = jnp.exp(logits - log_norm[..., None]) * mask
        dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", probs, d_out)
        d_probs = jnp.einsum("bkgqd,bksd->bkgqs", d_out, vj.astype(jnp.float32))
        d_logits = probs * (d_probs - delta[..., None])
        if softcap:
          d_logits = d_logits * (1.0 - capped * capped)
        d_logits = d_logits * scale
        dq = dq + jnp.einsum("bkgqs,bksd->bkgqd", d_logits, kj.astype(jnp.float32))
        dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", d_logits, qh.astype(jnp.float32))
        return dq, dk, dv

      return on_block(j, seg, seg_k, compute, (dq, dk, dv))

    def step(j, carry):  # the block and its gradients move on together
      dq, (kj, vj, seg_k, dk, dv) = carry
      dq, dk, dv = grads(j, dq, kj, vj, seg_k, dk, dv)
      return dq, rotate((kj, vj, seg_k, dk, dv))

    held = (kh.astype(q.dtype), vh.astype(q.dtype), seg, jnp.zeros(kh.shape, jnp.float32),
            jnp.zeros(vh.shape, jnp.float32))
    dq, held = jax.lax.fori_loop(0, n - 1, step, (jnp.zeros(qh.shape, jnp.float32), held))
    dq, dk, dv = grads(n - 1, dq, *held)
    dk, dv = rotate((dk, dv))  # after the last step only the gradients move: then they are home
    dq = dq.transpose(0, 3, 1, 2, 4).reshape(q.shape).astype(q.dtype)
    return dq, dk.transpose(0, 2, 1, 3).astype(k.dtype), dv.transpose(0, 2, 1, 3).astype(v.dtype), None

  @jax.custom_vjp
  def ring(q, k, v, seg):
    return forward(q, k, v, seg)[0]

  ring.defvjp(forward, backward)
  return ring
