"""The import graph of t5x_like, read from the source (nothing is imported): `python tests/import_graph.py`.

Prints each module's line count and t5x_like imports, then the checks tests/test_imports.py enforces:
no module over 450 lines, no import cycle, no t5x_like import inside a function, no `jax._src`, nothing imports an entry point,
and subpackages import only the layers below them. Root-level modules other than the entry points and
cli.py (`t5x_like/errors.py`, `t5x_like/files.py`) are helpers every layer may import; they import no
other layer.
"""

import ast
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "t5x_like")
ENTRY_POINTS = {"train", "preprocess", "infer", "evaluate", "convert", "checkpoints", "plot", "plan", "serve", "sweep",
                "scaling"}
MAX_LINES = 450  # a module past this is split along a clear seam (DESIGN.md)
# What each layer may import (besides itself and the root-level helpers).
ALLOWED = {
    "root": set(),
    "parallel": set(),
    "data": {"parallel"},
    "model": {"parallel"},
    "observe": {"model", "data", "parallel"},
    "training": {"observe", "model", "data", "parallel"},
    "inference": {"training", "observe", "model", "data", "parallel"},
    "posttrain": {"inference", "training", "observe", "model", "data", "parallel"},
    "recipes": {"posttrain", "inference", "training", "observe", "model", "data", "parallel"},
    "evaluation": {"cli", "recipes", "posttrain", "inference", "training", "observe", "model", "data", "parallel"},
    "planning": {"posttrain", "training", "observe", "model", "parallel"},  # posttrain: LoRA / QLoRA memory
    "interop": {"posttrain", "training", "model", "data", "parallel"},
    "cli": {"recipes", "posttrain", "inference", "training", "model", "observe", "data", "parallel"},
    # many runs: sweeps launch the train entry point as subprocesses and validate gin through cli
    "experiments": {"cli", "planning", "recipes", "posttrain", "inference", "training", "model", "observe", "data",
                    "parallel"},
}


def modules() -> dict:
  """{dotted name: path} of every module under t5x_like/."""
  out = {}
  for folder, _, files in os.walk(ROOT):
    for name in files:
      if name.endswith(".py"):
        rel = os.path.relpath(os.path.join(folder, name), os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
        out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(folder, name)
  return out


def _targets(node, known) -> list:
  """t5x_like modules an import node names (`from t5x_like.x import y` → t5x_like.x.y if a module)."""
  if isinstance(node, ast.Import):
    return [a.name for a in node.names if a.name.startswith("t5x_like")]
  if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("t5x_like"):
    return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names]
  return []


def scan(path: str, known) -> tuple:
  """(module-level t5x_like imports, function-level ones, jax._src imports) of one file."""
  tree = ast.parse(open(path, encoding="utf-8").read(), path)
  top, nested, private = set(), [], []

  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
      if isinstance(child, (ast.Import, ast.ImportFrom)):
        names = [a.name for a in child.names] if isinstance(child, ast.Import) else [child.module or ""]
        private.extend(n for n in names if n.startswith("jax._src"))
        for target in _targets(child, known):
          (nested.append((child.lineno, target)) if in_function else top.add(target))
      visit(child, inside)

  visit(tree, False)
  return top, nested, private


def layer(module: str) -> str:
  """'entry', 'cli', a subpackage name, or 'root' for the package and its root-level helper modules."""
  parts = module.split(".")
  if len(parts) == 1:
    return "root"
  if len(parts) == 2 and parts[1] in ENTRY_POINTS:
    return "entry"
  if len(parts) == 2 and parts[1] != "cli" and not os.path.isdir(os.path.join(ROOT, parts[1])):
    return "root"
  return parts[1]


def graph() -> tuple:
  known = modules()
  edges, problems = {}, []
  for name, path in sorted(known.items()):
    top, nested, private = scan(path, known)
    lines = sum(1 for _ in open(path, encoding="utf-8"))
    if lines > MAX_LINES:
      problems.append(f"{name} has {lines} lines (more than {MAX_LINES}): split it along a clear seam")
    edges[name] = sorted(t for t in top if t != name and t != "t5x_like")
    for lineno, target in nested:
      problems.append(f"{name}:{lineno} imports {target} inside a function")
    for target in private:
      problems.append(f"{name} imports {target} (private JAX API)")
    src = layer(name)
    for target in edges[name]:
      dst = layer(target)
      if dst == "entry":
        problems.append(f"{name} imports the entry point {target}")
      elif src in ALLOWED and dst != src and dst != "root" and dst not in ALLOWED[src]:
        problems.append(f"{name} ({src}) imports {target} ({dst}): against the layering")
  problems += [f"import cycle: {' → '.join(c)}" for c in cycles(edges)]
  return known, edges, problems


def cycles(edges: dict) -> list:
  """Every strongly connected component of more than one module (Tarjan), as a path."""
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def strong(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in edges.get(v, ()):
      if w not in index:
        strong(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component) + [sorted(component)[0]])

  sys.setrecursionlimit(10000)
  for v in list(edges):
    if v not in index:
      strong(v)
  return out


def main() -> int:
  known, edges, problems = graph()
  total = 0
  for name in sorted(known):
    lines = sum(1 for _ in open(known[name], encoding="utf-8"))
    total += lines
    short = [e.replace("t5x_like.", "") for e in edges[name]]
    print(f"{lines:5d}  {name:40s} → {', '.join(short) or '-'}")
  print(f"{total:5d}  lines in {len(known)} modules")
  print("\n".join(problems) if problems else "no cycles, no function-level imports, no jax._src, layering kept, no module over 450 lines")
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
