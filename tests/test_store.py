"""dt.sample's checkpoint store: what is read back after a caller died mid-segment."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from dasktensor.sampling._store import SampleStore, StoreMismatchError

LAYOUT = {"mu": ((), "float64"), "z_log__": ((3,), "float64")}


def store(path, **identity):
    return SampleStore(path, {"seed": 1, **identity}, LAYOUT, chains=2, length=20, resume=True)


def points(first, last):
    n = last - first
    return {"mu": np.arange(first, last, dtype=float), "z_log__": np.ones((n, 3)) * first}


def test_a_half_written_segment_is_never_read_back(tmp_path):
    path = tmp_path / "run.zarr"
    s = store(path)
    s.commit(0, 0, 5, points(0, 5), [[{"k": i}] for i in range(5)], "state after 5", {"mu": 4})
    s.commit(0, 5, 9, points(5, 9), [[{"k": i}] for i in range(5, 9)], "state after 9", {"mu": 8})
    # killed while writing draws [9, 14): its draws reached zarr, its segment file did not
    # (only the temporary one), and a segment after a gap is not contiguous either
    zarr.open_group(str(path), mode="r+")["draws/mu"][0, 9:14] = -1.0
    (path / "segments" / "chain-0" / "000000009-000000014.tmp").write_bytes(b"half a pickle")
    s.commit(0, 14, 20, points(14, 20), [[{}]] * 6, "after a gap", {"mu": 19})

    again = store(path)
    ck = again.checkpoint(0)
    assert ck.done == 9 and ck.state == "state after 9" and ck.point == {"mu": 8}
    assert [st[0]["k"] for st in ck.stats] == list(range(9))
    np.testing.assert_array_equal(again.points(0, ck.done)["mu"], np.arange(9.0))
    assert again.checkpoint(1).done == 0  # a chain with nothing stored starts over


def test_another_run_is_refused_naming_what_differs(tmp_path):
    path = tmp_path / "run.zarr"
    store(path, model="abc")
    with pytest.raises(StoreMismatchError, match="model is 'abc' there, 'xyz' here"):
        store(path, model="xyz")
    with pytest.raises(FileExistsError, match="pass resume=True"):
        SampleStore(path, {"seed": 1, "model": "abc"}, LAYOUT, chains=2, length=20)
    other = tmp_path / "other.zarr"
    zarr.open_group(str(other), mode="w")
    with pytest.raises(StoreMismatchError, match="not one of dt.sample"):
        store(other)
    (tmp_path / "file.zarr").write_text("not a store")
    with pytest.raises(StoreMismatchError, match="not a dt.sample store"):
        store(tmp_path / "file.zarr")
