"""Plain text in, continuations out: `infer --prompt` (and any caller with a runtime) through the engine."""

from typing import Optional, Sequence

from t5x_like.inference.engine import Engine
from t5x_like.inference.sampling import SamplingParams


def sample(runtime, prompts: Sequence[str], *, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0, seed: int = 0, step: Optional[int] = None, tokenizer: Optional[str] = None,
           batch_size: int = 16) -> tuple:
  """Continues each prompt from the runtime's checkpoint `step` (default: its newest readable one), stopping at
  EOS, `batch_size` sequences at a time (the engine's slots).

  Args:
    runtime: the run (its mesh, rules, model_config, context(), restore_params(step), load_tokenizer(path)).
    tokenizer: a .model, tokenizer.json or HF folder to use instead of DATA_DIR's (needed without one).

  Returns:
    (checkpoint step, [continuation text per prompt]) (the EOS is not part of the text).

  Raises:
    ValueError: no tokenizer, a prompt + max_new_tokens over the model's max_len, batch_size < 1.
  """
  tok = runtime.load_tokenizer(tokenizer)
  encoded = [tok.encode(p) for p in prompts]
  longest = max(len(e) for e in encoded) + max_new_tokens
  if longest > runtime.model_config.max_len:
    raise ValueError(f"prompt + --max_new_tokens = {longest} tokens exceeds the model's "
                     f"max_len={runtime.model_config.max_len}")
  if batch_size < 1:
    raise ValueError(f"--batch_size must be >= 1, got {batch_size}")
  sampling = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            stop_token_ids=(tok.eos_id,))
  with runtime.context():
    found, params = runtime.restore_params(step)
    engine = Engine(runtime.model_config, params, runtime.mesh, runtime.rules, slots=batch_size, pad_id=tok.pad_id,
                    seed=seed)
    out = engine.generate([e or [tok.bos_id if tok.bos_id >= 0 else tok.eos_id] for e in encoded], sampling)
  return found, [tok.decode([t for t in c.tokens if t != tok.eos_id]) for [c] in out]
