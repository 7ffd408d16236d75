"""An lm-evaluation-harness model backed by the inference engine, registered as `t5x_like`.

    import t5x_like.evaluation.harness  # registers the model with lm_eval
    lm_eval.simple_evaluate(model="t5x_like", model_args="model_dir=/runs/gpt2", tasks=["hellaswag"])

Log-likelihoods come from `inference.scoring.Scorer` (full forward passes of the trainer's model on its mesh),
generation from `inference.engine.Engine` (KV cache, continuous batching), text from the run's own tokenizer. A
chat template (a task run with `apply_chat_template`) is the run's `data.ChatTemplate`: its markers are written into
the prompt text and `tok_encode` maps each marker back to its token id, so the model sees exactly the ids
`preprocess --format=chat` trained it on.
"""

import re
from typing import Optional, Sequence

try:  # the `eval` extra; without it `evaluate --tasks` says what to install (evaluation.tasks.require_lm_eval)
  import lm_eval
  from lm_eval import utils as lm_eval_utils
  from lm_eval.api.model import TemplateLM
  from lm_eval.api.registry import register_model
except ImportError:
  lm_eval = lm_eval_utils = None
  TemplateLM = object
  register_model = lambda name: (lambda cls: cls)

from t5x_like.data import chat
from t5x_like.evaluation import runs
from t5x_like.evaluation.runs import Run
from t5x_like.inference import engine as engine_lib
from t5x_like.inference import scoring
from t5x_like.inference.sampling import SamplingParams

MODEL_NAME = runs.MODEL_NAME
BOOTSTRAP_ITERS = 1000  # resamples for a metric's standard error (lm-eval's default 100,000 takes minutes on CPU)


@register_model(MODEL_NAME)
class T5xLikeLM(TemplateLM):
  """lm-eval's `loglikelihood`, `loglikelihood_rolling` and `generate_until` on the engine."""

  def __init__(self, model_dir: Optional[str] = None, step: Optional[int] = None, gin_file: Optional[str] = None,
               tokenizer: Optional[str] = None, batch_size: int = 8, max_gen_toks: int = 256, slots: int = 8,
               run: Optional[Run] = None, **unused):
    """Args:
      model_dir: a run's MODEL_DIR (or a converted HF folder's); its config.gin / model.gin gives the model.
      step: the checkpoint step (default: the newest readable one).
      gin_file: gin files (';'-separated) instead of MODEL_DIR's own config.
      tokenizer: a tokenizer instead of the run's DATA_DIR's.
      batch_size: rows per scoring forward pass; slots: sequences the engine decodes at once.
      max_gen_toks: generation budget when a task names none.
      run: an already loaded Run (in-process use: the training loop's evaluation, tests).
    """
    super().__init__()
    if run is None:
      if not model_dir:
        raise ValueError("model_args needs model_dir=MODEL_DIR (a run or a converted checkpoint)")
      run = runs.open_run(model_dir, step=step, gin_files=tuple(gin_file.split(";")) if gin_file else (),
                          tokenizer=tokenizer)
    self.run = run
    self.tok = run.tokenizer
    self.max_gen_toks = int(max_gen_toks)
    self.scorer = scoring.Scorer(run.model_config, run.params, run.mesh, run.rules, batch_size=int(batch_size))
    self.engine = engine_lib.Engine(run.model_config, run.params, run.mesh, run.rules, slots=int(slots),
                                    detokenize=self.tok.decode)
    self.marker_ids = chat.marker_pieces(self.tok, run.template)  # the text of the markers' leading tokens → id
    self._marker_re = (re.compile("(" + "|".join(re.escape(m) for m in sorted(self.marker_ids, key=len,
                                                                                  reverse=True)) + ")")
                       if self.marker_ids else None)

  # ---- tokens

  @property
  def eot_token_id(self) -> int:
    return self.tok.eos_id

  @property
  def prefix_token_id(self) -> int:
    return self.tok.bos_id if self.tok.bos_id >= 0 else self.tok.eos_id

  @property
  def max_length(self) -> int:
    return self.run.model_config.max_len

  @property
  def tokenizer_name(self) -> str:
    return getattr(self.tok, "path", MODEL_NAME).replace("/", "__")

  def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list:
    """Token ids of `string`; chat-template markers in it become their own ids."""
    if self._marker_re is None:
      return list(self.tok.encode(string))
    out = []
    for part in self._marker_re.split(string):
      if part in self.marker_ids:
        out.append(self.marker_ids[part])
      elif part:
        out.extend(self.tok.encode(part))
    return out

  def tok_decode(self, tokens: Sequence[int]) -> str:
    return self.tok.decode(list(tokens))

  # ---- lm-eval's requests

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list:
    """(Σ log p, is_greedy) of each (key, context ids, continuation ids), longest first so padding is small."""
    order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][1]) + len(requests[i][2])))
    scored = self.scorer.loglikelihood([(list(requests[i][1]), list(requests[i][2])) for i in order])
    out = [None] * len(requests)
    for i, result in zip(order, scored):
      out[i] = (float(result[0]), bool(result[1]))
      if self.cache_hook is not None:
        self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list:
    """Σ log p of each whole text, over windows of at most max_len tokens (lm-eval's rolling windows)."""
    texts = [self.tok_encode(request.args[0]) for request in requests]
    return [float(x) for x in self.scorer.loglikelihood_rolling(texts, prefix_token=self.prefix_token_id)]

  def generate_until(self, requests, disable_tqdm: bool = False) -> list:
    """Each request's continuation, stopped at the first of its `until` strings (or EOS, or max_gen_toks)."""
    prompts, settings = [], []
    for request in requests:
      context, kwargs = request.args
      kwargs = dict(kwargs or {})
      until = kwargs.pop("until", None) or []
      until = [until] if isinstance(until, str) else list(until)
      max_tokens = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
      temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", False) else 0.0
      ids = self.tok_encode(context)[-(self.max_length - max_tokens):]
      prompts.append(ids)
      settings.append(SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                     stop_token_ids=(self.eot_token_id,), stop=tuple(until)))
    completions = self.engine.generate(prompts, settings)
    out = []
    for request, (completion,) in zip(requests, completions):
      text = completion.text if completion.text is not None else self.tok_decode(completion.tokens)
      out.append(text)
      if self.cache_hook is not None:
        self.cache_hook.add_partial("generate_until", request.args, text)
    return out

  # ---- chat

  def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
    """The conversation rendered with the run's chat template, as text whose markers `tok_encode` maps back to
    their ids (with add_generation_prompt, ending with the assistant marker)."""
    messages = [(m["role"], m["content"]) for m in chat_history]
    encoder = chat.ChatEncoder(self.tok, self.run.template)
    ids = (encoder.prompt_ids(messages) if add_generation_prompt
           else list(encoder.render(messages).ids))
    by_id = {i: text for text, i in self.marker_ids.items()}
    parts, run = [], []
    for token in ids:
      if token in by_id:
        parts += [self.tok_decode(run), by_id[token]] if run else [by_id[token]]
        run = []
      else:
        run.append(token)
    if run:
      parts.append(self.tok_decode(run))
    return "".join(parts)

  def chat_template(self, chat_template=False) -> str:
    return repr(self.run.template)


def evaluate(run: Run, task_names, manager, *, num_fewshot=None, limit=None, batch_size: int = 8,
             lm: Optional[T5xLikeLM] = None) -> dict:
  """lm-eval's `simple_evaluate` of the run on `task_names` (a TaskManager from evaluation.tasks)."""
  lm = lm or T5xLikeLM(run=run, batch_size=batch_size)
  return lm_eval.simple_evaluate(model=lm, tasks=list(task_names), task_manager=manager, num_fewshot=num_fewshot,
                                 limit=limit, log_samples=False, verbosity="WARNING",
                                 bootstrap_iters=BOOTSTRAP_ITERS)


def table(results: dict) -> str:
  """lm-eval's Markdown table of the results."""
  return lm_eval_utils.make_table(results)


def results_json(results: dict) -> dict:
  """What lm-eval writes as its results JSON (the per-sample logs left out)."""
  return {k: v for k, v in results.items() if k != "samples"}


def scalars(results: dict) -> dict:
  """{'tasks/<task>/<metric>': value} of every numeric metric (metrics.jsonl, TensorBoard, Prometheus)."""
  out = {}
  for task, metrics in results.get("results", {}).items():
    for key, value in metrics.items():
      metric = key.split(",")[0]
      if isinstance(value, (int, float)) and not isinstance(value, bool) and metric not in ("alias", "sample_len"):
        if "stderr" not in metric:
          out[f"tasks/{task}/{metric}"] = float(value)
  return out
