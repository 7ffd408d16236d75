"""A LoRA run's checkpoint read as the model's parameters, with the settings the run recorded.

A LoRA run's checkpoints hold its adapters (and marker rows) and, in their metadata, `lora: {base, rank, alpha,
targets, marker_ids, base_precision}`.
`restore_merged` (registered as the runtime's reader of the `lora` metadata key) restores the adapters and
the base they name onto the runtime's mesh and returns W + (alpha / rank)·A·B on every adapted kernel, so
`infer`, `evaluate`, `serve` and `convert` need no LoRA flag for a LoRA run.
"""

from typing import Optional

import jax

from t5x_like.parallel import partitioning
from t5x_like.posttrain import lora
from t5x_like.training import checkpointing
from t5x_like.training import runtime as runtime_lib


def settings(entry: dict, path: str) -> lora.LoraConfig:
  """The LoraConfig a checkpoint's metadata entry `lora` records."""
  missing = [key for key in ("base", "rank", "alpha") if key not in entry]
  if missing:
    raise ValueError(f"{path}: the checkpoint's LoRA metadata lacks {', '.join('lora.' + k for k in missing)}")
  return lora.LoraConfig(rank=int(entry["rank"]), alpha=float(entry["alpha"]),
                         targets=entry.get("targets") or lora.LORA_TARGETS,
                         base_precision=entry.get("base_precision", "float32"))


def abstract_adapters(runtime, config: lora.LoraConfig, marker_ids: tuple = ()):
  """(ShapeDtypeStructs of the adapters (and marker rows) with their shardings, {kernel path name: logical axis
  names})."""
  model = runtime.boxed_params  # (built under the runtime's mesh, outside the trace)
  boxed = jax.eval_shape(lambda: lora.init_run_adapters(jax.random.key(0), model, config, marker_ids))
  shardings = partitioning.shardings_from_boxed(boxed, runtime.mesh, runtime.rules)
  kernel_names = lora.objective(None, runtime.boxed_params, config).kernel_names
  return checkpointing.abstract_with_shardings(partitioning.unbox(boxed), shardings), kernel_names


def restore_merged(runtime, step: Optional[int], path: str, entry: dict):
  """(step, base merged with the adapters) of the LoRA run's checkpoint at `path` (MODEL_DIR's newest, or
  `step`), on the runtime's mesh; the base is the checkpoint the run's metadata names (lora.base)."""
  config = settings(entry, path)
  marker_ids = tuple(entry.get("marker_ids") or ())
  abstract, kernel_names = abstract_adapters(runtime, config, marker_ids)
  found, adapters = checkpointing.restore_newest_params(runtime.config.model_dir, abstract, step)
  _, found_path = checkpointing.step_dir(runtime.config.model_dir, found)
  base_path = checkpointing.read_metadata(found_path).get("lora", {}).get("base") or entry["base"]
  _, base = checkpointing.restore_params(base_path, abstract_params=runtime.abstract_model_params())
  merge = jax.jit(lambda b, a: lora.merge(lora.computed_base(b, config.base_precision), a, config.scale,
                                          kernel_names, marker_ids), out_shardings=runtime.model_shardings)
  with runtime.context():
    return found, merge(base, adapters)


runtime_lib.register_reader("lora", restore_merged)
