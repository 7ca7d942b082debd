"""README.md and the documentation site (docs/, mkdocs.yml).

Every fenced shell block (```bash, ```sh, ```shell, ```console) of README.md and docs/ is read as a user would paste
it, and each command line is checked without running its work: it parses as shell (continuations, `&&` chains, env
assignments, `$VAR` set earlier in the block), the scripts and test paths it names exist, each script defines the
flags given (its module imported, as absl holds them then: importing a script runs no `main`), each
`--config=FILE:PRESET` loads and each `--config.a.b=v` names a field of that config, and each `pip install` extra is
one of setup.cfg's. A block that is no command (sample output) takes another fence language (```text). The slow test
builds the site with `mkdocs build --strict`, where a broken link, anchor, API reference or missing page fails.
"""

from __future__ import annotations

import configparser
import functools
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from absl import flags
import ml_collections
import pytest

from retnet_jax.runs import cli

ROOT = Path(__file__).resolve().parent.parent
SHELL_FENCES = ("bash", "sh", "shell", "console")
_FENCE = re.compile(r"^(\s*)```\s*([\w-]*)")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_VARIABLE = re.compile(r"^\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?$")
# Programs the documented commands may start; anything else (a flag, a placeholder) is a command re-wrapped by mistake.
_PROGRAMS = {"python", "python3", "pip", "bash", "jupyter", "mkdocs", "for", "do", "done", "wait", ".", "source", "cd"}
_SEPARATORS = {";", "&&", "||", "|", "&", ";;"}
_PYTEST_VALUE_OPTIONS = {"-m", "-k", "-n", "-p", "-c", "-o", "-W", "--junitxml", "--durations", "--maxfail"}


def documents() -> list[Path]:
  """README.md and every Markdown page of docs/."""
  return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def shell_blocks(text: str) -> list[tuple[int, str, str]]:
  """The fenced shell blocks of Markdown `text`: (line number of the body's first line, counted from 1, fence
  language, body with the fence's indentation removed)."""
  blocks, lines, index = [], text.splitlines(), 0
  while index < len(lines):
    match = _FENCE.match(lines[index])
    if not match:
      index += 1
      continue
    indent, language = match.group(1), match.group(2)
    body, index = [], index + 1
    while index < len(lines) and not lines[index].strip().startswith("```"):
      line = lines[index]
      body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
      index += 1
    index += 1
    if language in SHELL_FENCES:
      blocks.append((index - len(body), language, "\n".join(body)))
  return blocks


def command_lines(body: str, console: bool = False) -> list[tuple[int, str]]:
  """A block's commands as the shell reads them: a line ending in `\\` or inside an open quote goes on to the next.
  Each is (offset of its first line in the block, text). In a console block only `$ ` lines are commands."""
  commands, current, start = [], "", 0
  for offset, line in enumerate(body.splitlines()):
    if not current:
      if console:
        if not line.startswith("$ "):
          continue
        line = line[2:]
      if not line.strip():
        continue
      start = offset
    current = f"{current}\n{line}" if current else line
    if current.endswith("\\"):
      current = current[:-1] + " "
      continue
    try:
      shlex.split(current, comments=True)
    except ValueError:  # an open quote: the command goes on
      continue
    commands.append((start, current))
    current = ""
  if current:
    commands.append((start, current))
  return commands


def simple_commands(line: str) -> list[list[str]]:
  """The simple commands of one command line (split at `;`, `&&`, `||`, `|`, `&`), each its words."""
  lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()<>")
  lexer.whitespace_split = True
  commands, words = [], []
  for token in lexer:
    if token in _SEPARATORS:
      commands.append(words)
      words = []
    else:
      words.append(token)
  commands.append(words)
  return [words for words in commands if words]


@functools.cache
def script_flags(path: str) -> tuple[frozenset[str], frozenset[str]]:
  """The flags absl holds after importing script `path` (relative to the root), and the boolean ones among them.
  The script's own flags are removed again afterwards, so that the next script can define its `--config`."""
  before = set(flags.FLAGS)
  spec = importlib.util.spec_from_file_location(f"_docs_script_{Path(path).stem}", ROOT / path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)  # under another name than __main__: defines the flags, runs nothing
  names = frozenset(flags.FLAGS)
  booleans = frozenset(name for name in names if flags.FLAGS[name].boolean)
  for name in names - before:
    owner = flags.FLAGS.find_module_defining_flag(name) or ""
    if owner.startswith(("retnet_jax", "importlib", spec.name)):
      delattr(flags.FLAGS, name)
  return names, booleans


@functools.cache
def load_config(spec: str) -> ml_collections.ConfigDict:
  """The config of `--config=FILE:PRESET`, FILE relative to the root."""
  path, _, preset = spec.partition(":")
  return cli.load_config(f"{ROOT / path}:{preset}" if preset else str(ROOT / path))


@functools.cache
def extras() -> frozenset[str]:
  """setup.cfg's extras."""
  parser = configparser.ConfigParser()
  parser.read(ROOT / "setup.cfg")
  return frozenset(parser["options.extras_require"])


def config_field_problem(config: ml_collections.ConfigDict, field: str) -> str | None:
  """Why `--config.FIELD=...` names no field of `config`, or None."""
  node = config
  for depth, part in enumerate(field.split(".")):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      return f"--config.{field}: the config has no field {'.'.join(field.split('.')[:depth + 1])}"
    node = node[part]
  return None


def script_problems(script: str, args: list[str]) -> list[str]:
  """What script `script` would refuse among `args`: flags it does not define, positional words, config fields."""
  if not (ROOT / script).is_file():
    return [f"{script} does not exist"]
  names, booleans = script_flags(script)
  problems, config_spec, fields, index = [], cli.DEFAULT_CONFIG, [], 0
  while index < len(args):
    arg = args[index]
    index += 1
    if not arg.startswith("-"):
      problems.append(f"{script}: {arg!r} is no flag (a placeholder, or a command re-wrapped over lines?)")
      continue
    name, has_value, value = arg.lstrip("-").partition("=")
    if name.startswith("config.") and "config" in names:
      fields.append(name[len("config."):])
    elif name in names or name in {"help", "helpshort", "helpfull"}:
      if name == "config" and has_value:
        config_spec = value
      if not has_value and name not in booleans and index < len(args):
        index += 1  # `--flag value`
    elif not (name.startswith("no") and name[2:] in booleans):
      problems.append(f"{script}: unknown flag --{name}")
  if fields:
    try:
      config = load_config(config_spec)
    except Exception as e:  # pylint: disable=broad-except
      return problems + [f"{script}: --config={config_spec} does not load ({e})"]
    problems += [f"{script}: {problem}" for field in fields if (problem := config_field_problem(config, field))]
  return problems


def pytest_problems(args: list[str]) -> list[str]:
  """Test paths of `python -m pytest ARGS` that do not exist."""
  problems, index = [], 0
  while index < len(args):
    arg = args[index]
    index += 1
    if arg in _PYTEST_VALUE_OPTIONS:
      index += 1
    elif not arg.startswith("-") and not (ROOT / arg.split("::")[0]).exists():
      problems.append(f"pytest: {arg} does not exist")
  return problems


def command_problems(words: list[str]) -> list[str]:
  """What is wrong with one simple command (its words, variables expanded)."""
  while words and words[0] in {"do", "then", "else"}:
    words = words[1:]
  while words and _ASSIGNMENT.match(words[0]):
    words = words[1:]
  if not words:
    return []
  program, args = words[0], words[1:]
  if "(" in words or ")" in words:
    return ["an unquoted '(' or ')' (bash reads a subshell): quote the value"]
  if program not in _PROGRAMS:
    return [f"{program!r} starts a command: a flag or word of the line before, re-wrapped without a backslash?"]
  if program in {"python", "python3"} and args:
    if args[0] == "-m" and args[1:2] == ["pytest"]:
      return pytest_problems(args[2:])
    if args[0].endswith(".py"):
      return script_problems(args[0], args[1:])
  if program == "pip" and args[:1] == ["install"]:
    problems = []
    for arg in args[1:]:
      if match := re.fullmatch(r"\.\[([\w,-]*)\]", arg):
        problems += [f"pip: setup.cfg has no extra {name!r}" for name in match.group(1).split(",")
                     if name not in extras()]
    return problems
  if program == "bash" and args and not (ROOT / args[0]).exists():
    return [f"{program}: {args[0]} does not exist"]
  if program == "jupyter" and args[:1] == ["execute"]:
    return [f"jupyter: {arg} does not exist" for arg in args[1:] if not arg.startswith("-") and
            not (ROOT / arg).exists()]
  return []


def block_problems(body: str, console: bool = False) -> list[tuple[int, str]]:
  """Each problem of a shell block's commands, with the offset of its command's first line in the block."""
  problems, variables = [], {}
  for offset, line in command_lines(body, console):
    try:
      commands = simple_commands(line)
    except ValueError as e:
      problems.append((offset, f"does not parse as shell: {e}"))
      continue
    for words in commands:
      if all(_ASSIGNMENT.match(word) for word in words):  # NAME=value alone: a shell variable for later lines
        variables.update(word.split("=", 1) for word in words)
        continue
      expanded = []
      for word in words:
        match = _VARIABLE.match(word)
        if match and match.group(1) in variables:
          expanded += shlex.split(variables[match.group(1)])
        else:
          expanded.append(word)
      problems += [(offset, problem) for problem in command_problems(expanded)]
  return problems


def test_every_shell_block_of_readme_and_docs_is_a_valid_command(monkeypatch):
  monkeypatch.chdir(ROOT)
  found, problems = 0, []
  for document in documents():
    for first_line, language, body in shell_blocks(document.read_text()):
      found += 1
      for offset, problem in block_problems(body, console=language == "console"):
        problems.append(f"{document.relative_to(ROOT)}:{first_line + offset}: {problem}")
  assert found >= 40, f"only {found} shell blocks found: is the fence parser broken?"
  assert not problems, "\n".join(problems)


def test_readme_is_short_and_keeps_the_first_commands():
  readme = (ROOT / "README.md").read_text()
  assert len(readme.splitlines()) <= 200
  commands = [line for _, _, body in shell_blocks(readme) for _, line in command_lines(body)]
  assert "python scripts/train.py --config=configs/retnet.py:small --workdir=runs/shakespeare" in commands
  assert "python -m pytest -n 2 tests" in commands


def test_shell_blocks_are_found_in_lists_and_text_blocks_are_left_alone():
  text = "- item\n\n  ```bash\n  python scripts/nope.py\n  ```\n\n```text\npython scripts/nope.py\n```\n"
  assert shell_blocks(text) == [(4, "bash", "python scripts/nope.py")]


@pytest.mark.parametrize("body, expected", [
    ("pip install -e '.[test]' && python -m pytest -n 2\n--durations=20 tests", "'--durations=20' starts a command"),
    ("python scripts/train.py --config=configs/retnet.py:small --workdir=runs/x\n  --config.train.steps=5",
     "'--config.train.steps=5' starts a command"),
    ("python scripts/train.py --workdir=runs/x --no_such_flag=1", "unknown flag --no_such_flag"),
    ("python scripts/train.py --workdir=runs/x --config.model.no_such_field=3", "no field model.no_such_field"),
    ("python scripts/train.py --config=configs/transformer.py:small --workdir=runs/x --config.model.chunk_size=64",
     "no field model.chunk_size"),
    ("FLAGS=\"--config=configs/retnet.py:tiny --workdir=runs/x\n  --config.data.mqar.no_pairs=4\"\n"
     "python scripts/evaluate.py $FLAGS", "no field data.mqar.no_pairs"),
    ("python scripts/evaluate.py LOAD_FLAGS --mode=all", "'LOAD_FLAGS' is no flag"),
    ("python scripts/no_such_script.py --workdir=runs/x", "scripts/no_such_script.py does not exist"),
    ("RETNET_TEST_BACKEND=gpu python -m pytest tests/test_no_such_file.py -m 'not slow'",
     "tests/test_no_such_file.py does not exist"),
    ("pip install -e '.[test,no_such_extra]'", "no extra 'no_such_extra'"),
    ("python scripts/train.py --config.mesh.shape=(1,1,2) --workdir=runs/x", "unquoted '('"),
])
def test_a_broken_command_is_reported(monkeypatch, body, expected):
  monkeypatch.chdir(ROOT)
  problems = [problem for _, problem in block_problems(body)]
  assert any(expected in problem for problem in problems), problems


def test_valid_commands_pass(monkeypatch):
  monkeypatch.chdir(ROOT)
  body = ("RETNET_TEST_BACKEND=gpu python -m pytest tests/test_retention.py \\\n  tests/test_model.py -m \"not slow\"\n"
          "for i in 0 1; do XLA_FLAGS=--xla_force_host_platform_device_count=4 python scripts/train.py \\\n"
          "  --config=configs/retnet.py:tiny --workdir=runs/two --process_id=$i & done; wait\n"
          "python scripts/generate.py --workdir=runs/x --prompt=\"ROMEO:\" --temperature 0  # a comment\n"
          "python scripts/gpu_check.py --smoke --nosmoke --out=runs/gpu_check")
  assert block_problems(body) == []
  assert block_problems("$ python scripts/train.py --workdir=runs/x\nan output line --not-a-flag", console=True) == []


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
  if shutil.which("mkdocs") is None and importlib.util.find_spec("mkdocs") is None:
    pytest.skip("mkdocs is not installed: pip install -e '.[docs]'")
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
  command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
             "--site-dir", str(tmp_path / "site")]  # from tmp_path: the notebooks' render cache stays there
  result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  site = tmp_path / "site"
  assert (site / "index.html").is_file()
  assert (site / "api" / "mixers" / "index.html").read_text().count("retnet_jax.mixers.retention.") > 0
  assert (site / "notebooks" / "compare_modes" / "index.html").is_file()
