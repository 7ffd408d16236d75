"""Shipped gin files bind only what differs: no binding repeats its dataclass default or what its includes set."""

import dataclasses
import glob
import os

from gin import config_parser
import pytest

from t5x_like import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKED = sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.gin"), recursive=True))  # every shipped gin file


@dataclasses.dataclass(frozen=True)
class Reference:
  """A `%MACRO` or `@configurable` on the right of a binding: a value decided elsewhere, never redundant."""
  name: str


class _Delegate(config_parser.ParserDelegate):

  def configurable_reference(self, scoped_configurable_name, evaluate):
    return Reference("@" + scoped_configurable_name)

  def macro(self, macro_name):
    return Reference("%" + macro_name)


def _defaults() -> dict:
  """{'module.Class': {field: default}} of every config class a gin file may bind."""
  cli.register_all()
  out = {}
  for selector, cls in cli._REGISTERED.items():  # pylint: disable=protected-access
    out[selector] = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                     for f in dataclasses.fields(cls)
                     if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
  return out


def _resolve(include: str) -> str:
  for root in cli.config_roots():
    if os.path.isfile(os.path.join(root, include)):
      return os.path.join(root, include)
  raise FileNotFoundError(f"include {include!r} not found under {cli.config_roots()}")


def _statements(path: str) -> list:
  with open(path, encoding="utf-8") as f:
    return list(config_parser.ConfigParser(f, _Delegate()))


def bound(path: str) -> dict:
  """{(selector, arg): value} in effect after parsing `path` with its includes (later lines win)."""
  values = {}
  for statement in _statements(path):
    if isinstance(statement, config_parser.IncludeStatement):
      values.update(bound(_resolve(statement.filename)))
    elif isinstance(statement, config_parser.BindingStatement):
      values[(statement.selector, statement.arg_name)] = statement.value
  return values


def _same(a, b) -> bool:
  """Equal and of one type (an int and a float count as one: 16 and 16.0 give the same run)."""
  numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
  return a == b and (numbers or type(a) is type(b))


def redundant_bindings(path: str, defaults: dict) -> list:
  """'file:line selector.arg = value' for each binding of `path` that changes nothing: its value equals what
  is in effect without it (an earlier include's or line's binding, else the dataclass default)."""
  values, found = {}, []
  for statement in _statements(path):
    if isinstance(statement, config_parser.IncludeStatement):
      values.update(bound(_resolve(statement.filename)))
      continue
    if not isinstance(statement, config_parser.BindingStatement):
      continue
    key, value = (statement.selector, statement.arg_name), statement.value
    if not statement.arg_name:  # a macro definition: the run contract (MODEL_DIR, TRAIN_STEPS, ...) names them all
      values[key] = value
      continue
    if statement.selector not in defaults:
      raise ValueError(f"{path}:{statement.location.line_num}: {statement.selector} is no registered config class")
    without = values.get(key, defaults[statement.selector].get(statement.arg_name, dataclasses.MISSING))
    if not isinstance(value, Reference) and _same(value, without):
      found.append(f"{os.path.relpath(path, ROOT)}:{statement.location.line_num} "
                   f"{statement.selector}.{statement.arg_name} = {value!r}")
    values[key] = value
  return found


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: os.path.relpath(p, ROOT))
def test_shipped_gin_file_binds_only_what_differs(path):
  assert redundant_bindings(path, _defaults()) == []


def test_a_binding_equal_to_its_default_or_to_an_include_is_found(tmp_path):
  """The check itself: a repeated default and a repeated include are reported; overriding an include
  back to the default, a macro reference and a real change are not."""
  base = tmp_path / "base.gin"
  base.write_text("optimizer.OptimizerConfig.warmup_steps = 7\ndata.DataConfig.eval_batches = 3\n")
  run = tmp_path / "run.gin"
  default_keep = _defaults()["checkpointing.CheckpointConfig"]["keep"]
  run.write_text(f"include '{base}'\nSTEPS = 5\n"
                 f"checkpointing.CheckpointConfig.keep = {default_keep}\n"  # line 3: the default again
                 "optimizer.OptimizerConfig.warmup_steps = 7\n"  # line 4: what base.gin set
                 f"data.DataConfig.eval_batches = {_defaults()['data.DataConfig']['eval_batches']}\n"  # back to default
                 "trainer.TrainConfig.train_steps = %STEPS\n"
                 "checkpointing.CheckpointConfig.keep_period = 50\n")
  assert redundant_bindings(str(run), _defaults()) == [
      f"{os.path.relpath(run, ROOT)}:3 checkpointing.CheckpointConfig.keep = {default_keep}",
      f"{os.path.relpath(run, ROOT)}:4 optimizer.OptimizerConfig.warmup_steps = 7"]
