"""peer_watch.PeerWatch: a peer whose workdir lock is released while this process's steps stall is reported; a
held lock, moving steps or a holder on another host are not."""

import json
import time

import pytest

from retnet_jax import peer_watch, workdir as workdir_lib


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
  assert "no checkpoint was committed" in peer_watch.PeerWatch({1: peer.path}, lambda: None, 0.0).check()


def test_a_lock_of_another_host_or_a_missing_one_is_left_to_the_heartbeat(tmp_path):
  other = tmp_path / "train_1.lock"
  other.write_text(json.dumps({"pid": 1, "host": "another-host", "started": "then"}))
  assert peer_watch.PeerWatch({1: other, 2: tmp_path / "train_2.lock"}, lambda: 8, 0.0).check() is None


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
