"""The loop and its hooks in-process, with fakes: what runs at which step, preemption, rollback."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

from t5x_like.parallel import global_batch
from t5x_like.training import hooks
from t5x_like.training import trainer


class FakeMeter:
  def __init__(self):
    self.steps = 0

  def begin_step(self):
    pass

  def data_ready(self):
    pass

  def end_step(self, step_metrics, compiling=False, sync=False):
    self.steps += 1

  def excluded(self):
    return contextlib.nullcontext()

  def summary(self, data_iterator=None):
    return {"loss": 1.0}


class FakeGuard:
  """Preempted at `preempt_at`; asks for one rollback after `rollback_after` (to `rollback_to`)."""

  def __init__(self, preempt_at=None, rollback_after=None, rollback_to=None):
    self.preempt_at, self.rollback_after, self.rollback_to = preempt_at, rollback_after, rollback_to

  def after_step(self, step, step_metrics):
    if step == self.rollback_after:
      self.rollback_after = None
      return True
    return False

  def rollback(self):
    return self.rollback_to, {"step": self.rollback_to}

  def preempted(self, step):
    return step == self.preempt_at


class State(dict):
  """A TrainState stand-in: the eval hook reads `.params`."""
  params = None


class Sink:
  def __init__(self):
    self.records = []

  def write(self, step, scalars):
    self.records.append((step, dict(scalars)))


def run(train_steps=10, start=0, guard=None, log_every=3, eval_every=4, checkpoint_every=5):
  batches_run, sink, meter = [], Sink(), FakeMeter()
  saves, batches = [], []
  log = hooks.LogHook(hooks.Every(log_every, train_steps), meter, [sink])
  evaluate = hooks.EvalHook(hooks.Every(eval_every, train_steps), lambda params: {"eval/loss": 2.0,
                                                                                  "eval/perplexity": 7.4}, meter, [sink])
  checkpoint = hooks.CheckpointHook(hooks.Every(checkpoint_every, train_steps),
                                    lambda step, state: saves.append((step, state["step"])), meter)

  def step_fn(state, batch):
    batches_run.append(batch)
    return State(step=state["step"] + 1), {"nonfinite": 0}

  def next_batch(step):
    batches.append(step)
    return step

  step, state = trainer.run_loop(state=State(step=start), start=start, train_steps=train_steps, next_batch=next_batch,
                                 step_fn=step_fn, hooks=[log, evaluate], checkpoint=checkpoint,
                                 guard=guard or FakeGuard(), meter=meter)
  return step, state, sink.records, saves, batches


def test_hooks_fire_every_n_steps_and_at_the_end():
  step, state, records, saves, batches = run()
  assert step == 10 and state["step"] == 10 and batches == list(range(1, 11))
  assert [s for s, r in records if "loss" in r] == [3, 6, 9, 10]
  assert [s for s, r in records if "eval/loss" in r] == [4, 8, 10]
  assert saves == [(5, 5), (10, 10)]


def test_a_resumed_loop_starts_after_its_step_and_zero_means_only_at_the_end():
  step, _, records, saves, batches = run(start=6, eval_every=0, checkpoint_every=0)
  assert batches == [7, 8, 9, 10] and step == 10
  assert [s for s, r in records if "eval/loss" in r] == [10] and saves == [(10, 10)]


def test_preemption_saves_at_once_and_stops():
  step, _, _, saves, batches = run(guard=FakeGuard(preempt_at=7))
  assert step == 7 and batches[-1] == 7 and saves == [(5, 5), (7, 7)]


def test_rollback_restarts_from_the_checkpoint_without_saving_the_bad_step():
  step, state, _, saves, batches = run(guard=FakeGuard(rollback_after=5, rollback_to=4))
  assert batches == [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10]  # step 5 runs again, on a new batch
  assert saves == [(5, 5), (10, 10)] and step == 10 and state["step"] == 10


@pytest.mark.parametrize("dispatch_ahead", [False, True])
def test_on_cpu_a_step_is_dispatched_after_the_last_one_finished(dispatch_ahead, monkeypatch):
  """Without dispatching ahead (the CPU default: each step in flight holds its temporaries in host memory) a step
  starts only after the last one's metrics are ready, and after the next batch was fetched; dispatching ahead,
  steps of a slow computation are queued behind unfinished ones. Waiting, the loop then leaves the runtime
  min(10 ms, 1% of the step) to free the step's temporaries."""
  pauses, sleep = [], trainer.time.sleep
  monkeypatch.setattr(trainer.time, "sleep", lambda seconds: (pauses.append(seconds), sleep(seconds))[1])
  slow = jax.jit(lambda x: jnp.tanh(jnp.linalg.matrix_power(x, 255)).sum())
  x = jnp.eye(512) * 0.5  # ~20 ms a call
  slow(x).block_until_ready()
  ready_at_dispatch, order = [], []

  def step_fn(state, batch):
    ready_at_dispatch.append([w.is_ready() for w in state["pending"]])
    order.append(("step", batch))
    work = slow(x)  # the step's metrics: what the loop waits for
    return State(step=state["step"] + 1, pending=[work]), {"nonfinite": 0, "work": work}

  def next_batch(step):
    order.append(("batch", step))
    return step

  meter, saves = FakeMeter(), []
  checkpoint = hooks.CheckpointHook(hooks.Every(0, 6), lambda step, state: saves.append(step), meter)
  trainer.run_loop(state=State(step=0, pending=[]), start=0, train_steps=6, next_batch=next_batch, step_fn=step_fn,
                   hooks=[], checkpoint=checkpoint, guard=FakeGuard(), meter=meter, dispatch_ahead=dispatch_ahead)
  assert order == [(kind, s) for s in range(1, 7) for kind in ("batch", "step")] and saves == [6]
  waited = [all(r) for r in ready_at_dispatch[1:]]  # was the last step's work done when this one was dispatched?
  assert all(waited) if not dispatch_ahead else not all(waited)
  assert (len(pauses), all(0 < p <= 0.01 for p in pauses)) == ((5, True) if not dispatch_ahead else (0, True))
  assert trainer.StepGate(None).ahead is False and trainer.StepGate(True).ahead is True  # tests run on CPU


@pytest.mark.parametrize("num_streams", [1, 2, 4])
def test_process_rows_give_the_same_global_batch_on_any_process_count(num_streams):
  """Rows of the global batch depend on the stream count only: P = 1, 2, 4 processes together hold
  exactly the rows one process holds (S = 1 included, where no process owns a whole stream)."""
  batch = 8

  def make_stream(stream_index, num_streams, batch_size):
    rows = tf.data.Dataset.range(1000).map(lambda i: i * 10 + stream_index)  # distinct per stream
    return rows.batch(batch_size).map(lambda x: {"inputs": x})

  def global_rows(processes):
    parts = []
    for p in range(processes):
      ds = global_batch.process_rows(make_stream, num_streams=num_streams, global_batch_size=batch,
                                     process_index=p, process_count=processes)
      parts.append(np.stack([b["inputs"].numpy() for b in ds.take(3)]))
    return np.concatenate(parts, axis=1)  # (batches, B)

  one = global_rows(1)
  assert one.shape == (3, batch) and len(set(one[0] % 10)) == num_streams
  for processes in (2, 4):
    np.testing.assert_array_equal(global_rows(processes), one)


def test_process_rows_refuses_a_batch_the_streams_cannot_split():
  with pytest.raises(ValueError, match="BATCH_SIZE=6 is not divisible by 4 data streams"):
    global_batch.process_rows(lambda **kw: None, num_streams=4, global_batch_size=6, process_index=0,
                              process_count=1)
