"""host_memory.keep_freed_memory: repeated executions stop faulting their temporaries in afresh; one_off_buffers: what
is allocated within goes back to the system when freed."""

import pytest

from retnet_jax.core import host_memory
from tests.helpers import run_python

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
