"""peer_watch.PeerWatch: a peer whose workdir lock is released, or whose pulse stops, while this process's steps
stall is reported; a held lock, a moving pulse, moving steps or a peer that finished its steps are not."""

import itertools
import json
import re
import threading
import time

import pytest

from retnet_jax.runs import workdir as workdir_lib
from retnet_jax.training import peer_watch


def test_a_released_peer_lock_is_reported_only_while_the_steps_stall(tmp_path):
  peer = workdir_lib.writer_lock(tmp_path, 1)
  peer.acquire()
  watch = peer_watch.PeerWatch({1: peer.path}, lambda: 8, stall_seconds=0.0)
  assert watch.check() is None  # held: alive, however long the stall
  peer.release()
  assert watch.check() == (f"error: training process 1 is gone (its lock {peer.path} was released while this "
                           "process waited on it); the last committed checkpoint is step 8: restart every process "
                           "with the same command to resume.")
  moving = peer_watch.PeerWatch({1: peer.path}, lambda: None, stall_seconds=3600.0)
  assert moving.check() is None  # the steps move on: whatever the lock says, nothing is waited on
  assert "no checkpoint was committed" in peer_watch.PeerWatch({1: peer.path}, lambda: None, stall_seconds=0.0).check()


def test_a_lock_of_another_host_or_a_missing_one_is_left_to_the_heartbeat(tmp_path):
  other = tmp_path / "train_1.lock"
  other.write_text(json.dumps({"pid": 1, "host": "another-host", "started": "then"}))
  assert peer_watch.PeerWatch({1: other, 2: tmp_path / "train_2.lock"}, lambda: 8, stall_seconds=0.0).check() is None


def test_the_thread_calls_on_lost_once(tmp_path):
  peer = workdir_lib.writer_lock(tmp_path, 1)
  peer.acquire()
  peer.release()
  lost = []
  with peer_watch.PeerWatch({1: peer.path}, lambda: 4, stall_seconds=0.0, interval=0.01, on_lost=lost.append):
    deadline = time.monotonic() + 30
    while not lost and time.monotonic() < deadline:
      time.sleep(0.01)
    time.sleep(0.05)
  assert len(lost) == 1 and "training process 1 is gone" in lost[0]


def test_an_error_leaving_the_steps_is_a_lost_peer_only_when_its_lock_is_free(tmp_path):
  """A collective fails at once when its peer dies: reported as the peer's loss, without waiting for a stall."""
  peer = workdir_lib.writer_lock(tmp_path, 1)
  peer.acquire()
  lost = []
  with pytest.raises(RuntimeError, match="collective failed"):
    with peer_watch.PeerWatch({1: peer.path}, lambda: 4, stall_seconds=3600.0, on_lost=lost.append):
      raise RuntimeError("collective failed")
  assert lost == []  # the peer lives: the error is this process's own
  peer.release()
  with pytest.raises(RuntimeError, match="collective failed"):
    with peer_watch.PeerWatch({1: peer.path}, lambda: 4, stall_seconds=3600.0, on_lost=lost.append):
      raise RuntimeError("collective failed")
  assert len(lost) == 1 and lost[0].startswith("error: training process 1 is gone")


class Store:
  """The coordination service's key-value store as the pulse uses it; `down` makes it unreachable."""

  def __init__(self):
    self.values, self.down = {}, False

  def key_value_set(self, key, value, allow_overwrite=False):
    if self.down:
      raise RuntimeError("UNAVAILABLE: coordination service")
    assert allow_overwrite
    self.values[key] = value

  def key_value_dir_get(self, prefix):
    if self.down:
      raise RuntimeError("UNAVAILABLE: coordination service")
    return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def pulses(store, *indices):
  return [peer_watch.Pulse(store, i) for i in indices]


def test_a_still_pulse_is_reported_after_pulse_seconds_while_the_steps_stall(tmp_path):
  """A peer on another host (its lock unreadable here): its pulse tells."""
  store = Store()
  mine, peer = pulses(store, 0, 1)
  watch = peer_watch.PeerWatch({1: tmp_path / "train_1.lock"}, lambda: 8, mine, stall_seconds=0.0,
                               pulse_seconds=0.2)
  peer.beat("0")
  watch.listen()
  assert watch.check() is None  # it just moved
  time.sleep(0.25)
  line = watch.check()
  assert re.fullmatch(r"error: training process 1 is gone \(no sign of life from it for \d+ s while this process "
                      r"waited on it\); the last committed checkpoint is step 8: restart every process with the "
                      r"same command to resume.", line), line
  peer.beat("1")
  watch.listen()
  assert watch.check() is None and store.values["retnet_jax/pulse/0"] == "1"  # moving again; ours beats each listen
  peer.beat(peer_watch.LEFT)
  watch.listen()
  time.sleep(0.25)
  assert watch.check() is None  # it finished its steps


def test_an_unreachable_coordinator_ages_every_pulse(tmp_path):
  store = Store()
  mine, coordinator = pulses(store, 1, 0)
  watch = peer_watch.PeerWatch({0: tmp_path / "train_0.lock"}, lambda: None, mine, stall_seconds=0.0,
                               pulse_seconds=0.2)
  store.down = True
  time.sleep(0.25)
  coordinator.client = Store()  # were it still beating, this process could not hear it
  watch.listen()
  assert watch.check().startswith("error: training process 0 is gone (no sign of life")


def test_an_error_leaving_the_steps_names_a_peer_whose_pulse_stays_still(tmp_path):
  """A collective that fails when its peer dies is reported as that peer's loss; with every pulse moving, the error
  is this process's own and goes on."""
  store = Store()
  mine, peer = pulses(store, 0, 1)
  lost = []

  def fail_while_watched(pulse_seconds):
    with pytest.raises(RuntimeError, match="collective failed"):
      with peer_watch.PeerWatch({1: tmp_path / "train_1.lock"}, lambda: 4, mine, stall_seconds=3600.0,
                                pulse_seconds=pulse_seconds, interval=0.01, on_lost=lost.append):
        raise RuntimeError("collective failed")

  stop = threading.Event()
  thread = threading.Thread(target=_beat_until, args=(peer, stop))
  thread.start()
  fail_while_watched(pulse_seconds=5.0)
  assert lost == []
  stop.set()
  thread.join()
  fail_while_watched(pulse_seconds=0.2)
  assert len(lost) == 1 and lost[0].startswith("error: training process 1 is gone (no sign of life")


def _beat_until(pulse, stop):
  """Beats `pulse` every 10 ms until `stop` is set: a live peer."""
  for i in itertools.count():
    if stop.wait(0.01):
      return
    pulse.beat(str(i))


def test_finished_steps_mark_the_pulse_left(tmp_path):
  store = Store()
  with peer_watch.PeerWatch({1: tmp_path / "train_1.lock"}, lambda: 4, pulses(store, 0)[0], interval=0.01):
    pass
  assert store.values == {"retnet_jax/pulse/0": peer_watch.LEFT}
