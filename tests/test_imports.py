"""The package's import structure: no circle between its modules, the data layer loads no model code, the library
loads neither torch nor matplotlib nor the benchmark beside it, no module (of the package, the benchmark or the
scripts) uses another's private names or tells architectures apart by name outside the registry, and what the scripts
import on a plain install is installed with it."""
import ast
import configparser
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "retnet_jax"
BENCHMARKS = REPO / "benchmarks"  # the benchmark, beside the package: not installed, imported by its scripts
DATA_LAYER = ("retnet_jax.input_pipeline.data", "retnet_jax.input_pipeline.tokenizer",
              "retnet_jax.input_pipeline.synthetic", "retnet_jax.input_pipeline.passkey")
MODEL_CODE = ("retnet_jax.models.model", "retnet_jax.evaluation.sampling", "retnet_jax.nn.layers",
              "retnet_jax.mixers.attention", "retnet_jax.mixers.multiscale_retention",
              "retnet_jax.mixers.gated_retention")
# What README's scripts run on the Quickstart install (`pip install -e .`, no extras), plots included.
QUICKSTART = ("retnet_jax.evaluation.evaluate", "retnet_jax.evaluation.passkey_eval",
              "retnet_jax.training.train", "retnet_jax.input_pipeline.prepared")
# What `import retnet_jax`, the Quickstart's scripts and the command line load: no torch, no matplotlib.
LIBRARY_START = ("retnet_jax", *QUICKSTART, "retnet_jax.runs.cli")


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
  """Dotted name -> source file of every module under `package` (a package by its `__init__.py`)."""
  names = {}
  for path in package.rglob("*.py"):
    parts = path.relative_to(package.parent).with_suffix("").parts
    names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return names


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
  """The retnet_jax modules that `name` imports anywhere in its source (module level or inside functions); `from
  package import x` counts as importing the module package.x when x is one, else the package."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Import):
      found |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
      source = ".".join(base + ([node.module] if node.module else []))
      for alias in node.names:
        found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
  return {module for module in found if module in modules and module != name}


def third_party_imports(path: Path) -> set[str]:
  """The top-level names of the modules outside the standard library and retnet_jax that `path` imports anywhere."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Import):
      found |= {alias.name.partition(".")[0] for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and not node.level:
      found.add(node.module.partition(".")[0])
  return found - set(sys.stdlib_module_names) - {"__future__", "retnet_jax"}


def normalized(name: str) -> str:
  """A distribution's name as packaging compares them (PEP 503)."""
  return re.sub(r"[-_.]+", "-", name).lower()


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """A circle of imports `[a, b, ..., a]` in `graph`, or None (depth-first search for an edge back onto the path)."""
  state, path = {}, []  # state: 1 while on the path, 2 when done

  def visit(module):
    state[module] = 1
    path.append(module)
    for target in sorted(graph[module]):
      if state.get(target) == 1:
        return path[path.index(target):] + [target]
      if target not in state and (cycle := visit(target)):
        return cycle
    state[module] = 2
    path.pop()
    return None

  for module in sorted(graph):
    if module not in state and (cycle := visit(module)):
      return cycle
  return None


def test_find_cycle_names_the_circle():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle():
  modules = module_names()
  graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
  # the graph sees `from retnet_jax.runs import workdir as ...`
  assert "retnet_jax.runs.workdir" in graph["retnet_jax.training.train"]
  cycle = find_cycle(graph)
  assert cycle is None, f"import circle: {' -> '.join(cycle)}"


def test_no_import_cycle_between_packages():
  """The subpackages build on each other in one order (docs/models.md): none imports from one that imports it."""
  modules = module_names()
  package = lambda name: ".".join(name.split(".")[:2])
  graph: dict[str, set[str]] = {}
  for name, path in modules.items():
    graph.setdefault(package(name), set()).update(
        package(found) for found in imports_of(name, path, modules) if package(found) != package(name))
  cycle = find_cycle(graph)
  assert cycle is None, f"packages importing each other: {' -> '.join(cycle)}"


def test_quickstart_modules_need_no_extras():
  """Every module the scripts import on the Quickstart install, matplotlib for their plots among them, comes from a
  distribution in install_requires: no ModuleNotFoundError after a result is computed."""
  config = configparser.ConfigParser()
  config.read(PACKAGE.parent / "setup.cfg")
  required = {normalized(re.split(r"[<>=!~\[ ;]", line.strip())[0])
              for line in config["options"]["install_requires"].splitlines() if line.strip()}
  distributions = importlib.metadata.packages_distributions()
  modules = module_names()
  for name in QUICKSTART:
    for module in third_party_imports(modules[name]):
      assert {normalized(d) for d in distributions.get(module, [module])} & required, (
          f"{name} imports {module}, which install_requires does not provide")


@pytest.mark.slow
def test_data_layer_loads_no_model_code():
  """In a fresh interpreter, one after the other: the data layer, the tokenizers, the synthetic tasks and the passkey
  examples, none of which may load the model or the sampler."""
  code = ("import importlib, sys\n"
          f"for name in {DATA_LAYER!r}:\n"
          "  importlib.import_module(name)\n"
          f"  if loaded := sorted(m for m in {MODEL_CODE!r} if m in sys.modules):\n"
          "    sys.exit(f'import {name} loads {loaded}')")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]


def test_the_library_loads_neither_torch_nor_matplotlib():
  """In a fresh interpreter, one after the other: `import retnet_jax`, the modules README's Quickstart scripts import
  and the command line, none of which may load torch (seconds of every script's start; only the converters' checks
  and the benchmark use it) or matplotlib (imported where a plot is drawn, not where a module is)."""
  code = ("import importlib, sys\n"
          f"for name in {LIBRARY_START!r}:\n"
          "  importlib.import_module(name)\n"
          "  if loaded := sorted(m for m in ('torch', 'matplotlib') if m in sys.modules):\n"
          "    sys.exit(f'import {name} loads {loaded}')")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]


def test_the_library_imports_nothing_of_the_benchmark():
  """The benchmark moved out of the package (its bench/ subpackage) to benchmarks/ beside it, which `pip install`
  leaves out: no module of retnet_jax may import it."""
  assert not list((PACKAGE / "bench").rglob("*.py")), "the package holds bench/ again: the benchmark is benchmarks/"
  found = sorted(str(path.relative_to(REPO)) for path in PACKAGE.rglob("*.py")
                 if "benchmarks" in third_party_imports(path))
  assert not found, f"modules of the library importing the benchmark (benchmarks/ is not installed): {found}"


def private_uses(path: Path, modules: dict[str, Path]) -> list[str]:
  """`alias._name` uses (and `from module import _name`) in `path` of the private names of another module of
  `modules`."""
  aliases, found = {}, []
  packages = {name.partition(".")[0] for name in modules}
  tree = ast.parse(path.read_text(encoding="utf-8"))
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.partition(".")[0] in packages:
      for alias in node.names:
        if f"{node.module}.{alias.name}" in modules:
          aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif alias.name.startswith("_"):
          found.append(f"from {node.module} import {alias.name}")
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name in modules and alias.asname:
          aliases[alias.asname] = alias.name
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
        and node.attr.startswith("_") and not node.attr.startswith("__")):
      found.append(f"{aliases[node.value.id]}.{node.attr} (line {node.lineno})")
  return found


def test_no_module_uses_another_modules_private_names():
  modules = {**module_names(), **module_names(BENCHMARKS)}
  uses = {str(path.relative_to(REPO)): private_uses(path, modules) for path in modules.values()}
  uses.update({str(path.relative_to(REPO)): private_uses(path, modules)
               for path in sorted((REPO / "scripts").glob("*.py"))})
  uses = {path: found for path, found in uses.items() if found}
  assert not uses, f"private names used across modules (make them public where shared): {uses}"


# A test of a model family by name: `cfg.architecture == "transformer"`, `architecture(cfg) != ...`,
# `"retnet" == cfg.get("architecture")`.
ARCHITECTURE_SWITCH = re.compile(r"\barchitecture\b.*(?:[!=]=|\bin\s*[(\[])|(?:[!=]=).*\barchitecture\b")
REGISTRY = PACKAGE / "models" / "architectures.py"


def architecture_switches(source: str) -> list[str]:
  """The lines of `source` that switch on an architecture's name (comments aside)."""
  return [line.strip() for line in source.splitlines() if ARCHITECTURE_SWITCH.search(line.split("#")[0])]


def test_no_architecture_switch_outside_the_registry():
  """Only `architectures` tells model families apart by name; everything else asks the mixers it gives."""
  assert architecture_switches('  if cfg.architecture == "transformer":\n    pass') and architecture_switches(
      'if "retnet" != architectures.architecture(model):') and not architecture_switches('name = cfg.architecture')
  files = [path for path in PACKAGE.rglob("*.py") if path != REGISTRY]
  files += sorted((PACKAGE.parent / "scripts").glob("*.py"))
  found = {str(path.relative_to(PACKAGE.parent)): lines for path in files
           if (lines := architecture_switches(path.read_text()))}
  assert not found, f"architecture switches outside the registry, models/architectures.py (ask its mixers): {found}"
