"""host_memory.keep_freed_memory: repeated executions stop faulting their temporaries in afresh; one_off_buffers: what
is allocated within goes back to the system when freed; available: the smallest of MemAvailable, the address-space
limit and the cgroups' limits, each less what is held."""

import os
import resource
import subprocess
import sys

import pytest

from retnet_jax.core import host_memory
from tests.helpers import REPO, run_python

pytestmark = pytest.mark.optimized

# Each call of f allocates two 64 MB temporaries (above glibc's 32 MB mmap threshold) for a 256 KB output: the
# product contracts over 65536 so as to take 8.6 GFLOP, where a square one of the same temporaries takes 137.
SCRIPT = """
import resource, statistics, sys
from retnet_jax.core import host_memory
applied = host_memory.keep_freed_memory() if sys.argv[1] == "keep" else False
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sin(x) @ jnp.cos(x).T)
x = jnp.ones((256, 65536))
faults = []
for _ in range(16):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  f(x).block_until_ready()
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, statistics.median(faults[8:]))
"""


def page_faults_per_call(mode):
  proc = run_python("-c", SCRIPT, mode)
  assert proc.returncode == 0, proc.stderr[-2000:]
  applied, faults = proc.stdout.split()
  return applied == "True", float(faults)


@pytest.mark.slow
@pytest.mark.skipif(host_memory._glibc() is None, reason="glibc malloc only")
def test_kept_memory_is_reused_by_later_executions():
  """Median page faults of calls 9-16: ~33k (128 MB of fresh pages) per call by default, 0 measured with the
  heap kept. The first calls still grow the heap while earlier calls' buffers are being freed (a median of
  32k over calls 3-8 was seen beside another test process), so the median starts at call 9."""
  applied, kept = page_faults_per_call("keep")
  _, default = page_faults_per_call("default")
  assert applied
  assert default > 20_000, default
  assert kept < 2_000, kept


# MiB returned to the system when a 256 MiB block is freed, allocated outside and inside `one_off_buffers`.
ONE_OFF_SCRIPT = """
import contextlib, resource
from retnet_jax.core import host_memory
assert host_memory.keep_freed_memory()
import numpy as np

def returned(context):
  with context:
    block = np.ones(2**25)
  resident = lambda: int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20
  before = resident()
  del block
  return before - resident()

one_off = returned(host_memory.one_off_buffers())  # first: the heap has no free block to serve it from
print(returned(contextlib.nullcontext()), one_off)
"""


@pytest.mark.slow
@pytest.mark.skipif(host_memory._glibc() is None, reason="glibc malloc only")
def test_one_off_buffers_go_back_to_the_system_when_freed():
  proc = run_python("-c", ONE_OFF_SCRIPT)
  assert proc.returncode == 0, proc.stderr[-2000:]
  kept, returned = map(float, proc.stdout.split())
  assert kept < 16 and returned > 240, (kept, returned)


@pytest.mark.skipif(host_memory._glibc() is None, reason="glibc malloc only")
def test_the_heap_setting_can_be_turned_off():
  """The kept heap's higher peak (docs/scale.md) had no way out but editing the code: OPT_OUT=0 leaves malloc as is."""
  script = "from retnet_jax.core import host_memory; print(host_memory.keep_freed_memory())"
  for value, applied in (("0", "False"), ("1", "True")):
    proc = run_python("-c", script, JAX_PLATFORMS="cpu", **{host_memory.OPT_OUT: value})
    assert proc.returncode == 0 and proc.stdout.split() == [applied], (value, proc.stdout, proc.stderr[-2000:])


GiB = 2**30
# A fake layout's meminfo: 16 GiB available, the bound where no other can be read.
MEMINFO = {"proc/meminfo": "MemTotal:       33554432 kB\nMemAvailable:   16777216 kB\n"}


def fake_available(tmp_path, files):
  """`host_memory.available` reading procfs and the cgroup filesystems from `files` (path under tmp_path -> text)."""
  for name, text in files.items():
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(text)
  return host_memory.available(str(tmp_path / "proc"), str(tmp_path / "cgroup"))


# Under an address-space limit of 1 GiB: available() and VmSize, read just before it.
RLIMIT_SCRIPT = """
from retnet_jax.core import host_memory
held = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
print(host_memory.available_bytes(), held)
print(host_memory.available()[1])
"""


def test_the_address_space_limit_bounds_what_is_available():
  """passkey.py under `prlimit --as=8589934592` passed its check against MemAvailable (~20 GiB), then XLA failed to
  allocate 23.7 GB: a process cannot map more than its RLIMIT_AS less the address space it already holds."""
  limit = GiB
  proc = subprocess.run([sys.executable, "-c", RLIMIT_SCRIPT], capture_output=True, text=True, cwd=REPO, timeout=60,
                        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
  assert proc.returncode == 0, proc.stderr[-2000:]
  counts, what = proc.stdout.splitlines()
  available, held = map(int, counts.split())
  assert 0 < available <= limit - held, (available, held)
  assert what.startswith("the address-space limit (RLIMIT_AS) less the ") and what.endswith(" this process holds"), what


def test_a_cgroup_v2_limit_less_its_usage_bounds_what_is_available(tmp_path):
  """The process's own cgroup (/proc/self/cgroup's "0::" line) and its ancestors each bound it: memory.max less
  memory.current, of which the inactive page cache (memory.stat) can be reclaimed; "max" is no limit."""
  files = {**MEMINFO, "proc/self/cgroup": "0::/user.slice/app\n",
           "cgroup/user.slice/memory.max": "max\n", "cgroup/user.slice/memory.current": f"{5 * GiB}\n",
           "cgroup/user.slice/app/memory.max": f"{4 * GiB}\n", "cgroup/user.slice/app/memory.current": f"{GiB}\n",
           "cgroup/user.slice/app/memory.stat": f"anon {GiB // 2}\ninactive_file {GiB // 4}\n"}
  assert fake_available(tmp_path, files) == (3 * GiB + GiB // 4,
                                             "the memory.max of cgroup /user.slice/app less its usage")
  files["cgroup/user.slice/memory.max"] = f"{6 * GiB}\n"  # 1 GiB left to the parent and all within it
  assert fake_available(tmp_path, files) == (GiB, "the memory.max of cgroup /user.slice less its usage")


def test_a_cgroup_v1_limit_less_its_usage_bounds_what_is_available(tmp_path):
  """v1's memory hierarchy ("N:memory:/path"), where no limit reads as a huge number and the v2 line has no files."""
  files = {**MEMINFO, "proc/self/cgroup": "5:devices:/\n4:memory:/docker/abc\n0::/\n",
           "cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
           "cgroup/memory/memory.usage_in_bytes": f"{20 * GiB}\n",
           "cgroup/memory/docker/abc/memory.limit_in_bytes": f"{2 * GiB}\n",
           "cgroup/memory/docker/abc/memory.usage_in_bytes": f"{GiB}\n",
           "cgroup/memory/docker/abc/memory.stat": f"inactive_file {GiB}\ntotal_inactive_file {GiB // 2}\n"}
  assert fake_available(tmp_path, files) == (GiB + GiB // 2,
                                             "the memory.limit_in_bytes of cgroup /docker/abc less its usage")


@pytest.mark.parametrize("files", [
    {"proc/self/cgroup": "0::/app\n", "cgroup/app/memory.max": "max\n", "cgroup/app/memory.current": "1024\n"},
    {"proc/self/cgroup": "0::/app\n", "cgroup/app/memory.max": "1024\n"},  # no memory.current
    {"proc/self/cgroup": "0::/app\n", "cgroup/app/memory.max": "lots\n", "cgroup/app/memory.current": "1024\n"},
    {"proc/self/cgroup": "0::/app\n"},  # no files
    {"proc/self/cgroup": "garbage\n\n::\n4:memory\n", "cgroup/memory/memory.limit_in_bytes": "1024\n",
     "cgroup/memory/memory.usage_in_bytes": "0\n", "cgroup/memory.max": "1024\n", "cgroup/memory.current": "0\n"},
    {"cgroup/memory.max": "1024\n", "cgroup/memory.current": "0\n"},  # no /proc/self/cgroup
    {"proc/self/status": "Name:\tpython\nVmSize:\tmany kB\n"},
], ids=["max", "no-usage", "not-a-number", "no-files", "odd-cgroup-lines", "no-proc-cgroup", "odd-status"])
def test_what_cannot_be_read_is_left_out(tmp_path, files):
  """Each layout has no bound that can be read but MemAvailable ("4:memory" has no path: it names no cgroup)."""
  assert fake_available(tmp_path, {**MEMINFO, **files}) == (16 * GiB, "MemAvailable")


def test_without_meminfo_the_physical_memory_bounds_it(tmp_path):
  physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  assert fake_available(tmp_path, {"proc/self/cgroup": "0::/\n"}) == (physical, "the physical memory")


def test_a_cgroup_path_outside_the_cgroup_root_is_ignored(tmp_path):
  """/proc/self/cgroup is not trusted to name a folder under the cgroup root: `..` or a link out of it is ignored."""
  limit = {"outside/memory.max": f"{GiB}\n", "outside/memory.current": "0\n"}
  assert fake_available(tmp_path, {**MEMINFO, **limit, "proc/self/cgroup": "0::/../outside\n"}) == (
      16 * GiB, "MemAvailable")
  (tmp_path / "cgroup").mkdir()
  (tmp_path / "cgroup" / "link").symlink_to(tmp_path / "outside")
  assert fake_available(tmp_path, {"proc/self/cgroup": "0::/link\n"}) == (16 * GiB, "MemAvailable")
  # The same files inside the root bound it.
  assert fake_available(tmp_path, {"proc/self/cgroup": "0::/inside\n", "cgroup/inside/memory.max": f"{GiB}\n",
                                   "cgroup/inside/memory.current": "0\n"}) == (
      GiB, "the memory.max of cgroup /inside less its usage")


@pytest.mark.parametrize("rlimit, cgroup_limit, expected", [
    (12 * GiB, 8 * GiB, (6 * GiB, "the memory.max of cgroup / less its usage")),
    (5 * GiB, 8 * GiB, (3 * GiB, "the address-space limit (RLIMIT_AS) less the 2.0 GiB this process holds")),
    (resource.RLIM_INFINITY, 20 * GiB, (16 * GiB, "MemAvailable")),
    (GiB, 8 * GiB, (0, "the address-space limit (RLIMIT_AS) less the 2.0 GiB this process holds")),
])
def test_the_smallest_bound_wins_and_is_named(tmp_path, monkeypatch, rlimit, cgroup_limit, expected):
  """MemAvailable 16 GiB; RLIMIT_AS less a VmSize of 2 GiB; the cgroup's limit less 2 GiB of usage; never below 0."""
  monkeypatch.setattr(resource, "getrlimit", lambda which: (rlimit, resource.RLIM_INFINITY))
  files = {**MEMINFO, "proc/self/status": f"Name:\tpython\nVmSize:\t{2 * GiB // 1024} kB\nVmRSS:\t1024 kB\n",
           "proc/self/cgroup": "0::/\n", "cgroup/memory.max": f"{cgroup_limit}\n",
           "cgroup/memory.current": f"{2 * GiB}\n"}
  assert fake_available(tmp_path, files) == expected
