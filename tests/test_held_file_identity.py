"""A held file is the file pled staged only while its real path, size, mtime, device and inode are the ones pled
recorded (issue 48 class 9: a held file rewritten at the same size must never be served from pled's older region).

`rsync -a` and `cp -p src tmp && mv tmp file` replace a file by a rename: another inode, and the old size and mtime
kept. The seams (pled.client.held_files.State.lookup, shared by vLLM's weight iterator and safe_open) must refuse
that file, naming it, or with the disk fallback read its new bytes; the files beside it are still served from the
region. A real `pled serve` and safetensors' own safe_open, in this process."""
import importlib
import os

import numpy as np
import pytest
import safetensors
import torch

import harness
from pled.client import held_files, safe_open_seam
from pled.client.held_files import PledUnavailable
from pled.daemon.sources.safetensors_file import write

pytestmark = pytest.mark.daemon


def _file(path, seed: int) -> np.ndarray:
    a = np.random.default_rng(seed).standard_normal((16, 8)).astype(np.float32)
    write(str(path), [("w", "F32", (16, 8), a.tobytes())])
    return a


@pytest.fixture
def seam(tmp_path, monkeypatch):
    """Two held files under a real pled, and safetensors.safe_open wrapped by pled's seam in this process."""
    d = tmp_path / "model"
    d.mkdir()
    staged = {i: _file(d / f"model-{i}.safetensors", i) for i in (1, 2)}
    pled = harness.start(tmp_path, {"m": d / "*.safetensors"})
    monkeypatch.setenv("PLED_SOCKET", pled.socket)
    for name in ("PLED_TABLES", "PLED_FALLBACK", "VLLM_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(held_files, "_state", None)
    monkeypatch.setattr(held_files.atexit, "register", lambda *a: None)
    for name in safe_open_seam.MODULES:
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "safe_open", module.safe_open)
        safe_open_seam.patch(module)
    try:
        yield d, staged
    finally:
        state = held_files._state
        for table in (state.tables.values() if state is not None else ()):
            table.close()
        pled.stop()


def _replace_keeping_size_and_mtime(path, seed: int) -> np.ndarray:
    before = os.stat(path)
    tmp = path.with_suffix(".tmp")
    fresh = _file(tmp, seed)
    os.utime(tmp, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.rename(tmp, path)
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns) and after.st_ino != before.st_ino
    return fresh


def test_a_held_file_replaced_by_rename_at_the_same_size_and_mtime_is_refused_never_served_stale(seam, monkeypatch):
    d, staged = seam
    changed, kept = d / "model-2.safetensors", d / "model-1.safetensors"
    with safetensors.safe_open(str(changed), "pt") as f:  # served from the region before the change
        assert type(f).__name__ == "PledSafeOpen" and np.array_equal(f.get_tensor("w").numpy(), staged[2])
    fresh = _replace_keeping_size_and_mtime(changed, seed=7)
    with pytest.raises(PledUnavailable) as err:
        safetensors.safe_open(str(changed), "pt")
    said = str(err.value)
    assert f"{changed} changed since pled staged it into table m (replaced by another file (inode) of the same " \
           "size and mtime)" in said and "\n" not in said, said
    monkeypatch.setenv("PLED_FALLBACK", "disk")  # the fallback: the new bytes from disk, the other file from pled
    with safetensors.safe_open(str(changed), "pt") as f:
        assert type(f).__name__ != "PledSafeOpen" and np.array_equal(f.get_tensor("w").numpy(), fresh)
    with safetensors.safe_open(str(kept), "pt") as f:
        t = f.get_tensor("w")
        table = held_files._state.tables["m"]
        assert type(f).__name__ == "PledSafeOpen" and np.array_equal(t.numpy(), staged[1])
        assert table.address <= t.data_ptr() < table.address + table.manifest.region_bytes
    assert held_files._state.lookup(str(changed)) is None and torch.equal(t, torch.from_numpy(staged[1]))
