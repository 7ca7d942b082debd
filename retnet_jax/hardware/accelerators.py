"""The GPUs and TPUs one can compile for from any machine: their vendor peaks, and XLA's compile-only devices; the
XLA flags training adds on this machine's NVIDIA GPUs.

    target = accelerators.parse_target("v5e-16")   # or "h100:8" (hosts=2: two hosts of 8), "v5p-8" (slices=2)
    devices = accelerators.devices(target)         # compile-only devices: build a mesh of them, lower, compile
    target.chip.peak_bf16_flops, target.chip.hbm_bytes_per_second, target.chip.memory_bytes
    added = accelerators.set_gpu_xla_flags(None)   # training on this machine's GPUs: before JAX starts its backend

Names follow the clouds: a GPU target is `CHIP:N`, N GPUs per host; a TPU target is Cloud TPU's accelerator type,
whose N counts TensorCores (two per chip on v4 and v5p, so `v5p-8` is 4 chips) or chips (v5e, v6e). A device is a
GPU or a TPU chip (v4 and v5p as megacore: one device per chip).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib.util
import os
import pkgutil
import re
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from absl import logging
import jax

_INSTALL = "pip install -e '.[aot]'"
# The XLA flags JAX's GPU performance guide (and NVIDIA's JAX-Toolbox) recommends for training on Hopper GPUs. Each
# has been known to XLA for years (jaxlib 0.4.2x to 0.10 at least): XLA aborts at start on a flag it does not know.
GPU_TRAINING_XLA_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",  # schedule collectives and copies to overlap compute
    "--xla_gpu_enable_highest_priority_async_stream=true",  # their stream first, so the overlap does not delay them
    "--xla_gpu_enable_triton_gemm=false",  # matmuls through cuBLAS rather than Triton's emitter
    # gradient all-reduces, parameter all-gathers and reduce-scatters combined into fewer, larger collectives
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
)
# A process that has XLA read its XLA_FLAGS (`check_xla_flags`): the CPU platform's start, public API only.
XLA_FLAGS_READER = "import jax; jax.devices()"


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator's nominal figures from its vendor's spec sheet: dense bfloat16 FLOP/s (no sparsity), HBM
  bandwidth in bytes/s and HBM size in bytes; for a GPU also the fields of XLA's target description that differ
  between GPUs (its GpuTargetConfigProto)."""
  platform: str  # gpu | tpu
  device_kind: str
  peak_bf16_flops: float
  hbm_bytes_per_second: float
  memory_bytes: int
  gpu_fields: tuple[tuple[str, Any], ...] = ()


_HOPPER = (("core_count", 132), ("fpus_per_core", 128), ("shared_memory_per_core", 233472),
           ("shared_memory_per_block_optin", 232448), ("l2_cache_size", 52428800), ("clock_rate_ghz", 1.98),
           ("cuda_compute_capability", "{ major: 9 }"))
# Vendor specs: H100 SXM5, H200 SXM, A100 SXM4 80GB; Cloud TPU's system architecture pages (per chip).
CHIPS: dict[str, Chip] = {
    "h100": Chip("gpu", "NVIDIA H100 80GB HBM3", 989e12, 3.35e12, 84978434048, _HOPPER),
    "h200": Chip("gpu", "NVIDIA H200", 989e12, 4.8e12, 150754820096, _HOPPER),
    "a100": Chip("gpu", "NVIDIA A100-SXM4-80GB", 312e12, 2.039e12, 85899345920,
                 (("core_count", 108), ("fpus_per_core", 64), ("shared_memory_per_core", 167936),
                  ("shared_memory_per_block_optin", 166912), ("l2_cache_size", 41943040), ("clock_rate_ghz", 1.41),
                  ("cuda_compute_capability", "{ major: 8 }"))),
    "v4": Chip("tpu", "TPU v4", 275e12, 1.2e12, 32 * 2**30),
    "v5e": Chip("tpu", "TPU v5 lite", 197e12, 0.819e12, 16 * 2**30),
    "v5p": Chip("tpu", "TPU v5", 459e12, 2.765e12, 95 * 2**30),
    "v6e": Chip("tpu", "TPU v6 lite", 918e12, 1.64e12, 32 * 2**30),
}
_MEGACORE = ("v4", "v5p")  # Cloud's N counts TensorCores, two per chip; 3-D tori
TARGET_NAMES = ("h100:N", "h200:N", "a100:N", "v4-N", "v5e-N", "v5p-N", "v6e-N")


@dataclasses.dataclass(frozen=True)
class Target:
  """A target's chip and size: `devices_per_host` GPUs on each of `hosts` hosts, or a TPU slice of `chips`,
  `slices` times."""
  name: str
  chip_name: str
  chips: int  # per slice (GPUs: per host)
  hosts: int = 1
  slices: int = 1

  @property
  def chip(self) -> Chip:
    return CHIPS[self.chip_name]

  @property
  def num_devices(self) -> int:
    return self.chips * self.hosts * self.slices

  @property
  def topology(self) -> str:
    """The slice's chip grid as XLA names it (`4x4`, `2x2x1`); a GPU target's `slices x hosts x GPUs`."""
    if self.chip.platform == "gpu":
      return f"{self.slices}x{self.hosts}x{self.chips}"
    log = self.chips.bit_length() - 1
    if self.chip_name in _MEGACORE:  # 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...
      return "2x2x1" if log == 2 else "x".join(str(2 ** ((log + i) // 3)) for i in range(3))
    return f"{2 ** (log // 2)}x{2 ** (log - log // 2)}"  # 1x1, 2x2, 2x4, 4x4, ...


def chip_of(device_kind: str) -> Chip | None:
  """The CHIPS entry of a JAX `device_kind` (e.g. training's devices, for their peak), or None (CPUs, others)."""
  return next((chip for chip in CHIPS.values() if chip.device_kind == device_kind), None)


def parse_target(name: str, hosts: int = 1, slices: int = 1) -> Target:
  """The Target of `name` (`h100:8`, `v5e-16`); ValueError naming the known names or sizes otherwise."""
  gpu, tpu = re.fullmatch(r"(\w+):(\d+)", name), re.fullmatch(r"(\w+)-(\d+)", name)
  chip_name, count = (gpu or tpu).groups() if gpu or tpu else (None, "0")
  count = int(count)
  if chip_name not in CHIPS or (CHIPS[chip_name].platform == "gpu") != bool(gpu):
    raise ValueError(f"unknown --target={name!r}; choose one of {', '.join(TARGET_NAMES)} (GPUs: N per host, "
                     "--hosts for several hosts; TPUs: Cloud TPU's names, --slices for several slices).")
  if hosts < 1 or slices < 1:
    raise ValueError(f"--hosts={hosts} and --slices={slices} must be positive counts.")
  if gpu:
    if not 1 <= count <= 16:
      raise ValueError(f"--target={name}: {count} GPUs per host; give 1 to 16 (and --hosts for more hosts).")
    if slices != 1:
      raise ValueError(f"--slices={slices} is for TPU targets; give a GPU target more hosts with --hosts.")
    return Target(name, chip_name, count, hosts=hosts)
  chips = count // 2 if chip_name in _MEGACORE else count
  smallest = 4 if chip_name in _MEGACORE else 1
  if chips < smallest or chips & (chips - 1) or (chips == 2 and chip_name not in _MEGACORE):
    sizes = "8, 16, 32, ... (TensorCores, 2 per chip)" if chip_name in _MEGACORE else "1, 4, 8, 16, ... (chips)"
    raise ValueError(f"--target={name}: no {chip_name} slice of that size; Cloud TPU's {chip_name}-N has N in {sizes}.")
  if hosts != 1:
    raise ValueError(f"--hosts={hosts} is for GPU targets; a TPU slice's hosts follow from its size (--slices for "
                     "several slices).")
  return Target(name, chip_name, chips, slices=slices)


def check_installed(platform: str) -> None:
  """Raises ValueError with the pip command unless the `aot` extra's packages for `platform` are installed."""
  needed = {"gpu": {"jax_cuda12_plugin": "jax-cuda12-plugin", "nvidia.cuda_nvcc": "nvidia-cuda-nvcc-cu12"},
            "tpu": {"libtpu": "libtpu"}}[platform]
  missing = [package for module, package in needed.items() if _find_spec(module) is None]
  if missing:
    raise ValueError(f"compiling for {platform.upper()}s needs {', '.join(missing)}, from the aot extra: {_INSTALL}.")


def _find_spec(module: str):
  try:
    return importlib.util.find_spec(module)
  except ModuleNotFoundError:  # a missing parent package
    return None


def gpu_target_config(chip: Chip) -> str:
  """XLA's GpuTargetConfigProto in text form for `chip`: what the compiler would read from the device."""
  fields = (("threads_per_block_limit", 1024), ("threads_per_warp", 32), ("shared_memory_per_block", 49152),
            ("threads_per_core_limit", 2048), ("block_dim_limit_x", 2147483647), ("block_dim_limit_y", 65535),
            ("block_dim_limit_z", 65535), ("registers_per_core_limit", 65536), ("registers_per_block_limit", 65536),
            ("memory_bandwidth", int(chip.hbm_bytes_per_second)), ("device_memory_size", chip.memory_bytes),
            *chip.gpu_fields)
  info = " ".join(f"{key}: {value}" for key, value in fields)
  return (f"gpu_device_info {{ {info} }} platform_name: \"CUDA\" dnn_version_info {{ major: 9 minor: 8 }} "
          f"device_description_str: \"{chip.device_kind}\"")


@functools.cache
def devices(target: Target) -> tuple[jax.Device, ...]:
  """The target's compile-only devices, from XLA's topology description (made once per target)."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel  (loads the plugins' modules)

  check_installed(target.chip.platform)
  if target.chip.platform == "gpu":
    topology = topologies.get_topology_desc(platform="cuda", topology_name=target.chip_name,
                                            target_config=gpu_target_config(target.chip), topology=target.topology)
  else:
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # no TPU VM here: libtpu asks no metadata server
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no chips to guard: compiles may run side by side
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", target.name)
    topology = topologies.get_topology_desc(
        platform="tpu", topology_name=f"{target.chip_name}:{target.topology}", num_slices=target.slices,
        chip_config_name="megacore" if target.chip_name in _MEGACORE else "default",
        chips_per_host_bounds=(1, 1, 1) if target.chips == 1 else (2, 2, 1))  # hosts of 4 chips, as Cloud's
  found = tuple(topology.devices)
  if len(found) != target.num_devices:
    raise ValueError(f"--target={target.name}: XLA's topology {target.topology} gave {len(found)} devices, not "
                     f"{target.num_devices}; report this with the jax and libtpu versions.")
  return found


def memory_sizes(compiled) -> dict[str, int]:
  """XLA's buffer assignment of a compiled program (a training step, a prefill), per device: argument, output,
  temporary, aliased (outputs in donated arguments) and generated code bytes."""
  memory = compiled.memory_analysis()
  return {"argument_bytes": memory.argument_size_in_bytes, "output_bytes": memory.output_size_in_bytes,
          "temporary_bytes": memory.temp_size_in_bytes, "aliased_bytes": memory.alias_size_in_bytes,
          "generated_code_bytes": memory.generated_code_size_in_bytes}


def required_bytes(sizes: dict[str, int]) -> int:
  """The device memory a compiled program needs (a plan's `required_bytes_per_device`), from its `memory_sizes`:
  arguments, outputs not aliased to them, temporaries and generated code."""
  return (sizes["argument_bytes"] + sizes["output_bytes"] - sizes["aliased_bytes"] + sizes["temporary_bytes"]
          + sizes["generated_code_bytes"])


def local_gpu() -> bool:
  """Whether JAX on this machine would run on NVIDIA GPUs, decided without starting its backend: a CUDA plugin is
  installed (`jax_plugins.xla_cuda*`), the NVIDIA driver is loaded, and `jax_platforms` (JAX_PLATFORMS or
  --jax_platforms), if set, allows GPUs."""
  platforms = {name.strip() for name in (jax.config.jax_platforms or "").split(",") if name.strip()}
  if platforms and not platforms & {"cuda", "gpu"}:
    return False
  plugins = _find_spec("jax_plugins")
  locations = list(plugins.submodule_search_locations or ()) if plugins is not None else []
  if not any(module.name.startswith("xla_cuda") for module in pkgutil.iter_modules(locations)):
    return False
  return os.path.exists("/proc/driver/nvidia/version") or bool(glob.glob("/dev/nvidia[0-9]*"))


def gpu_xla_flags(choice: str | None, current: str, gpu: bool) -> tuple[str, tuple[str, ...]]:
  """The XLA_FLAGS of a training process: `current` with the GPU training flags added on a GPU.

  Args:
    choice: the flags to add: None for GPU_TRAINING_XLA_FLAGS, "none" for none, else a string of flags
      (`--xla_NAME=VALUE ...`) replacing them.
    current: the XLA_FLAGS already set ("" for none): a flag named there keeps its value.
    gpu: whether training runs on GPUs (`local_gpu()`); elsewhere nothing is added.
  Returns:
    (the new XLA_FLAGS, the flags added).
  """
  wanted = GPU_TRAINING_XLA_FLAGS if choice is None else () if choice == "none" else tuple(choice.split())
  for flag in wanted:
    if not re.fullmatch(r"--xla_\w+(=\S*)?", flag):
      raise ValueError(f"--xla_gpu_flags: {flag!r} is not an XLA flag; give flags as --xla_NAME=VALUE separated by "
                       "spaces, or 'none'.")
  if not gpu:
    return current, ()
  named = {_flag_name(flag) for flag in current.split()}
  added = tuple(flag for flag in wanted if _flag_name(flag) not in named)
  return " ".join(filter(None, (current.strip(), *added))), added


def _flag_name(flag: str) -> str:
  """`--NAME=VALUE` (or `--NAME`) -> NAME."""
  return flag.lstrip("-").split("=", 1)[0]


def check_xla_flags(flags: Sequence[str], timeout: float = 120) -> None:
  """Raises ValueError naming the flags of `flags` (`--xla_NAME=VALUE`) that this jax's XLA does not know, or the
  value it cannot read, before they reach XLA_FLAGS, where XLA would abort the process as the GPU backend starts.

  XLA lists its flags nowhere a program can read, and reads XLA_FLAGS once per process, as its first client or
  compile option is made: a check in this process would fix XLA_FLAGS before the flags are added. So a short
  process on the CPU platform (`XLA_FLAGS_READER`, about a second) reads them with the parser the GPU's start uses;
  the CPU's XLA knows the GPU's flags (XLA's DebugOptions are one set for every backend). A process that fails
  otherwise (a later jax that reports flags in other words, no time left) leaves them unchecked, with a warning.
  """
  if not flags:
    return
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}
  try:
    result = subprocess.run([sys.executable, "-c", XLA_FLAGS_READER], env=env, capture_output=True, text=True,
                            timeout=timeout, check=False)
  except (OSError, subprocess.TimeoutExpired) as e:
    logging.warning(f"the XLA flags {' '.join(flags)} were not checked ({e}); XLA reads them as JAX starts.")
    return
  if result.returncode == 0:
    return
  unknown = re.search(r"Unknown flags? in XLA_FLAGS: (.+)", result.stderr)
  if unknown:
    raise ValueError(f"--xla_gpu_flags: {unknown.group(1).strip()}: not a flag of this XLA (jax {jax.__version__}), "
                     "which would abort as the GPU backend starts; check the spelling against XLA's flags "
                     "(openxla.org/xla/flags_guidance), or leave it out.")
  value = re.search(r"Couldn't interpret value (.*) for flag (\w+)", result.stderr)
  if value:
    raise ValueError(f"--xla_gpu_flags: XLA cannot read --{value.group(2)}={value.group(1)} (it would abort as the "
                     "GPU backend starts); give a value of the flag's type (true/false, a number, a string).")
  last = result.stderr.strip().splitlines()[-1:] or [f"exit status {result.returncode}"]
  logging.warning(f"the XLA flags {' '.join(flags)} were not checked ({last[0]}); XLA reads them as JAX starts.")


def set_gpu_xla_flags(choice: str | None) -> tuple[str, ...]:
  """Adds the GPU training flags of `choice` (as `gpu_xla_flags`) to the environment's XLA_FLAGS on a machine with
  NVIDIA GPUs (`local_gpu`), after `check_xla_flags` on them; flags the user chose are checked on any machine, so
  that a mistake shows before a GPU run. XLA reads XLA_FLAGS as JAX starts its backend: call this before anything
  asks for devices. Returns the flags added."""
  current = os.environ.get("XLA_FLAGS", "")
  gpu = local_gpu()
  flags, added = gpu_xla_flags(choice, current, gpu)
  check_xla_flags(added if gpu or choice in (None, "none") else choice.split())
  if added:
    os.environ["XLA_FLAGS"] = flags
  return added
