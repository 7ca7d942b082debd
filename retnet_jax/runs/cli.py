"""What the scripts share: the host-memory setting made first, their common flags, and the absl entry point.

    from retnet_jax.runs import cli
    if __name__ == "__main__":
      cli.prepare()  # before numpy and jax are imported
    ...
    _CONFIG = cli.config_flag("Config file and preset.")
    if __name__ == "__main__":
      cli.run(main)

`load_config` reads a config file and preset as `--config` takes them, outside absl (lm-eval's model_args).
Importing this module imports neither numpy nor jax, so `prepare` can still act on every thread they start.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from absl import app, flags
from absl import logging as absl_logging
import ml_collections
from ml_collections import config_flags

from retnet_jax.core import config_checks, host_memory, owned_folders, quiet_start
from retnet_jax.models import presets
from retnet_jax.runs import flag_messages, workdir_lock

DEFAULT_CONFIG = "configs/retnet.py:small"
# What --help says under --config: the presets, where their fields are documented, how to override and list them.
CONFIG_REFERENCE = (
    f"NAME is a preset of retnet_jax.models.presets.PRESETS ({', '.join(presets.PRESETS)}); "
    "configs/transformer.py:NAME is the Transformer of its size. retnet_jax/models/presets.py defines every field "
    "and its default (configs/retnet.py selects a preset). Override any field on the command line: "
    "--config=configs/retnet.py:NAME --config.model.d_model=256 --config.train.steps=500. List a preset's fields "
    "and values: python -c \"from configs import retnet; print(retnet.get_config('NAME'))\" (from the repository "
    "root); a run's config.json holds the config it used.")
REQUIRED = " (required)"  # ends the --help text of a flag that must be given (`show_in_help`)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # retnet_jax/


def prepare() -> None:
  """Process-wide settings that must precede numpy and jax: the CPU where this machine has no accelerator
  (`quiet_start`), `host_memory.keep_freed_memory` (CPU backend), and SIGTERM / SIGINT / SIGHUP outside the training
  steps (start-up, compilation, evaluation) as one line and exit status 128 + the signal's number (training's steps
  take them as a stop request: `retnet_jax.training.preemption`)."""
  cpu_only = quiet_start.use_cpu_without_accelerators()
  host_memory.keep_freed_memory()
  if cpu_only:
    quiet_start.import_jax_quietly()
  for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(signum, _exit_on_signal)


def _exit_on_signal(signum: int, frame: Any) -> None:
  """Ends the script at once with one line naming the signal and what the workdir keeps. At once: like SIGKILL it
  loses nothing committed (a save in flight is orbax's temporary folder), and exit handlers would wait on work
  the user asked to stop."""
  sys.stdout.flush()
  sys.stderr.write(f"error: stopped by {signal.Signals(signum).name}; {_kept()}\n")
  sys.stderr.flush()
  os._exit(128 + signum)


def _kept() -> str:
  """What an interrupted run leaves: the newest checkpoint step of --workdir and how to go on."""
  workdir = flags.FLAGS["workdir"].value if "workdir" in flags.FLAGS and flags.FLAGS.is_parsed() else None
  workdir_lib = sys.modules.get("retnet_jax.runs.workdir")  # loaded by then if the script uses one (no import here)
  if not workdir or workdir_lib is None:
    return "rerun the same command (a training run resumes from its last checkpoint)."
  steps = workdir_lib.listed_steps(workdir)
  kept = f"the last checkpoint in {workdir} is step {steps[-1]}" if steps else f"{workdir} holds no checkpoint"
  return f"{kept}: rerun the same command to go on from there."


def config_flag(help_text: str, flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
  """`--config=FILE:PRESET` (locked: a misspelt `--config.x.y` is an error) with `--config.x.y=...` overrides; its
  --help is `help_text` followed by CONFIG_REFERENCE.

  ml_collections reads the overrides of sys.argv as the flag is defined: one that names no field ends the
  script with one line naming it and the nearest field names.

  Args:
    help_text: what the script takes the config for. flag_values: where to define it (the scripts': flags.FLAGS).
  """
  try:
    return config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, f"{help_text} {CONFIG_REFERENCE}",
                                           flag_values=flag_values, lock_config=True)
  except (AttributeError, KeyError) as e:
    sys.exit(flag_messages.unknown_field(sys.argv, e))


def command_line_config(holder: flags.FlagHolder) -> tuple[bool, tuple[str, ...]]:
  """Whether `holder`'s config flag (--config) was named on the command line, and the fields its --config.x.y
  overrides set there (e.g. ("model.dtype",)), for `workdir.script_config`."""
  prefix = holder.name + "."
  return (bool(flags.FLAGS[holder.name].present),
          tuple(name[len(prefix):] for name in flags.FLAGS if name.startswith(prefix) and flags.FLAGS[name].present))


def given_flags() -> list[str]:
  """The flags given on the command line, each as `--name=value` (sorted): the settings a results file records."""
  return sorted(flags.FLAGS[name].serialize() for name in flags.FLAGS if flags.FLAGS[name].present)


def load_config(spec: str, overrides: dict[str, Any] | None = None) -> ml_collections.ConfigDict:
  """The config of `spec`, a config file and preset as `--config` takes them (`configs/retnet.py:small`), with
  `overrides` ({"model.dtype": "float32"}, as `--config.model.dtype=float32`) applied."""
  path, _, preset = str(spec).partition(":")
  if not Path(path).is_file():
    raise ValueError(f"config={spec!r}: {path!r} is not a file; give a config file and preset as --config takes "
                     "them, e.g. config=configs/retnet.py:small.")
  module_spec = importlib.util.spec_from_file_location("retnet_jax_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return apply_overrides(module.get_config(preset or None), overrides or {})


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict[str, Any]) -> ml_collections.ConfigDict:
  """`config` with `overrides` ({"model.dtype": "float32"}, as `--config.model.dtype=float32`; a tuple field takes
  its Python literal) set in place; each that names no field or does not fit its field is refused by name."""
  for name, value in overrides.items():
    *parents, field = name.split(".")
    node = config
    try:
      for parent in parents:
        node = node[parent]
      current = node[field]
    except (KeyError, AttributeError, TypeError):
      raise ValueError(f"config.{name} names no config field; check the spelling against the config file.") from None
    if isinstance(current, tuple) and isinstance(value, str):
      value = ast.literal_eval(value)
    try:
      node[field] = value
    except (TypeError, ValueError) as e:
      raise ValueError(f"config.{name}={value!r} does not fit the field ({e}); give a "
                       f"{type(current).__name__}.") from None
  return config


def workdir_flag(help_text: str, flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
  """The required `--workdir`, refused when empty (`--workdir=$UNSET` would mean the current directory).

  Args:
    help_text: what the directory holds. flag_values: where to define it (the scripts': flags.FLAGS).
  """
  holder = flags.DEFINE_string("workdir", None, help_text, required=True, flag_values=flag_values)
  flags.register_validator("workdir", lambda value: value is None or bool(value.strip()),
                           "--workdir is empty (an unset shell variable?); name the run's directory, e.g. "
                           "--workdir=runs/NAME", flag_values=flag_values)
  return holder


def take_folder_flag() -> flags.FlagHolder:
  """`--take_folder`: write into an output folder that holds files this project did not write (no mark), beside
  them; none of them is touched, and a name the script writes that the folder holds is still refused."""
  return flags.DEFINE_boolean(owned_folders.TAKE_FLAG.removeprefix("--"), False, "Write into an output folder "
                              "holding files this project did not write, beside them (it touches none of them).")


def step_flag(help_text: str) -> flags.FlagHolder:
  """`--step`: a checkpoint step; None for the latest."""
  return flags.DEFINE_integer("step", None, help_text)


def seed_flag(help_text: str) -> flags.FlagHolder:
  """`--seed`, an integer in [0, config_checks.MAX_SEED]: one outside is a usage error naming the range, before any
  work (a larger one overflowed deep inside jax.random.key)."""
  return flags.DEFINE_integer("seed", 0, help_text, lower_bound=0, upper_bound=config_checks.MAX_SEED)


def prefill_block_flag() -> flags.FlagHolder:
  """`--prefill_block`: tokens per block of a streamed prefill (`sampling.Sampler.prefill`); None: the default."""
  return flags.DEFINE_integer("prefill_block", None, "Tokens per block of the prompt's prefill, a multiple of "
                              "model.chunk_size: its memory is one block's at any prompt length (default: 2048 in "
                              "whole chunks; 0: the whole prompt in one call).")


def positive_float_flag(name: str, default: float, help_text: str,
                        flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
  """A float flag refused, naming it, unless positive and finite: absl's bounds let `nan` through (every
  comparison with it is false), which would turn off a guard such as a time limit.

  Args:
    name, default, help_text: as `flags.DEFINE_float`. flag_values: where to define it (the scripts': flags.FLAGS).
  """
  holder = flags.DEFINE_float(name, default, help_text, flag_values=flag_values)
  flags.register_validator(name, lambda value: value is None or 0 < value < float("inf"),
                           f"--{name} must be a positive, finite number", flag_values=flag_values)
  return holder


def distributed_flags() -> Callable[[], None]:
  """`--coordinator_address`, `--num_processes`, `--process_id` (defaults: $JAX_COORDINATOR_ADDRESS,
  $JAX_NUM_PROCESSES, $JAX_PROCESS_ID); returns the function that checks them and, when a coordinator is named,
  starts `jax.distributed` (call it first in `main`, before anything asks for devices)."""
  coordinator = flags.DEFINE_string("coordinator_address", None, "host:port of process 0, for multi-process "
                                    "training (default: $JAX_COORDINATOR_ADDRESS).")
  num_processes = flags.DEFINE_integer("num_processes", None, "Number of processes, for multi-process training "
                                       "(default: $JAX_NUM_PROCESSES).", lower_bound=1)
  process_id = flags.DEFINE_integer("process_id", None, "This process's index from 0, for multi-process training "
                                    "(default: $JAX_PROCESS_ID).", lower_bound=0)
  heartbeat = flags.DEFINE_integer("heartbeat_timeout", 100, "Seconds without a heartbeat after which the other "
                                   "processes count a process as lost and stop.", lower_bound=1)
  start_timeout = flags.DEFINE_integer("initialization_timeout", 300, "Seconds to wait for every process to "
                                       "connect.", lower_bound=1)

  def initialize() -> None:
    settings = check_distributed(coordinator.value, num_processes.value, process_id.value, os.environ)
    if settings is None:
      return
    import jax  # pylint: disable=import-outside-toplevel  (after `prepare`)
    if jax.config.jax_platforms in (None, "", "cpu"):
      jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process collectives on CPU
    address, count, index = settings
    timeout = start_timeout.value
    _say(f"process {index} of {count}: " + (
        f"serving the coordinator at {address}; waiting up to {timeout} s (--initialization_timeout) for the other "
        f"{count - 1} process{'es' if count > 2 else ''} to connect" if index == 0 else
        f"waiting up to {timeout} s (--initialization_timeout) to join the coordinator at {address} (process 0)"))
    # JAX gives up by aborting the process with a stack dump (a fatal DEADLINE_EXCEEDED of its C++ client), which
    # no `except` catches: the watchdog ends the wait first, with one line, and JAX's deadline comes later.
    watchdog = threading.Timer(timeout, _gave_up, (address, count, index, timeout))
    watchdog.daemon = True
    watchdog.start()
    try:
      jax.distributed.initialize(address, count, index, initialization_timeout=timeout + _JAX_DEADLINE_MARGIN_S,
                                 heartbeat_timeout_seconds=heartbeat.value)
    finally:
      watchdog.cancel()

  return initialize


_JAX_DEADLINE_MARGIN_S = 30  # JAX's own deadline comes this long after the watchdog's (`distributed_flags`)


def _say(line: str) -> None:
  sys.stdout.flush()
  sys.stderr.write(line + "\n")
  sys.stderr.flush()


def _gave_up(address: str, count: int, index: int, timeout: int) -> None:
  """Ends the process with one line naming the coordinator's address, what was missing and the fix."""
  host, _, port = address.rpartition(":")
  try:
    socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
    listening = True
  except OSError:
    listening = False
  if index != 0 and not listening:
    problem = f"nothing listens at {address}"
    fix = (f"start process 0 (--process_id=0) on that host with --coordinator_address={address}, or give the "
           "address process 0 serves")
  else:
    problem = f"not every one of the {count} processes connected to {address}"
    fix = (f"start all {count} processes (--process_id=0 to {count - 1}) with the same --coordinator_address and "
           f"--num_processes={count}")
  _say(f"error: process {index} of {count} gave up after --initialization_timeout={timeout} s: {problem}; {fix} "
       "(or raise --initialization_timeout).")
  os._exit(1)


def check_distributed(address: str | None, num_processes: int | None, process_id: int | None,
                      environ: Mapping[str, str]) -> tuple[str, int, int] | None:
  """`(coordinator address, number of processes, process id)` from the flags, else from `environ`'s JAX_*
  variables; None for one process. Refuses before any work what would fail later or train as one process
  unnoticed: a malformed or unresolvable address, a count or id without a coordinator or out of range."""
  address = address or environ.get("JAX_COORDINATOR_ADDRESS") or None
  count = _env_int(num_processes, "num_processes", environ, "JAX_NUM_PROCESSES", minimum=1)
  index = _env_int(process_id, "process_id", environ, "JAX_PROCESS_ID", minimum=0)
  if address is None:
    if count is not None or index is not None:
      raise ValueError(f"--num_processes={count} / --process_id={index} without --coordinator_address: name "
                       "process 0's HOST:PORT on every process (or $JAX_COORDINATOR_ADDRESS), or drop both to "
                       "train as one process.")
    return None
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"--coordinator_address={address!r} must be HOST:PORT of process 0, e.g. 10.0.0.1:1234.")
  try:
    socket.getaddrinfo(host.strip("[]"), int(port))
  except socket.gaierror as e:
    raise ValueError(f"--coordinator_address={address!r}: the host {host!r} does not resolve ({e.strerror}); "
                     "name process 0's host as every process reaches it.") from None
  if count is None or index is None:
    raise ValueError(f"--coordinator_address={address} needs --num_processes and --process_id (or "
                     "$JAX_NUM_PROCESSES and $JAX_PROCESS_ID) on every process.")
  if index >= count:
    raise ValueError(f"--process_id={index} must be below --num_processes={count} (processes count from 0).")
  return address, count, index


def _env_int(value: int | None, flag: str, environ: Mapping[str, str], variable: str, minimum: int) -> int | None:
  """The flag's value, else the environment variable's as an integer of at least `minimum`, else None."""
  if value is not None:
    return value
  raw = environ.get(variable, "").strip()
  if not raw:
    return None
  if not raw.lstrip("-").isdigit() or int(raw) < minimum:
    raise ValueError(f"{variable}={raw!r} must be an integer of at least {minimum}: set it to the "
                     f"{flag.replace('_', ' ')}, or unset it and pass --{flag}.")
  return int(raw)


_VERBOSE = flags.DEFINE_boolean("verbose", False, "Show the traceback of an error, not only its message.")
# What bad input, a busy workdir or a failing disk raise: their messages name the value or path and the fix.
USER_ERRORS = (ValueError, OSError, FloatingPointError, workdir_lock.WorkdirBusyError)


def run(main: Callable[[], None]) -> None:
  """Parses the flags (jax's own among them) and calls `main()`; positional arguments are a usage error.

  A USER_ERRORS exception ends the script with its message alone on stderr and exit status 1 (its traceback
  with --verbose).
  """
  import jax  # pylint: disable=import-outside-toplevel  (after `prepare`, which the scripts call first)

  def absl_main(argv: list[str]) -> None:
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
      main()
    except USER_ERRORS as e:
      if _VERBOSE.value:
        raise
      _end(f"error: {e} ({type(e).__name__}; --verbose shows the traceback)", 1)
    except KeyboardInterrupt:  # a second Ctrl-C during training's steps (the first asks for a checkpoint)
      if _VERBOSE.value:
        raise
      _end(f"error: interrupted by a second Ctrl-C; {_kept()}", 128 + signal.SIGINT)
    except Exception as e:  # pylint: disable=broad-exception-caught
      if _VERBOSE.value:
        raise
      if isinstance(e, RuntimeError) and str(e).startswith("Unable to initialize backend"):  # JAX_PLATFORMS
        _end(f"error: {str(e).split(' (set JAX_PLATFORMS')[0]}; JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r} "
             "names it: set JAX_PLATFORMS to a platform this machine has (e.g. cpu), or unset it.", 1)
      if not jax.distributed.is_initialized():
        raise
      cause = (str(e).strip().splitlines() or [""])[0][:300]
      _end(f"error: {type(e).__name__} on process {jax.process_index()} of {jax.process_count()}: {cause}; "
           f"another process may have stopped (its own output tells); {_kept()} (--verbose shows the traceback)", 1)

  jax.config.config_with_absl()
  show_in_help(sys.argv[0])  # absl's name for the main module
  absl_logging.get_absl_handler().setFormatter(ConsoleFormatter())
  app.run(absl_main, flags_parser=_parse_flags)


def show_in_help(module: str, flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Makes --help of the script `module` (--help shows the main module's flags only) list the flags this module
  defines beside the script's own, each one that must be given ending in REQUIRED; --helpfull shows the same texts.

  Args:
    module: the script's module name as absl keys its flags (sys.argv[0] for the main module).
    flag_values: where the flags are defined (the scripts': flags.FLAGS).
  """
  for flag in flag_values.get_key_flags_for_module(__name__):
    flag_values.register_key_flag_for_module(module, flag)
  for flag in flag_values.get_key_flags_for_module(module):
    if is_required(flag) and not flag.help.endswith(REQUIRED):
      flag.help += REQUIRED


def is_required(flag: flags.Flag) -> bool:
  """Whether `flag` must be given: it has no default and one of its validators refuses None (absl's `required=True`
  registers such a validator; a flag merely without a default has none)."""
  if flag.default is not None:
    return False
  for validator in flag.validators:
    if validator.get_flags_names() != [flag.name]:
      continue
    try:
      if not validator.checker(None):
        return True
    except flags.ValidationError:
      return True
  return False


class ConsoleFormatter(absl_logging.PythonFormatter):
  """absl's log format, except that this package's INFO lines (progress lines and notes: `metrics.log`) reach the
  terminal as their text alone, without absl's prefix (level, date, time, thread, file:line): the prefix made every
  progress line start with `I1127 05:52:59.881634 140589851503488 metrics.py:147] `. Warnings and errors keep it,
  and so do other libraries' lines and a log file's (--log_dir with absl's file logging), whose readers want it."""

  def format(self, record: logging.LogRecord) -> str:
    if (record.levelno == logging.INFO and record.pathname.startswith(_PACKAGE_DIR + os.sep)
        and absl_logging.get_absl_handler().python_handler.stream is sys.stderr):  # not a log file
      return logging.Formatter.format(self, record)
    return super().format(record)


def _end(line: str, status: int) -> None:
  """Ends the script with `line` on stderr and exit `status`; at once (os._exit) in a multi-process run, whose exit
  handler would wait on processes that may be gone until JAX's heartbeat timeout aborts with a stack dump."""
  import jax  # pylint: disable=import-outside-toplevel  (imported by `run` already)

  sys.stdout.flush()
  sys.stderr.write(line + "\n")
  sys.stderr.flush()
  if jax.distributed.is_initialized():
    os._exit(status)
  sys.exit(status)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with each failure as one line: a bad value, an unknown preset, a misspelt field; help asked
  for (--help, --helpfull: absl prints it and exits 1) exits 0."""
  try:
    return flags.FLAGS(argv)
  except SystemExit as e:
    if e.code == 1:  # parsing raises flags.Error for bad input: only the help flags exit
      sys.exit(0)
    raise
  except flags.UnrecognizedFlagError as e:
    sys.exit(f"error: {flag_messages.unknown_flag(e.flagname)}\nPass --helpshort or --helpfull to see help on flags.")
  except flags.Error as e:
    lines = [line for line in str(e).splitlines() if line.strip()]
    if any(line.startswith("Traceback") for line in lines):  # ml_collections quotes its own traceback: the cause
      lines = [lines[0].split(": Error whilst", 1)[0] + ":", lines[-1]]
    sys.exit("error: " + " ".join(lines) + "\nPass --helpshort or --helpfull to see help on flags.")
  except (AttributeError, KeyError) as e:
    sys.exit(flag_messages.unknown_field(argv, e))
