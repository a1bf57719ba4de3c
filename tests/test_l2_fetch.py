"""k31c/runtime/l2_fetch.py against a fake CUDA driver: the limit id and value passed, the value before returned, a
driver failure and a bad size reported by name, and nothing touched off cuda (so CPU executors never load libcuda)."""

from __future__ import annotations

import pytest
import torch

from k31c.runtime import l2_fetch


class FakeDriver:
    def __init__(self, value=64, get_rc=0, set_rc=0):
        self.value, self.get_rc, self.set_rc, self.sets = value, get_rc, set_rc, []
        self.cuCtxGetLimit = lambda out, limit: self._get(out, limit)   # functions: the module sets argtypes
        self.cuCtxSetLimit = lambda limit, value: self._set(limit, value)

    def _get(self, out, limit):
        assert limit == 5      # CU_LIMIT_MAX_L2_FETCH_GRANULARITY
        out._obj.value = self.value    # ctypes.byref(c_size_t)
        return self.get_rc

    def _set(self, limit, value):
        self.sets.append((limit, value))
        if not self.set_rc:
            self.value = value
        return self.set_rc


def _fake(monkeypatch, drv):
    monkeypatch.setattr(l2_fetch, "_driver", lambda: drv)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


def test_reads_sets_and_returns_the_value_before(monkeypatch):
    drv = FakeDriver(value=64)
    _fake(monkeypatch, drv)
    assert l2_fetch.l2_fetch_granularity() == 64 and drv.sets == []
    assert l2_fetch.l2_fetch_granularity(l2_fetch.RUNTIME_BYTES) == 64
    assert drv.sets == [(5, 128)] and l2_fetch.l2_fetch_granularity() == 128


def test_driver_failures_and_bad_sizes_are_named(monkeypatch):
    _fake(monkeypatch, FakeDriver(get_rc=201))
    with pytest.raises(l2_fetch.L2FetchError, match="cuCtxGetLimit.*CUresult 201.*no current CUDA context"):
        l2_fetch.l2_fetch_granularity()
    _fake(monkeypatch, FakeDriver(set_rc=1))
    with pytest.raises(l2_fetch.L2FetchError, match=r"cuCtxSetLimit\(L2 fetch granularity, 128\).*CUresult 1"):
        l2_fetch.l2_fetch_granularity(128)
    drv = FakeDriver()
    _fake(monkeypatch, drv)
    with pytest.raises(l2_fetch.L2FetchError, match="96 bytes: expected 0, 32, 64 or 128"):
        l2_fetch.l2_fetch_granularity(96)
    assert drv.sets == []


def test_off_cuda_nothing_is_touched(monkeypatch):
    monkeypatch.setattr(l2_fetch, "_driver", lambda: pytest.fail("libcuda loaded for a CPU device"))
    assert l2_fetch.set_for_runtime("cpu") is None and l2_fetch.set_for_runtime(torch.device("cpu")) is None
