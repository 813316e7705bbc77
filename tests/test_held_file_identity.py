"""A held file is the file pled staged only while its real path, size, mtime, device and inode are the ones pled
recorded (issue 48 class 9: a held file rewritten at the same size must never be served from pled's older region).

`rsync -a` and `cp -p src tmp && mv tmp file` replace a file by a rename: another inode, and the old size and mtime
kept. The seams (pled.client.held_files.State.lookup, shared by vLLM's weight iterator and safe_open) must refuse
that file, naming it, or with the disk fallback read its new bytes; the files beside it are still served from the
region. And a Hugging Face hub cache's snapshot (links into blobs/, tests/hfcache.py; issue 48 class 5) is one set
of files, however they are named. A real `pled serve` and safetensors' own safe_open, in this process."""
import importlib
import os

import numpy as np
import pytest
import safetensors
import torch

import harness
from pled.client import held_files, private_views, safe_open_seam
from pled.client.held_files import PledUnavailable
from pled.daemon.sources.safetensors_file import write

pytestmark = pytest.mark.daemon


def _file(path, seed: int) -> np.ndarray:
    a = np.random.default_rng(seed).standard_normal((16, 8)).astype(np.float32)
    write(str(path), [("w", "F32", (16, 8), a.tobytes())])
    return a


def _wrap(monkeypatch, socket: str) -> None:
    """safetensors.safe_open wrapped by pled's seam in this process, pled at ``socket``; put back afterwards."""
    monkeypatch.setenv("PLED_SOCKET", socket)
    for name in ("PLED_TABLES", "PLED_FALLBACK", "VLLM_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(held_files, "_state", None)
    monkeypatch.setattr(held_files.atexit, "register", lambda *a: None)
    for name in safe_open_seam.MODULES:
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "safe_open", module.safe_open)
        safe_open_seam.patch(module)


@pytest.fixture
def seam(tmp_path, monkeypatch):
    """Two held files under a real pled, and safetensors.safe_open wrapped by pled's seam in this process."""
    d = tmp_path / "model"
    d.mkdir()
    staged = {i: _file(d / f"model-{i}.safetensors", i) for i in (1, 2)}
    pled = harness.start(tmp_path, {"m": d / "*.safetensors"})
    _wrap(monkeypatch, pled.socket)
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
        assert private_views.origin(t.data_ptr())[0] is table  # the region's pages, mapped copy-on-write
    assert held_files._state.lookup(str(changed)) is None and torch.equal(t, torch.from_numpy(staged[1]))


@pytest.mark.parametrize("configured", ["snapshot", "blob"])
def test_a_hugging_face_snapshot_is_one_set_of_files_from_its_links_and_from_its_blobs(tmp_path, monkeypatch,
                                                                                        configured):
    """Issue 48 class 5: a checkpoint in a hub cache (tests/hfcache.py: snapshots/<rev>/<name> -> ../../blobs/<hash>),
    pled pointed at the snapshot directory (or at the blob of its one file): safe_open of the snapshot's link and of
    the blob behind it are the same held file (one Held, counted once), its PLE tensors the same bytes of the region,
    its other tensors read from the file, every one equal to safetensors' own reading."""
    from safetensors._safetensors_rust import safe_open as real

    from hfcache import in_layout
    from pled.generator import make_checkpoint

    make_checkpoint(str(tmp_path / "m"), "fp8", {0: 300, 1: 320}, width=32, parts=4, files=1)
    snap = in_layout("hf-snapshot", tmp_path / "m")
    (link,) = snap.glob("*.safetensors")
    blob = os.path.realpath(link)
    assert os.path.islink(link) and "/blobs/" in blob and os.path.basename(blob) != link.name
    pled = harness.start(tmp_path, {"ple": {"checkpoint": snap if configured == "snapshot" else blob}})
    try:
        _wrap(monkeypatch, pled.socket)
        with safetensors.safe_open(str(link), "pt") as a, safetensors.safe_open(blob, "pt") as b, \
                real(blob, "pt") as disk:
            assert type(a).__name__ == type(b).__name__ == "PledSafeOpen"
            st = held_files._state
            assert st.lookup(str(link)) is st.lookup(blob) is st.files[blob]
            table = st.tables["ple"]
            names = disk.keys()
            assert a.keys() == b.keys() == names
            ple = [n for n in names if ".shard_" in n]
            assert ple and len(ple) < len(names)  # PLE tensors from the region, the norms from the file
            for name in names:
                x, y, want = a.get_tensor(name), b.get_tensor(name), disk.get_tensor(name)
                assert torch.equal(x.view(torch.uint8), want.view(torch.uint8)) and torch.equal(
                    y.view(torch.uint8), want.view(torch.uint8)), name
                found = private_views.origin(x.data_ptr())  # the region's pages, mapped copy-on-write per handle
                assert (found is not None and found[0] is table) == (name in ple), name
                assert (found is not None and found == private_views.origin(y.data_ptr())) == (name in ple), name
        assert st.served == {("ple", "safe_open"): {blob}}  # one file, however it was named
    finally:
        state = held_files._state
        for t in (state.tables.values() if state is not None else ()):
            t.close()
        pled.stop()
