"""How a gs:// lease judges itself lost: a failed read of the lock object is no loss while its
renewer runs, and one read serves a log step's several metrics writes."""
import math
import subprocess

import pytest

from levanter_flax.core import locks
from levanter_flax.core.errors import UserError


@pytest.fixture
def lease():
  """An _ObjectLease that holds the lock, without a bucket: its reads are the test's."""
  held = object.__new__(locks._ObjectLease)  # pylint: disable=protected-access
  held._path, held._holder, held._seen_ours_at = "gs://bucket/run/.lock", '{"pid": 1}', -math.inf  # pylint: disable=protected-access
  held._renewer = subprocess.Popen(["sleep", "60"])  # pylint: disable=protected-access
  yield held
  held._renewer.kill()  # pylint: disable=protected-access
  held._renewer.wait()  # pylint: disable=protected-access


def test_a_failed_read_is_no_loss_while_the_renewer_runs(lease, monkeypatch):
  def unreachable():
    raise UserError("cannot read the lock gs://bucket/run/.lock: 503")
  monkeypatch.setattr(lease, "_read", unreachable)
  assert lease.lost() is None
  lease._renewer.kill()  # pylint: disable=protected-access
  lease._renewer.wait()  # pylint: disable=protected-access
  assert "exited with status -9, so the lock would expire" in lease.lost()


def test_one_read_serves_the_writes_of_one_log_step(lease, monkeypatch):
  reads = []
  monkeypatch.setattr(lease, "_read", lambda: reads.append(1) or (lease._holder, 7))  # pylint: disable=protected-access
  assert lease.lost(seen_within=60) is None and lease.lost(seen_within=60) is None
  assert len(reads) == 1
  assert lease.lost() is None  # A checkpoint always reads.
  assert len(reads) == 2
  monkeypatch.setattr(lease, "_read", lambda: ('{"pid": 4242, "host": "elsewhere", '
                                               '"since": "today"}', 8))
  assert lease.lost() == ("pid 4242 on elsewhere (since today) took over its lock "
                          "gs://bucket/run/.lock")
