"""lm-eval tasks by name, from a folder of task YAMLs over local data files or lm-eval's own, checked before any
model is loaded: an unknown name, a folder without YAMLs, a data file missing a field a task reads, or more few-shot
examples than the data holds are one-line errors naming the task, the file or the field.

Data files named relative to a YAML's folder (`data_files: {test: items.jsonl}`) are resolved against it: the
folder is staged into a temporary copy whose YAMLs name absolute paths (lm-eval itself resolves against the cwd).
"""

import functools
import os
import re
import shutil
import tempfile
from typing import Optional, Sequence

import yaml

# No hub at run time: datasets and lm-eval read local files only.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:  # the `eval` extra (lm-eval brings jinja2)
  import jinja2  # pylint: disable=g-import-not-at-top
  import jinja2.meta  # pylint: disable=g-import-not-at-top
  from lm_eval.tasks import TaskManager, get_task_dict  # pylint: disable=g-import-not-at-top
except ImportError:
  jinja2 = TaskManager = get_task_dict = None

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                       "tasks")


def shipped_task_dir() -> str:
  """configs/tasks of a checkout, or the copy installed inside the package (t5x_like/configs/tasks)."""
  if os.path.isdir(SHIPPED):
    return SHIPPED
  return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tasks")


class _Loader(yaml.SafeLoader):
  """A YAML loader that keeps lm-eval's `!function` tags as they are."""


_Loader.add_multi_constructor("!", lambda loader, suffix, node: f"!{suffix} {loader.construct_scalar(node)}")


def _absolute_data_files(config: dict, folder: str) -> dict:
  files = (config.get("dataset_kwargs") or {}).get("data_files")
  if not files:
    return config
  fix = lambda p: p if os.path.isabs(p) or "://" in p else os.path.normpath(os.path.join(folder, p))
  if isinstance(files, str):
    files = fix(files)
  elif isinstance(files, dict):
    files = {k: [fix(p) for p in v] if isinstance(v, list) else fix(v) for k, v in files.items()}
  else:
    files = [fix(p) for p in files]
  for path in ([files] if isinstance(files, str) else files.values() if isinstance(files, dict) else files):
    for p in (path if isinstance(path, list) else [path]):
      if "://" not in p and not os.path.exists(p):
        raise ValueError(f"task {config.get('task', '?')!r}: data file {p} does not exist")
  return {**config, "dataset_kwargs": {**config["dataset_kwargs"], "data_files": files}}


def stage_task_dir(task_dir: str) -> str:
  """A temporary copy of `task_dir` whose YAMLs name their data files by absolute paths."""
  if not os.path.isdir(task_dir):
    raise ValueError(f"--task_dir={task_dir}: no such folder")
  yamls = [os.path.join(root, name) for root, _, names in os.walk(task_dir) for name in names
           if name.endswith((".yaml", ".yml"))]
  if not yamls:
    raise ValueError(f"--task_dir={task_dir} holds no task YAML (*.yaml)")
  staged = tempfile.mkdtemp(prefix="t5x_like_tasks_")
  shutil.rmtree(staged)
  shutil.copytree(task_dir, staged)
  for path in yamls:
    try:
      with open(path, encoding="utf-8") as f:
        config = yaml.load(f, Loader=_Loader)
    except yaml.YAMLError as e:
      raise ValueError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(config, dict):
      raise ValueError(f"{path}: a task YAML must hold a mapping")
    config = _absolute_data_files(config, os.path.dirname(path))
    with open(os.path.join(staged, os.path.relpath(path, task_dir)), "w", encoding="utf-8") as f:
      f.write(re.sub(r"'(!function [^']*)'", r"\1", yaml.safe_dump(config, sort_keys=False, allow_unicode=True)))
  return staged


def require_lm_eval() -> None:
  if TaskManager is None:
    raise ImportError("evaluating tasks needs lm-evaluation-harness: pip install 't5x_like[eval]'")


def task_manager(names: Sequence[str], task_dir: Optional[str] = None):
  """A TaskManager that knows every name: the task folder's first (fast), lm-eval's own only when needed."""
  require_lm_eval()
  if not names:
    raise ValueError("--tasks is empty: name at least one task")
  staged = stage_task_dir(task_dir) if task_dir else None
  local = TaskManager(include_path=staged, include_defaults=False) if staged else None
  if local and all(name in local.all_tasks for name in names):
    return local

  def refuse(unknown):
    where = f"--task_dir={task_dir} nor " if task_dir else ""
    return ValueError(f"unknown task {unknown[0]!r}: not in {where}lm-eval's tasks (python -m lm_eval ls tasks)")

  # a name written in none of lm-eval's task files is none of its tasks: refused without indexing them all
  unknown = [name for name in names if not (local and name in local.all_tasks)
             and name.encode() not in _lm_eval_task_text()]
  if unknown:
    raise refuse(unknown)
  manager = TaskManager(include_path=staged)
  unknown = [name for name in names if name not in manager.all_tasks]
  if unknown:
    raise refuse(unknown)
  return manager


@functools.lru_cache(maxsize=1)
def _lm_eval_task_text() -> bytes:
  """The text of every file in lm-eval's task tree but its Python, joined. Each name lm-eval registers (a task, a
  group or a tag) is written in one of them: in a YAML, or in a file a YAML includes, whatever its name. Reading
  them takes about 0.6 s, against about 9 s for a TaskManager to index them (2-core AVX2 EPYC, lm-eval 0.4.13)."""
  import lm_eval.tasks  # pylint: disable=g-import-not-at-top
  texts = []
  for folder, _, files in os.walk(os.path.dirname(lm_eval.tasks.__file__)):
    for name in files:
      if not name.endswith((".py", ".pyc")):
        with open(os.path.join(folder, name), "rb") as f:
          texts.append(f.read())
  return b"\n".join(texts)


def _data_file(task) -> str:
  files = (getattr(task.config, "dataset_kwargs", None) or {}).get("data_files")
  if isinstance(files, dict):
    files = next(iter(files.values()))
  return str(files[0] if isinstance(files, list) else files) if files else str(task.config.dataset_path)


def load_tasks(names: Sequence[str], manager, num_fewshot: Optional[int] = None) -> dict:
  """lm-eval's task dict for `names`, every document of each checked against what the task reads.

  Raises:
    ValueError: one line naming the task and its data file, and the missing field or the few-shot shortfall.
  """
  try:
    tasks = get_task_dict(list(names), manager)
  except jinja2.exceptions.UndefinedError as e:
    raise ValueError(f"task {names[0] if len(names) == 1 else list(names)}: a document lacks a field its YAML "
                     f"reads ({e})") from None
  except FileNotFoundError as e:
    raise ValueError(f"tasks {list(names)}: {str(e).splitlines()[0]}") from None
  for name, task in _leaves(tasks):
    docs = list(task.eval_docs)
    where = f"task {name!r} ({_data_file(task)})"
    fields = _template_fields(task)
    for i, doc in enumerate(docs):
      missing = sorted(f for f in fields if doc.get(f) is None)  # a JSON-lines dataset fills absent keys with None
      if missing:
        raise ValueError(f"{where}: document {i} lacks the field {missing[0]!r} the task reads (it has "
                         f"{sorted(k for k, v in doc.items() if v is not None)})")
      try:
        task.doc_to_text(doc)
        task.doc_to_target(doc)
        if task.OUTPUT_TYPE == "multiple_choice":
          task.doc_to_choice(doc)
      except jinja2.exceptions.UndefinedError as e:
        raise ValueError(f"{where}: document {i} lacks a field the task reads ({e})") from None
    if num_fewshot:
      separate = task.config.fewshot_split or task.has_training_docs() or task.has_validation_docs()
      pool = len(list(task.fewshot_docs())) if separate else len(docs) - 1  # else: the other test documents
      if num_fewshot > pool:
        raise ValueError(f"{where}: --num_fewshot={num_fewshot} but the data holds only {pool} few-shot "
                         f"examples")
  return tasks


def _template_fields(task) -> set:
  """The document fields the task's Jinja templates (doc_to_text / target / choice) read."""
  env = jinja2.Environment()
  fields = set()
  for attr in ("doc_to_text", "doc_to_target", "doc_to_choice"):
    template = getattr(task.config, attr, None)
    if isinstance(template, str) and "{{" in template:
      fields |= jinja2.meta.find_undeclared_variables(env.parse(template))
  return fields


def _leaves(tasks: dict):
  """(name, Task) of every task in lm-eval's (possibly nested, grouped) task dict."""
  for key, value in tasks.items():
    if isinstance(value, dict):
      yield from _leaves(value)
    else:
      yield getattr(key, "group_name", key) if not isinstance(key, str) else key, value
