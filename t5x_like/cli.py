"""Command-line plumbing shared by the entry points: --gin_file / --gin.NAME=VALUE / --gin_search_paths, one-line errors."""

import dataclasses
import importlib.resources
import logging as std_logging
import os
import re
import sys
from typing import Callable, Sequence, TypeVar

from absl import app, flags, logging
import gin
import tensorflow as tf

from t5x_like import data
from t5x_like import errors
from t5x_like import garbage_collector
from t5x_like import observe
from t5x_like.data import chat
from t5x_like.model import decoder
from t5x_like.parallel import distributed
from t5x_like.parallel import host_allocator
from t5x_like.posttrain import lora
from t5x_like import recipes
from t5x_like.posttrain import lora_runs  # noqa: F401  # the runtime reads LoRA runs with their own settings
from t5x_like.training import checkpointing
from t5x_like.training import curriculum
from t5x_like.training import fault_tolerance
from t5x_like.training import optimizer
from t5x_like.training import precision
from t5x_like.training import config as train_config_lib

T = TypeVar("T")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # a checkout: REPO_ROOT/configs/...
_REGISTERED = {}
# TrainConfig field → (config class, gin module name it is bound under).
NESTED_CONFIGS = {
    "data": (data.DataConfig, "data"),
    "checkpoint": (checkpointing.CheckpointConfig, "checkpointing"),
    "fault_tolerance": (fault_tolerance.FaultToleranceConfig, "fault_tolerance"),
    "observe": (observe.ObserveConfig, "observe"),
    "lora": (lora.LoraConfig, "lora"),
    "curriculum": (curriculum.CurriculumConfig, "curriculum"),
}


def define_gin_flags() -> None:
  """The T5X flag set; `--gin.NAME=VALUE` is rewritten to `--gin_bindings=NAME=VALUE` by `run`."""
  flags.DEFINE_multi_string("gin_file", [], "Gin config files, applied in order.")
  flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings NAME=VALUE applied after the files "
                            "(also written --gin.NAME=VALUE).")
  flags.DEFINE_list("gin_search_paths", ["."], "Directories searched for gin files and includes.")


def register(cls: type, module: str) -> None:
  """Makes a (dataclass) config type bindable as `module.ClassName.field = value`."""
  key = f"{module}.{cls.__name__}"
  if key not in _REGISTERED:
    _REGISTERED[key] = gin.external_configurable(cls, module=module)


def register_all() -> None:
  """Registers every config type a gin file may bind (`model.GPTConfig.d_model = 512`, ...)."""
  register(decoder.GPTConfig, "model")
  register(optimizer.OptimizerConfig, "optimizer")
  register(precision.PrecisionConfig, "precision")
  register(train_config_lib.TrainConfig, "trainer")
  for cls, module in NESTED_CONFIGS.values():
    register(cls, module)
  for module, cls in recipes.gin_configs().items():  # dpo.DpoConfig, grpo.GrpoConfig, ... (t5x_like/recipes/)
    register(cls, module)
  register(chat.ChatTemplate, "data")  # the chat template a chat DATA_DIR, `infer --chat` and evaluation render with


def configured(cls: Callable[..., T], module: str) -> T:
  """An instance of `cls` built with the parsed gin bindings."""
  register(cls, module)
  return _REGISTERED[f"{module}.{cls.__name__}"]()


def train_config() -> train_config_lib.TrainConfig:
  """The run's TrainConfig from the parsed gin bindings, with its per-concern configs built from theirs
  (`data.DataConfig.shuffle_buffer = ...`, `checkpointing.CheckpointConfig.keep = ...`, ...)."""
  nested = {field: configured(cls, module) for field, (cls, module) in NESTED_CONFIGS.items()}
  config = configured(train_config_lib.TrainConfig, "trainer")
  recipe = recipes.get(config.recipe).CONFIG  # trainer.TrainConfig.recipe = 'dpo' → dpo.DpoConfig's bindings
  return dataclasses.replace(config, **nested, recipe_config=configured(recipe, config.recipe))


def config_roots() -> list:
  """Folders holding the shipped `configs/`, so 'configs/models/gpt_tiny.gin' resolves from any cwd.

  A checkout (or editable install) has them at REPO_ROOT/configs; `pip install .` puts them inside the
  package as t5x_like/configs (setup.py maps the package t5x_like.configs to the top-level folder).
  """
  roots = [REPO_ROOT] if os.path.isdir(os.path.join(REPO_ROOT, "configs")) else []
  installed = importlib.resources.files("t5x_like") / "configs"
  if installed.is_dir():
    roots.append(os.path.dirname(os.fspath(installed)))
  return roots


def _resolve(path: str, search_paths: Sequence[str]) -> str:
  bases = list(search_paths) + config_roots()
  for base in bases:
    candidate = os.path.join(base, path)
    if os.path.isfile(candidate):
      return candidate
  raise FileNotFoundError(f"gin file {path!r} not found (searched {bases})")


class _GinSearchMisses:
  """Drops gin's "Path not found" ERROR for each search path an include is not in (an include found in a
  later one is no error; one found nowhere still fails the parse with gin's own message)."""

  def filter(self, record) -> bool:
    return not (record.pathname.endswith(os.path.join("gin", "resource_reader.py"))
                and str(record.msg).startswith("Path not found"))


def _is_macro(binding: str) -> bool:
  name = binding.split("=", 1)[0].strip()
  return "." not in name and "/" not in name


# Bindings that older runs' config.gin (the operative config) holds and today's code no longer has: parsing such a
# file maps them to what replaced them (ObjectiveConfig → the recipe's config, by its `name`) or drops them, with one
# warning line, so infer / evaluate / convert / a resumed train still read an older MODEL_DIR.
_RETIRED = re.compile(r"^(?:[\w.]+\.)?(ObjectiveConfig|GPTConfig)\.(\w+)\s*=\s*(.+)$")
RETIRED_MODEL_FIELDS = ("score_head", "lora_dropout")  # now model/heads.py (recipe 'reward') and lora.LoraConfig.dropout
OBJECTIVE_RECIPES = {"language_model": "language_model", "preference": "dpo", "reward": "reward", "grpo": "grpo",
                     "distill": "distill"}  # ObjectiveConfig.name → TrainConfig.recipe
RECIPE_FIELDS = {  # ObjectiveConfig field → the recipe config's, per recipe (any other field is dropped)
    "dpo": {"loss_type": "loss_type", "beta": "beta", "gamma": "gamma", "reference_checkpoint": "reference_checkpoint"},
    "grpo": {"beta": "kl_beta", "num_generations": "num_generations", "clip_epsilon": "clip_epsilon",
             "reward": "reward", "reward_format": "reward_format", "reward_checkpoint": "reward_checkpoint",
             "max_new_tokens": "max_new_tokens", "temperature": "temperature", "top_k": "top_k",
             "reference_checkpoint": "reference_checkpoint"},
    "distill": {"teacher_checkpoint": "teacher_checkpoint", "distill_alpha": "alpha",
                "distill_temperature": "temperature"},
}


def retire_bindings(text: str, where: str) -> str:
  """`text` of a gin file with retired bindings (RETIRED_MODEL_FIELDS, ObjectiveConfig.*) replaced or dropped."""
  kept, objective, dropped = [], {}, []
  for line in text.splitlines():
    found = _RETIRED.match(line.strip())
    if found and found.group(1) == "ObjectiveConfig":
      objective[found.group(2)] = found.group(3)
    elif found and found.group(2) in RETIRED_MODEL_FIELDS:
      dropped.append(f"GPTConfig.{found.group(2)}")
    else:
      kept.append(line)
  if not objective and not dropped:
    return text
  if objective:
    name = objective.get("name", "'language_model'").strip().strip("'\"")
    recipe = OBJECTIVE_RECIPES.get(name, "language_model")
    fields = RECIPE_FIELDS.get(recipe, {})
    cls = recipes.get(recipe).CONFIG.__name__
    kept.append(f"trainer.TrainConfig.recipe = '{recipe}'")
    kept += [f"{recipe}.{cls}.{fields[k]} = {v}" for k, v in objective.items() if k in fields]
    dropped += [f"ObjectiveConfig.{k}" for k in objective if k not in fields]
  logging.warning("%s: bindings of an older version: ObjectiveConfig mapped to the recipe's config; dropped %s",
                  where, ", ".join(sorted(set(dropped))) or "nothing else")
  return "\n".join(kept) + "\n"


def parse_gin(gin_files: Sequence[str], gin_bindings: Sequence[str] = (),
              search_paths: Sequence[str] = (".",)) -> None:
  """Parses files then bindings, refusing a binding of a macro no file defines (a typo'd override
  would otherwise be silently ignored)."""
  if not gin_files:
    raise ValueError("no --gin_file given: pass e.g. --gin_file=configs/models/gpt_tiny.gin "
                     "--gin_file=configs/runs/pretrain.gin")
  register_all()
  for path in list(search_paths) + config_roots():  # also where `include 'configs/...'` lines resolve
    gin.add_config_file_search_path(path)
  files = [_resolve(f, search_paths) for f in gin_files]
  probes = _GinSearchMisses()
  std_logging.getLogger().addFilter(probes)
  try:
    for path in files:  # in order, each file's retired bindings mapped or dropped first
      with tf.io.gfile.GFile(path) as f:
        text = f.read()
      current = retire_bindings(text, path)
      if current is text:
        gin.parse_config_file(path)
      else:
        gin.parse_config(current)
  except (ValueError, SyntaxError, KeyError, TypeError, IOError) as e:
    raise ValueError(f"gin files {gin_files}: {errors.first_line(e)}") from e
  finally:
    std_logging.getLogger().removeFilter(probes)
  for binding in gin_bindings:
    if "=" not in binding:
      raise ValueError(f"gin binding {binding!r} is not NAME=VALUE")
    if _is_macro(binding):
      name = binding.split("=", 1)[0].strip()
      try:
        gin.query_parameter(f"%{name}")
      except ValueError:
        raise ValueError(f"unknown gin binding {binding!r}: no gin file defines the macro {name}") from None
    try:
      gin.parse_config(binding)
    except (ValueError, SyntaxError, KeyError, TypeError) as e:
      raise ValueError(f"gin binding {binding!r}: {errors.first_line(e)}") from e
  gin.finalize()


def parse_gin_flags() -> None:
  """parse_gin() from the absl flags defined by define_gin_flags()."""
  f = flags.FLAGS
  parse_gin(f.gin_file, f.gin_bindings, f.gin_search_paths)


def rewrite_gin_args(argv: Sequence[str]) -> list:
  """['--gin.X=1'] → ['--gin_bindings=X=1'] (T5X convention)."""
  out = []
  for arg in argv:
    if arg.startswith("--gin.") and "=" in arg:
      name, value = arg[len("--gin."):].split("=", 1)
      arg = f"--gin_bindings={name} = {value}"
    out.append(arg)
  return out


class _QuietLibraries:
  """Drops INFO chatter: orbax's (a dozen lines per checkpoint) and JAX's "Unable to initialize backend
  'tpu'" that every start-up without a TPU logs. Warnings and errors still show (JAX warns when a TPU or
  GPU is present but unusable), and a backend asked for by JAX_PLATFORMS raises instead."""

  def filter(self, record) -> bool:
    if record.levelno >= std_logging.WARNING:
      return True
    if "/orbax/" in record.pathname:
      return False
    return not (record.name.startswith("jax") and record.getMessage().startswith("Unable to initialize backend 'tpu'"))


def run(main: Callable) -> None:
  """absl app.run with --gin.X rewriting; a user error (bad file, key or value, a missing optional
  dependency) exits 1 with a one-line reason, not a traceback (T5X_LIKE_TRACEBACK=1 raises it,
  --verbosity=1 logs it). Before anything starts the jax backend, XLA:CPU gets the run's flags
  (distributed.set_cpu_xla_flags) and glibc's malloc is set to keep freed memory for the next step
  (parallel/host_allocator.py); the imported modules leave the garbage collector's scans
  (garbage_collector.py)."""
  distributed.set_cpu_xla_flags()
  host_allocator.keep_freed_memory()
  garbage_collector.quiet_garbage_collector()

  def wrapped(argv):
    logging.get_absl_handler().addFilter(_QuietLibraries())
    try:
      return main(argv)
    except (ValueError, OSError, ImportError) as e:  # OSError covers FileNotFoundError, PermissionError, ...
      if os.environ.get("T5X_LIKE_TRACEBACK"):
        raise
      logging.debug("%s", e, exc_info=True)
      print(f"error: {errors.exit_reason(e)}", file=sys.stderr, flush=True)
      if "jax" in sys.modules and sys.modules["jax"].distributed.is_initialized():
        os._exit(1)  # don't wait at the shutdown barrier for peers that may be stuck in a collective
      sys.exit(1)

  argv = rewrite_gin_args(sys.argv)
  if {"--help", "-h", "--helpshort", "-?"} & set(argv[1:]):  # absl exits 1 on --help; asking is no error
    main_doc = (sys.modules["__main__"].__doc__ or "").strip()
    print("\n\n".join(p for p in (main_doc, flags.FLAGS.main_module_help(),
                                   flags.FLAGS.module_help(__name__)) if p.strip()))
    sys.exit(0)
  app.run(wrapped, argv=argv)
