"""Command-line plumbing shared by the entry points: --gin_file / --gin.NAME=VALUE / --gin_search_paths, one-line errors."""

import os
import sys
from typing import Callable, Sequence, TypeVar

from absl import app, flags, logging
import gin

from t5x_like.model import decoder
from t5x_like.training import optimizer
from t5x_like.training import precision
from t5x_like.training import trainer

T = TypeVar("T")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # so 'configs/...' resolves anywhere
_REGISTERED = {}


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
  register(trainer.TrainConfig, "trainer")


def configured(cls: Callable[..., T], module: str) -> T:
  """An instance of `cls` built with the parsed gin bindings."""
  register(cls, module)
  return _REGISTERED[f"{module}.{cls.__name__}"]()


def _resolve(path: str, search_paths: Sequence[str]) -> str:
  for base in list(search_paths) + [REPO_ROOT]:
    candidate = os.path.join(base, path)
    if os.path.isfile(candidate):
      return candidate
  raise FileNotFoundError(f"gin file {path!r} not found (searched {list(search_paths) + [REPO_ROOT]})")


def _is_macro(binding: str) -> bool:
  name = binding.split("=", 1)[0].strip()
  return "." not in name and "/" not in name


def parse_gin(gin_files: Sequence[str], gin_bindings: Sequence[str] = (),
              search_paths: Sequence[str] = (".",)) -> None:
  """Parses files then bindings, refusing a binding of a macro no file defines (a typo'd override
  would otherwise be silently ignored)."""
  if not gin_files:
    raise ValueError("no --gin_file given: pass e.g. --gin_file=configs/models/gpt_tiny.gin "
                     "--gin_file=configs/runs/pretrain.gin")
  register_all()
  for path in list(search_paths) + [REPO_ROOT]:
    gin.add_config_file_search_path(path)
  files = [_resolve(f, search_paths) for f in gin_files]
  try:
    gin.parse_config_files_and_bindings(files, None, finalize_config=False)
  except (ValueError, SyntaxError, KeyError, TypeError, IOError) as e:
    raise ValueError(f"gin files {gin_files}: {first_line(e)}") from e
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
      raise ValueError(f"gin binding {binding!r}: {first_line(e)}") from e
  gin.finalize()


def parse_gin_flags() -> None:
  """parse_gin() from the absl flags defined by define_gin_flags()."""
  f = flags.FLAGS
  parse_gin(f.gin_file, f.gin_bindings, f.gin_search_paths)


def first_line(error: BaseException) -> str:
  text = str(error).strip() or type(error).__name__
  return text.splitlines()[0] if "\n" in text else text


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
  """Drops INFO chatter from orbax (a dozen lines per checkpoint); warnings and errors still show."""

  def filter(self, record) -> bool:
    return record.levelno >= 30 or "/orbax/" not in record.pathname


def run(main: Callable) -> None:
  """absl app.run with --gin.X rewriting; a user error (bad file, key or value) exits 1 with a one-line
  reason as the last line, not a traceback (set T5X_LIKE_TRACEBACK=1 to see it)."""

  def wrapped(argv):
    logging.get_absl_handler().addFilter(_QuietLibraries())
    try:
      return main(argv)
    except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, OSError) as e:
      if os.environ.get("T5X_LIKE_TRACEBACK"):
        raise
      logging.error("%s", e, exc_info=True)
      print(f"error: {first_line(e)}", file=sys.stderr, flush=True)
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
