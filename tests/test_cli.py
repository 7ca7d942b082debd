"""The scripts' shared command line: bad flags, config fields, environment and signals before training end in one
line of error, no traceback."""

import ast
import importlib.util
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from absl import flags
from absl import logging as absl_logging
import pytest

from retnet_jax.core import quiet_start
from retnet_jax.runs import cli
from retnet_jax.training import metrics
from tests.helpers import REPO, free_port, run_script, script_lines


@pytest.mark.slow
@pytest.mark.parametrize("flags,message", [
    (["--config.train.stpes=3"], r'error: --config.train.stpes names no config field: .*Did you mean "steps"'),
    (["--config=configs/retnet.py:huge"], r"error: flag --config=configs/retnet.py:huge: ValueError: unknown preset "
                                          r"'huge'; choose one of"),
    (["--config.train.steps=abc"], r"error: flag --config.train.steps=abc: invalid literal"),
    (["--config.train.learning_rate=-1"], r"error: train.learning_rate must be positive; got -1.0. \(ValueError; "
                                          r"--verbose shows the traceback\)"),
    (["--workdir="], r"error: flag --workdir=: --workdir is empty \(an unset shell variable\?\); name the run's "
                     r"directory"),
    (["--num_processes=2"], r"error: --num_processes=2 / --process_id=None without --coordinator_address"),
    (["--coordinator_address=not_a_host:xx", "--num_processes=2", "--process_id=0"],
     r"error: --coordinator_address='not_a_host:xx' must be HOST:PORT of process 0"),
])
def test_errors_are_one_message(tmp_path, flags, message):
  result = run_script("train.py", f"--workdir={tmp_path / 'run'}", *flags)
  assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert re.search(message, result.stderr), result.stderr[-3000:]
  assert not (tmp_path / "run").exists()  # refused before the workdir is touched


@pytest.mark.slow
@pytest.mark.parametrize("script,listed", [
    ("train.py", ("--config", "--workdir", "--coordinator_address", "--verbose", "--xla_gpu_flags")),
    ("evaluate.py", ("--config", "--workdir", "--step")),
])
def test_help_lists_the_shared_flags(script, listed):
  """--help names the flags a script takes from retnet_jax.runs.cli beside its own, --workdir marked required and
  --config with how to override its fields, and help asked for is no error."""
  result = run_script(script, "--help")
  assert result.returncode == 0, result.stderr[-3000:]
  shown = set(re.findall(r"^  --(?:\[no\])?(\w+)", result.stdout, flags=re.MULTILINE))
  assert {flag.removeprefix("--") for flag in listed} <= shown, result.stdout
  workdir = re.search(r"^  --workdir: (.*(?:\n    .*)*)", result.stdout, flags=re.MULTILINE)  # wrapped lines
  assert workdir and " ".join(workdir[1].split()).endswith(cli.REQUIRED.strip()), result.stdout
  assert "--config=configs/retnet.py:NAME --config.model.d_model=" in " ".join(result.stdout.split()), result.stdout


def test_help_marks_the_required_flags_and_points_to_the_config_reference(monkeypatch):
  """--help named neither the --config.* fields nor that --workdir must be given: the flags a script takes from cli
  and its own are listed under its name, the required ones marked, --config's with where its fields are."""
  monkeypatch.chdir(REPO)  # --config's default file is read as the flag is defined
  flag_values = flags.FlagValues()
  cli.config_flag("Config file and preset.", flag_values)
  cli.workdir_flag("Run directory.", flag_values)
  cli.positive_float_flag("max_hours", 2.0, "Hours.", flag_values=flag_values)
  flags.DEFINE_string("out", None, "Output folder.", required=True, flag_values=flag_values)  # the script's own
  flags.DEFINE_string("note", None, "Optional.", flag_values=flag_values)
  cli.show_in_help(__name__, flag_values)
  cli.show_in_help(__name__, flag_values)  # once marked is enough
  text = " ".join(flag_values.module_help(__name__).split())
  for line in ("--workdir: Run directory. (required)", "--out: Output folder. (required)", "--note: Optional. --"):
    assert line in text, text
  assert "--max_hours: Hours. (default: '2.0')" in text, text
  assert ("--config: Config file and preset. NAME is a preset of retnet_jax.models.presets.PRESETS (tiny, small"
          in text and "retnet_jax/models/presets.py defines every field" in text), text
  assert "--config=configs/retnet.py:NAME --config.model.d_model=256 --config.train.steps=500" in text, text


def _record(level: int, path: str, message: str) -> logging.LogRecord:
  return logging.LogRecord("absl", level, path, 147, message, None, None)


def test_the_package_info_lines_reach_the_terminal_without_the_log_prefix(monkeypatch, tmp_path):
  """Every progress line began with absl's prefix (`I1127 05:52:59.881634 140589851503488 metrics.py:147] `): on
  the terminal this package's INFO lines are their text alone; warnings, other libraries' lines and a log file's
  lines keep the prefix."""
  handler = absl_logging.get_absl_handler().python_handler
  monkeypatch.setattr(handler, "stream", sys.stderr)
  formatter = cli.ConsoleFormatter()
  progress = _record(logging.INFO, metrics.__file__, "step 50/900 (6%) | loss 2.1000")
  assert formatter.format(progress) == "step 50/900 (6%) | loss 2.1000"
  prefix = re.compile(r"^[IWE]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] ")
  for record in (_record(logging.WARNING, metrics.__file__, "metrics.jsonl was deleted"),
                 _record(logging.ERROR, metrics.__file__, "could not write"),
                 _record(logging.INFO, str(Path(flags.__file__)), "another library's line")):
    assert prefix.match(formatter.format(record)), formatter.format(record)
  with open(tmp_path / "log", "w", encoding="utf-8") as log_file:  # absl's file logging (--log_dir)
    monkeypatch.setattr(handler, "stream", log_file)
    assert formatter.format(progress).startswith("I") and prefix.match(formatter.format(progress))


def test_script_docstrings_keep_their_lines():
  """A script's docstring is its --help: a lone `\\` ending a line of a usage example (a shell continuation) would
  join the string's lines there; it is written `\\\\` or in a raw docstring."""
  for path in sorted((REPO / "scripts").glob("*.py")):
    node = ast.parse(path.read_text(encoding="utf-8")).body[0].value
    assert node.value.count("\n") == node.end_lineno - node.lineno, f"{path.name}: a `\\` joins its docstring's lines"


@pytest.mark.slow
def test_verbose_keeps_the_traceback(tmp_path):
  result = run_script("train.py", f"--workdir={tmp_path / 'run'}", "--config.train.learning_rate=-1", "--verbose")
  assert result.returncode != 0 and "Traceback" in result.stderr and "learning_rate must be positive" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("env,message", [
    ({"JAX_NUM_PROCESSES": "abc"}, r"error: JAX_NUM_PROCESSES='abc' must be an integer of at least 1: set it to the "
                                   r"num processes, or unset it and pass --num_processes"),
    ({"JAX_PLATFORMS": "tpu"}, r"error: Unable to initialize backend 'tpu'.*JAX_PLATFORMS='tpu' names it: set "
                               r"JAX_PLATFORMS to a platform this machine has"),
])
def test_environment_errors_are_one_message(tmp_path, env, message):
  result = run_script("train.py", f"--workdir={tmp_path / 'run'}", "--config=configs/retnet.py:tiny", **env)
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert re.search(message, result.stderr), result.stderr[-3000:]
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags,env,expected", [
    ((None, None, None), {}, None),
    (("127.0.0.1:1234", 2, 1), {}, ("127.0.0.1:1234", 2, 1)),
    ((None, None, None), {"JAX_COORDINATOR_ADDRESS": "localhost:99", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
     ("localhost:99", 2, 0)),
    (("localhost:99", 4, 3), {"JAX_NUM_PROCESSES": "abc"}, ("localhost:99", 4, 3)),  # flags before the environment
])
def test_distributed_settings_come_from_flags_then_environment(flags, env, expected):
  assert cli.check_distributed(*flags, env) == expected


@pytest.mark.parametrize("flags,env,message", [
    ((None, None, None), {"JAX_NUM_PROCESSES": "abc"}, r"JAX_NUM_PROCESSES='abc' must be an integer of at least 1"),
    ((None, None, None), {"JAX_PROCESS_ID": "x"}, r"JAX_PROCESS_ID='x' must be an integer of at least 0"),
    ((None, None, None), {"JAX_PROCESS_ID": "-1"}, r"JAX_PROCESS_ID='-1' must be an integer of at least 0"),
    ((None, 2, None), {}, r"--num_processes=2 / --process_id=None without --coordinator_address"),
    (("not_a_host:xx", 2, 0), {}, r"--coordinator_address='not_a_host:xx' must be HOST:PORT"),
    (("1234", 2, 0), {}, r"--coordinator_address='1234' must be HOST:PORT"),
    (("localhost:70000", 2, 0), {}, r"must be HOST:PORT"),
    (("not_a_host.invalid:1234", 2, 0), {}, r"the host 'not_a_host.invalid' does not resolve"),
    (("localhost:1234", 2, None), {}, r"needs --num_processes and --process_id"),
    (("localhost:1234", 2, 2), {}, r"--process_id=2 must be below --num_processes=2"),
])
def test_distributed_settings_refuse_what_would_fail_later(flags, env, message):
  with pytest.raises(ValueError, match=message):
    cli.check_distributed(*flags, env)


JOIN = """
from retnet_jax.runs import cli
cli.prepare()
start = cli.distributed_flags()
cli.run(lambda: (start(), print("joined")))
"""


def test_a_coordinator_nobody_answers_is_named_before_and_when_giving_up():
  """A process whose coordinator never answers (nothing listens at the port), and a process 0 whose peers never
  come, said nothing until JAX aborted with a stack dump at --initialization_timeout: each names what it waits for
  and how long, then gives up in one line naming the address and the fix."""
  ports = [free_port(), free_port()]
  processes = [subprocess.Popen([sys.executable, "-c", JOIN, f"--coordinator_address=127.0.0.1:{port}",
                                 "--num_processes=2", f"--process_id={index}", "--initialization_timeout=3"],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"})
               for index, port in zip((1, 0), ports)]
  started = time.monotonic()
  results = [process.communicate(timeout=60) for process in processes]
  assert time.monotonic() - started < 30
  for (stdout, stderr), process, index, port in zip(results, processes, (1, 0), ports):
    lines = [line for line in script_lines(stderr) if "distributed.py" not in line]  # JAX's own INFO lines
    address = f"127.0.0.1:{port}"
    assert process.returncode == 1 and "joined" not in stdout and len(lines) == 2, stderr[-3000:]
    if index == 1:
      assert lines == [
          f"process 1 of 2: waiting up to 3 s (--initialization_timeout) to join the coordinator at {address} "
          "(process 0)",
          f"error: process 1 of 2 gave up after --initialization_timeout=3 s: nothing listens at {address}; start "
          f"process 0 (--process_id=0) on that host with --coordinator_address={address}, or give the address "
          "process 0 serves (or raise --initialization_timeout)."], stderr
    else:
      assert lines == [
          f"process 0 of 2: serving the coordinator at {address}; waiting up to 3 s (--initialization_timeout) for "
          "the other 1 process to connect",
          f"error: process 0 of 2 gave up after --initialization_timeout=3 s: not every one of the 2 processes "
          f"connected to {address}; start all 2 processes (--process_id=0 to 1) with the same "
          "--coordinator_address and --num_processes=2 (or raise --initialization_timeout)."], stderr


@pytest.mark.slow
def test_a_signal_during_start_up_is_one_line(tmp_path):
  """SIGTERM, Ctrl-C or SIGHUP while the script imports and starts: one line and exit status 128 + the signal."""
  processes = {}
  for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    processes[sig] = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "train.py"), "--config=configs/retnet.py:tiny",
         f"--workdir={tmp_path / sig.name}"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  time.sleep(1.5)  # past cli.prepare, within the imports of jax and the package
  for sig, process in processes.items():
    process.send_signal(sig)
  for sig, process in processes.items():
    _, stderr = process.communicate(timeout=120)
    lines = script_lines(stderr)
    assert process.returncode == 128 + sig and len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith(f"error: stopped by {sig.name}; ") and "rerun the same command" in lines[0], stderr


def test_dropped_notes_pass_on_every_other_line(capfd):
  with quiet_start.dropped_notes():
    os.write(2, b"kept line\nI0000 cudart_stub.cc:31] Could not find cuda drivers\nsecond kept\n")
  assert capfd.readouterr().err == "kept line\nsecond kept\n"


@pytest.mark.skipif(quiet_start.accelerator_present(), reason="this machine has an accelerator: JAX keeps it")
@pytest.mark.skipif(importlib.util.find_spec("jax_plugins") is None, reason="no accelerator plugin installed")
def test_without_an_accelerator_the_plugins_start_quietly_on_the_cpu():
  """With the CUDA/TPU plugins installed (the aot extra) and no accelerator, plugin discovery printed two tracebacks
  and libtpu's warnings before each script's output."""
  env = {name: value for name, value in os.environ.items() if name != "JAX_PLATFORMS"}
  code = "from retnet_jax.runs import cli; cli.prepare(); import jax; print(jax.devices()[0].platform)"
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=120)
  assert result.returncode == 0 and result.stdout.strip() == "cpu", result.stderr
  for noise in ("Traceback", "plugin configuration error", "libtpu", "TPU"):
    assert noise not in result.stderr, result.stderr


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1"])
def test_a_positive_float_flag_refuses_what_would_turn_its_guard_off(value):
  """passkey.py --max_hours=nan was accepted (absl's lower_bound passes nan), turning its time guard off."""
  flag_values = flags.FlagValues()
  cli.positive_float_flag("max_hours", 2.0, "Hours.", flag_values=flag_values)
  with pytest.raises(flags.IllegalFlagValueError, match=r"flag --max_hours=\S+: --max_hours must be a "
                                                        "positive, finite number"):
    flag_values(["script", f"--max_hours={value}"])
  flag_values(["script", "--max_hours=0.5"])
  assert flag_values.max_hours == 0.5


@pytest.mark.parametrize("script,flag,line", [
    # absl's own flags (stderrthreshold) are not offered for a mistyped --steps
    ("train.py", "--stpes=3", "error: unknown flag --stpes; did you mean --config.train.steps?"),
    ("passkey.py", "--smaples=3", "error: unknown flag --smaples; did you mean --samples?"),
    ("prepare_data.py", "--qwerty=3", "error: unknown flag --qwerty."),
])
def test_a_misspelt_flag_is_met_with_the_scripts_own_names(script, flag, line):
  result = run_script(script, "--workdir=unused" if script != "prepare_data.py" else "--out=unused", flag)
  assert result.returncode != 0 and script_lines(result.stderr)[0] == line, result.stderr[-2000:]


def test_a_seed_beyond_64_bits_is_refused_by_range():
  """generate.py --seed=99999999999999999999 ended in an OverflowError inside jax.random.key."""
  result = run_script("generate.py", "--workdir=unused", "--seed=99999999999999999999")
  assert result.returncode != 0 and "Traceback" not in result.stderr
  assert script_lines(result.stderr)[0] == ("error: flag --seed=99999999999999999999: 99999999999999999999 is not an "
                                            "integer in the range [0, 9223372036854775807]")
