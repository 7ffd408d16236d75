"""The inference engine: batched prefill of ragged prompts, KV-cache decoding and continuous batching over a
fixed set of slots (static shapes: one compiled decode step), with the log-prob of every generated token.

Cache layout. Every slot is one row of a (LAYERS, slots, cache_len, K, Dh) cache. All slots write their next
token at one shared column `t` (one scalar index: the decoder's cache API). A request admitted when the write
column is t is prefilled left-padded to a width W and copied into its slots' rows at columns t−W .. t−1 (its
row's other columns are cleared); its tokens keep their own positions (RoPE / learned positions are given
explicitly), so a row's column is only a storage place. When t reaches cache_len, every row is shifted left by
the first column any live row still needs (a rare copy), so a slot serves any number of requests in turn.

Determinism. Token j of sample i of a request is drawn with the key fold_in(fold_in(fold_in(key(seed), stream),
i), j): the same seed gives the same tokens whatever the slots, the batch or the other requests.
"""

import collections
import contextlib
import dataclasses
from typing import Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from t5x_like.inference import sampling as sampling_lib
from t5x_like.inference.sampling import SamplingParams
from t5x_like.model import decoder as model_lib
from t5x_like.model import pipeline_parallel
from t5x_like.parallel import axis_names as ax

MIN_WIDTH = 8  # prefill widths are powers of two ≥ this (≤ cache_len): few shapes, few compiles


@dataclasses.dataclass
class Completion:
  """One finished sample: its tokens (a stop token included), the log-prob of each under the model's raw
  float32 logits, why it ended ('stop', 'length' or 'cancelled'), its text (with a detokenizer; cut before a
  stop string) and, with Engine(keep_logits=True), the (V,) logits each token was chosen from."""
  tokens: list
  logprobs: list
  finish_reason: Optional[str] = None
  text: Optional[str] = None
  logits: Optional[list] = None


@dataclasses.dataclass
class Delta:
  """What one step produced for sample `index` of request `request_id`: new tokens and their log-probs, and
  when the sample ended, its finish reason and final text."""
  request_id: int
  index: int
  tokens: list
  logprobs: list
  finish_reason: Optional[str] = None
  text: Optional[str] = None
  logits: Optional[list] = None


@dataclasses.dataclass
class _Sequence:
  """Host state of one sample of a request."""
  request_id: int
  index: int
  prompt_len: int
  sampling: SamplingParams
  seed: int
  stream: int
  slot: Optional[int] = None
  start: int = 0  # the cache column of its first prompt token (a shift may drop columns before it)
  tokens: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  finish_reason: Optional[str] = None


@dataclasses.dataclass
class _Request:
  request_id: int
  prompt: list
  sequences: list


def _bucket(n: int, low: int, high: int) -> int:
  return min(high, max(low, 1 << max(n - 1, 0).bit_length()))


def _host(x) -> np.ndarray:
  """A device array on this host, gathered from all processes when it is not all here."""
  return np.asarray(x) if x.is_fully_addressable else np.asarray(multihost_utils.process_allgather(x, tiled=True))


class Engine:
  """Continues token prompts with a model's parameters on a mesh.

  Example:
    engine = Engine(config, params, mesh, rules, slots=8)
    [[c]] = engine.generate([[5, 9, 12]], SamplingParams(max_tokens=8))   # c.tokens, c.logprobs
    rid = engine.submit([5, 9, 12], SamplingParams(max_tokens=8, temperature=0.7, seed=1))
    while engine.busy: for delta in engine.step(): ...                    # tokens as they come
  """

  def __init__(self, model_config: model_lib.GPTConfig, params, mesh, rules, *, slots: int = 8,
               cache_len: Optional[int] = None, detokenize: Optional[Callable[[list], str]] = None,
               pad_id: int = 0, seed: int = 0, keep_logits: bool = False):
    """Args:
      model_config: the model's GPTConfig (a pipeline config decodes with its stages run in turn).
      params: its parameters, unboxed, laid out on `mesh` (a LoRA run: the merged parameters). May be
        reassigned (`engine.params = ...`, e.g. each GRPO step) without recompiling.
      mesh, rules: the device mesh and logical axis rules the params use.
      slots: sequences decoded at once (the cache's rows), rounded up to a multiple of the batch's shards.
      cache_len: cache columns per slot (default model_config.max_len); a request needs prompt + max_tokens ≤ it.
      detokenize: token ids → text; needed for stop strings and Completion.text.
      pad_id: the token of prompt padding. seed: the seed of requests that name none.
      keep_logits: also return the raw logits of every step (tests).
    """
    self.config = dataclasses.replace(model_config, num_stages=1) if model_config.num_stages > 1 else model_config
    self._given_config = model_config  # a trainer's (stage-ordered blocks under an interleaved pipeline)
    self.params, self.mesh, self.rules = params, mesh, tuple(rules)
    axes = nn.logical_to_mesh_axes((ax.BATCH,), self.rules)[0] or ()
    self.row_multiple = int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))
    self.slots = -(-slots // self.row_multiple) * self.row_multiple  # rows split evenly over the batch's axes
    self.cache_len = cache_len or model_config.max_len
    self.detokenize, self.pad_id, self.seed, self.keep_logits = detokenize, pad_id, seed, keep_logits
    if self.cache_len > model_config.max_len and model_config.position_embedding == "learned":
      self.cache_len = model_config.max_len
    self.model = model_lib.GPT(self.config)
    self._replicated = NamedSharding(mesh, P())
    with self.context():
      spec = lambda *names: NamedSharding(mesh, nn.logical_to_mesh_axes(names, self.rules))
      kv = spec(ax.LAYERS, ax.BATCH, ax.KV_LENGTH, ax.ACT_KV_HEADS, ax.KV)
      self._cache_shardings = {"k": kv, "v": kv, "segment_ids": spec(ax.BATCH, ax.KV_LENGTH)}
      empty = model_lib.init_cache(self.config, self.slots, self.cache_len)
      self.cache = jax.device_put(empty, self._cache_shardings)
    self.t = 0  # the next write column
    self._slot = [None] * self.slots  # slot → _Sequence
    self._waiting = collections.deque()
    self._requests = {}
    self._next_id = 0
    self._decode = jax.jit(self._decode_fn, donate_argnums=(1,))
    self._admit_fn = jax.jit(self._admit_step, donate_argnums=(1,))
    self._shift = jax.jit(self._shift_fn, donate_argnums=(0,))

  @property
  def params(self):
    return self._params

  @params.setter
  def params(self, params):
    """Decoding runs the layers in turn, so blocks a trainer holds in stage order are put back in layer order
    (pipeline_parallel.reorder_blocks; a no-op otherwise)."""
    self._params = pipeline_parallel.reorder_blocks(self._given_config, params, to_stage=False)

  def context(self):
    """The mesh and the rules, entered around every trace and call (or sharding constraints vanish)."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(self.mesh))
    stack.enter_context(nn.logical_axis_rules(self.rules))
    return stack

  # The requests' side.

  @property
  def busy(self) -> bool:
    """Some request is waiting or decoding."""
    return bool(self._waiting) or any(s is not None for s in self._slot)

  def submit(self, prompt: Sequence[int], sampling: Optional[SamplingParams] = None, n: int = 1,
             seed: Optional[int] = None, stream: Optional[int] = None) -> int:
    """Queues `n` samples of one prompt (they share one prefill); returns the request id.

    The samples draw with `sampling.seed` (stream 0), else with `seed` (else the engine's) and `stream`
    (default: the request id), which tells apart requests of one seed.

    Raises:
      ValueError: an empty prompt, n outside 1..slots, or prompt + max_tokens over the model's or cache's length.
    """
    sampling = sampling or SamplingParams()
    prompt = [int(t) for t in prompt]
    limit = min(self.config.max_len, self.cache_len)
    if not prompt:
      raise ValueError("Engine.submit: the prompt is empty (give at least one token, e.g. BOS)")
    if not 1 <= n <= self.slots:
      raise ValueError(f"Engine.submit: n={n} samples, the engine has {self.slots} slots")
    if len(prompt) + sampling.max_tokens > limit:
      raise ValueError(f"Engine.submit: prompt {len(prompt)} + max_tokens {sampling.max_tokens} tokens exceed "
                       f"{limit} (the model's max_len / the engine's cache_len)")
    if sampling.stop and self.detokenize is None:
      raise ValueError(f"Engine.submit: stop strings {sampling.stop!r} need Engine(detokenize=...)")
    rid = self._next_id
    self._next_id += 1
    if sampling.seed is not None:  # the request's own seed: the same draws wherever and whenever it runs
      seed, stream = sampling.seed, 0
    else:
      seed, stream = self.seed if seed is None else seed, rid if stream is None else stream
    request = _Request(rid, prompt, [_Sequence(rid, i, len(prompt), sampling, seed, stream) for i in range(n)])
    self._requests[rid] = request
    self._waiting.append(request)
    return rid

  def cancel(self, request_id: int) -> None:
    """Drops a waiting or running request and frees its slots (an unknown or finished id is ignored)."""
    request = self._requests.pop(request_id, None)
    if request is None:
      return
    if request in self._waiting:
      self._waiting.remove(request)
    for seq in request.sequences:
      if seq.slot is not None:
        self._slot[seq.slot] = None
      seq.finish_reason = seq.finish_reason or "cancelled"

  def step(self) -> list:
    """Admits waiting requests into free slots (their first token comes from the prefill), then decodes one
    token in every busy slot. Returns the Deltas of this step."""
    deltas = {}
    with self.context():
      self._admit(deltas)
      live = [s for s in self._slot if s is not None]
      if live:
        if self.t >= self.cache_len:
          self._make_room()
        tokens = np.zeros(self.slots, np.int32)
        positions = np.zeros(self.slots, np.int32)
        for seq in live:
          tokens[seq.slot], positions[seq.slot] = seq.tokens[-1], seq.prompt_len + len(seq.tokens) - 1
        self.cache, out, logprobs, logits = self._decode(self.params, self.cache, tokens, positions, np.int32(self.t),
                                                         *self._settings(self._slot))
        self.t += 1
        self._emit(live, [seq.slot for seq in live], out, logprobs, logits, deltas)
    return list(deltas.values())

  def generate(self, prompts: Sequence[Sequence[int]], sampling=None, n: int = 1,
               seed: Optional[int] = None) -> list:
    """Continues every prompt (`n` samples each) through the slots; returns [prompt][sample] Completions.

    Args:
      sampling: one SamplingParams for all prompts, or one per prompt.
      seed: prompt p samples with seed `seed` and stream p (default the engine's seed): a call repeats
        exactly whatever else the engine runs.
    """
    if sampling is None or isinstance(sampling, SamplingParams):
      sampling = [sampling] * len(prompts)
    seed = self.seed if seed is None else seed
    ids = [self.submit(p, s, n, seed=seed, stream=i) for i, (p, s) in enumerate(zip(prompts, sampling))]
    done = {rid: [Completion([], []) for _ in range(n)] for rid in ids}
    while any(c.finish_reason is None for rid in ids for c in done[rid]):
      for d in self.step():
        c = done[d.request_id][d.index]
        c.tokens += d.tokens
        c.logprobs += d.logprobs
        if d.logits is not None:
          c.logits = (c.logits or []) + d.logits
        c.finish_reason, c.text = d.finish_reason, d.text
    return [done[rid] for rid in ids]

  # Host bookkeeping.

  def _settings(self, sequences) -> tuple:
    """Per-slot sampling arrays (seed, stream, index, count, temperature, top_k, top_p) of `sequences`."""
    rows = len(sequences)
    seeds, streams, index, count = (np.zeros(rows, np.uint32) for _ in range(4))
    temperature, top_p = np.zeros(rows, np.float32), np.ones(rows, np.float32)
    top_k = np.zeros(rows, np.int32)
    for i, seq in enumerate(sequences):
      if seq is not None:
        seeds[i], streams[i] = seq.seed % 2**32, seq.stream % 2**32
        index[i], count[i] = seq.index, len(seq.tokens)
        sp = seq.sampling
        temperature[i], top_k[i], top_p[i] = sp.temperature, sp.top_k, sp.top_p
    return seeds, streams, index, count, temperature, top_k, top_p

  def _admit(self, deltas: dict) -> None:
    free = [i for i, s in enumerate(self._slot) if s is None]
    batch = []
    while self._waiting and len(self._waiting[0].sequences) <= len(free) - sum(len(r.sequences) for r in batch):
      batch.append(self._waiting.popleft())
    if not batch:
      return
    width = _bucket(max(len(r.prompt) for r in batch), MIN_WIDTH, self.cache_len)
    if self.t < width:
      self.t = width  # columns ≥ t hold nothing: skipping some is free
    rows = -(-_bucket(len(batch), 1, self.slots) // self.row_multiple) * self.row_multiple
    tokens, segments = sampling_lib.left_pad([r.prompt for r in batch] + [[self.pad_id]] * (rows - len(batch)),
                                             self.pad_id, width)
    sequences = [seq for r in batch for seq in r.sequences]
    samples = _bucket(len(sequences), 1, self.slots)
    src = np.zeros(samples, np.int32)
    dst = np.full(samples, self.slots, np.int32)  # out of range: dropped
    for i, seq in enumerate(sequences):
      src[i] = next(j for j, r in enumerate(batch) if r.request_id == seq.request_id)
      dst[i] = seq.slot = free[i]
      seq.start = self.t - seq.prompt_len
      self._slot[seq.slot] = seq
    settings = self._settings(sequences + [None] * (samples - len(sequences)))
    self.cache, out, logprobs, logits = self._admit_fn(self.params, self.cache, tokens, segments, src, dst,
                                                       np.int32(self.t), *settings)
    self._emit(sequences, list(range(len(sequences))), out, logprobs, logits, deltas)

  def _make_room(self) -> None:
    """Shifts every row left by the first column a live row still needs (t reached cache_len)."""
    live = [s for s in self._slot if s is not None]
    shift = min(s.start for s in live) if live else self.t
    if shift <= 0:
      raise RuntimeError(f"Engine: no cache column left to shift out (cache_len={self.cache_len})")
    self.cache = self._shift(self.cache, np.int32(shift))
    self.t -= shift
    for s in live:
      s.start -= shift

  def _emit(self, sequences, rows, out, logprobs, logits, deltas: dict) -> None:
    """Appends each sequence's new token (row `rows[i]` of the step's outputs), ends it when it should."""
    out, logprobs = _host(out), _host(logprobs)
    logits = _host(logits) if logits is not None else None
    for seq, row in zip(sequences, rows):
      token = int(out[row])
      seq.tokens.append(token)
      seq.logprobs.append(float(logprobs[row]))
      key = (seq.request_id, seq.index)
      delta = deltas.setdefault(key, Delta(seq.request_id, seq.index, [], []))
      delta.tokens.append(token)
      delta.logprobs.append(float(logprobs[row]))
      if logits is not None:
        delta.logits = (delta.logits or []) + [logits[row]]
      text = None
      if token in seq.sampling.stop_token_ids:
        seq.finish_reason = "stop"
      elif seq.sampling.stop:
        text = self.detokenize(seq.tokens)
        cuts = [text.find(s) for s in seq.sampling.stop if s in text]
        if cuts:
          seq.finish_reason, text = "stop", text[:min(cuts)]
      if seq.finish_reason is None and len(seq.tokens) >= seq.sampling.max_tokens:
        seq.finish_reason = "length"
      if seq.finish_reason is not None:
        self._finish(seq)
        delta.finish_reason = seq.finish_reason
        delta.text = text if text is not None or self.detokenize is None else self.detokenize(seq.tokens)

  def _finish(self, seq) -> None:
    self._slot[seq.slot] = None
    request = self._requests.get(seq.request_id)
    if request is not None and all(s.finish_reason for s in request.sequences):
      del self._requests[seq.request_id]

  # Device programs (traced under the mesh and rules).

  def _choose(self, logits, seeds, streams, index, count, temperature, top_k, top_p):
    """(tokens, log-probs, logits or None) of (B, V) float32 logits with per-row settings."""
    keys = jax.vmap(lambda s, st, i, c: jax.random.fold_in(
        jax.random.fold_in(jax.random.fold_in(jax.random.key(s), st), i), c))(seeds, streams, index, count)
    tokens = sampling_lib.choose(logits, keys, temperature, top_k, top_p)
    logprobs = sampling_lib.token_logprobs(logits, tokens)
    put = lambda x: jax.lax.with_sharding_constraint(x, self._replicated)
    return put(tokens), put(logprobs), (put(logits) if self.keep_logits else None)

  def _constrain_cache(self, cache):
    return jax.tree.map(jax.lax.with_sharding_constraint, cache, self._cache_shardings)

  def _decode_fn(self, params, cache, tokens, positions, t, *settings):
    """One token in every slot: (B,) tokens at (B,) positions written at column t."""
    ones = jnp.ones((self.slots, 1), jnp.int32)
    logits, cache = self.model.apply({"params": params}, tokens[:, None], positions[:, None], ones, cache, t)
    return (self._constrain_cache(cache),) + self._choose(logits[:, -1], *settings)

  def _admit_step(self, params, cache, tokens, segments, src, dst, t, *settings):
    """Prefills (R, W) left-padded prompts, copies prompt row src[i] into slot dst[i] at columns t−W .. t−1
    (the slot's other columns cleared) and draws each slot's first token."""
    rows, width = tokens.shape
    positions = jnp.maximum(jnp.cumsum(segments, axis=1) - 1, 0).astype(jnp.int32)
    fresh = model_lib.init_cache(self.config, rows, width)
    logits, fresh = self.model.apply({"params": params}, tokens, positions, segments, fresh, 0)  # (R, W, V)
    cols = t - width + jnp.arange(width)  # (W,)
    at = (dst[:, None], cols[None, :])
    kv = lambda full, new: full.at[(slice(None),) + at].set(new[:, src], mode="drop")  # (L, n, W, K, Dh)
    seg = cache["segment_ids"].at[dst].set(0, mode="drop").at[at].set(segments[src], mode="drop")
    cache = {"k": kv(cache["k"], fresh["k"]), "v": kv(cache["v"], fresh["v"]), "segment_ids": seg}
    return (self._constrain_cache(cache),) + self._choose(logits[src, -1], *settings)

  def _shift_fn(self, cache, shift):
    """Every row's columns moved `shift` to the left; the freed columns at the end emptied."""
    cols = jnp.arange(self.cache_len)
    moved = jax.tree.map(lambda c, axis: jnp.roll(c, -shift, axis=axis), cache,
                         {"k": 2, "v": 2, "segment_ids": 1})
    moved["segment_ids"] = jnp.where(cols[None] < self.cache_len - shift, moved["segment_ids"], 0)
    return self._constrain_cache(moved)

