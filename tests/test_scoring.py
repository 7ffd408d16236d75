"""Scoring through the engine's model: loglikelihood / loglikelihood_rolling with lm-eval's semantics against a
hand-made forward pass, and the reward head's score at the last token, on one device and a sharded mesh.

Tolerances: float32; sums of ≤ 40 log-probs of magnitude ≈ 5 agree within 1e-4 (measured ≤ 2e-5: different
padding widths and batch splits); one token's log-prob left out or counted twice moves a sum by > 1.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.inference import scoring
from t5x_like.model import decoder as model_lib
from t5x_like.model import heads
from t5x_like.parallel import mesh as mesh_lib
from t5x_like.parallel import partitioning
from tests.test_engine import DENSE, RULES, make_params, one_device

ATOL = 1e-4


@pytest.fixture(scope="module", params=["one_device", "data_tensor"])
def setup(request):
  mesh = one_device() if request.param == "one_device" else mesh_lib.create_mesh({"data": 2, "tensor": 4})
  params = make_params(DENSE, mesh)
  return mesh, params, scoring.Scorer(DENSE, params, mesh, RULES, batch_size=4)


def reference_logprobs(params, tokens):
  """(log p(tokens[i] | tokens[:i]) for i ≥ 1, whether each is the argmax) from one unsharded forward pass over
  tokens[:-1] (numpy, float64 log-softmax)."""
  logits = np.asarray(model_lib.GPT(DENSE).apply({"params": jax.device_get(params)},
                                                 jnp.asarray([tokens[:-1]], jnp.int32)))[0].astype(np.float64)
  top = logits.max(-1, keepdims=True)
  logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  return logp[np.arange(len(tokens) - 1), tokens[1:]], logits.argmax(-1) == np.asarray(tokens[1:])


def test_loglikelihood_sums_the_continuations_log_probs(setup):
  mesh, params, scorer = setup
  rng = np.random.RandomState(0)
  requests = [(rng.randint(4, 128, c).tolist(), rng.randint(4, 128, n).tolist())
              for c, n in ((3, 2), (1, 5), (10, 1), (6, 6), (2, 3))]
  got = scorer.loglikelihood(requests)
  for (context, continuation), (logp, greedy) in zip(requests, got):
    lp, top = reference_logprobs(params, context + continuation)
    np.testing.assert_allclose(logp, lp[-len(continuation):].sum(), rtol=0, atol=ATOL)
    assert greedy == bool(top[-len(continuation):].all())
  # a continuation that is the model's own greedy output is greedy
  context = requests[0][0]
  greedy_next = int(np.asarray(model_lib.GPT(DENSE).apply({"params": jax.device_get(params)},
                                                          jnp.asarray([context])))[0, -1].argmax())
  assert scorer.loglikelihood([(context, [greedy_next])])[0][1] is True


def test_loglikelihood_reads_the_last_max_len_tokens(setup):
  """A context longer than max_len is cut from the left: the score equals that of the kept tail."""
  _, _, scorer = setup
  rng = np.random.RandomState(1)
  context, continuation = rng.randint(4, 128, 40).tolist(), rng.randint(4, 128, 4).tolist()
  kept = (context + continuation)[-(DENSE.max_len + 1):]
  [(long_logp, _)] = scorer.loglikelihood([(context, continuation)])
  [(tail_logp, _)] = scorer.loglikelihood([(kept[:-4], continuation)])
  assert long_logp == pytest.approx(tail_logp, abs=ATOL)


def test_rolling_windows_predict_every_token_once():
  tokens = list(range(100, 175))  # 75 tokens, windows of 32
  windows = scoring.rolling_windows(tokens, prefix_token=1, max_len=32)
  predicted = [t for _, cont in windows for t in cont]
  assert predicted == tokens
  assert windows[0] == ([1], tokens[:32])
  for context, continuation in windows[1:]:
    assert len(context) + len(continuation) == 33  # a full window of 32 inputs
    assert context == tokens[tokens.index(continuation[0]) - len(context):tokens.index(continuation[0])]


def test_loglikelihood_rolling_of_a_short_and_a_long_text(setup):
  """A text shorter than max_len: Σ log p of its tokens after the prefix in one pass. A longer one: the sum of
  its windows' scores: tokens 0..31 after the prefix, then 32..49 each after the 32 tokens before it."""
  _, params, scorer = setup
  rng = np.random.RandomState(2)
  short, long_ = rng.randint(4, 128, 20).tolist(), rng.randint(4, 128, 50).tolist()
  got = scorer.loglikelihood_rolling([short, long_], prefix_token=2)
  lp, _ = reference_logprobs(params, [2] + short)
  np.testing.assert_allclose(got[0], lp.sum(), rtol=0, atol=ATOL)
  first, _ = reference_logprobs(params, [2] + long_[:32])  # inputs [2] + tokens 0..30 predict tokens 0..31
  rest, _ = reference_logprobs(params, long_[50 - 33:])  # inputs 17..48 predict 18..49; keep 32..49
  np.testing.assert_allclose(got[1], first.sum() + rest[-18:].sum(), rtol=0, atol=ATOL)


def test_score_reads_the_score_head_at_the_last_token():
  config = DENSE
  mesh = mesh_lib.create_mesh({"data": 2, "tensor": 4})
  params = make_params(config, mesh)
  rng = np.random.RandomState(3)
  kernel = rng.normal(0, 1, (config.d_model, 1)).astype(np.float32)
  params = dict(params, **{heads.SCORE_HEAD: jnp.asarray(kernel)})
  scorer = scoring.Scorer(config, params, mesh, RULES, batch_size=2)
  sequences = [rng.randint(4, 128, n).tolist() for n in (5, 1, 17, 9, 3)]
  got = scorer.score(sequences)
  local = jax.device_get(params)
  for seq, score in zip(sequences, got):
    hidden = model_lib.GPT(config).apply({"params": local}, jnp.asarray([seq]), return_hidden=True)
    want = float(np.asarray(hidden, np.float64)[0, -1] @ kernel[:, 0])
    assert score == pytest.approx(want, abs=1e-4)
  assert len(set(np.round(got, 4))) == len(sequences)
  with pytest.raises(ValueError, match=r"no score head"):
    scoring.Scorer(DENSE, make_params(DENSE, mesh), mesh, RULES).score([[1]])
