"""Adopting a region systemd kept (pled/daemon/systemd/fdstore.py): only one that is sealed and planned from the very
same files.

Real memfds and files; the Notifier has no NOTIFY_SOCKET, so FDSTOREREMOVE goes nowhere."""
import logging
import os
import shutil

import pytest

from pled.daemon.regions import staging
from pled.daemon.sources.sidecar import open_table
from pled.daemon.systemd import fdstore
from pled.daemon.systemd.fdstore import StoredFd
from pled.daemon.systemd.notify import Notifier
from pled.shared import region


@pytest.fixture
def staged(sidecar):
    d = sidecar("ples_int4", shards=3, rows=500)
    r = staging.stage("t", open_table(str(d)))
    yield d, r
    r.close()


def sort(d, fds, caplog):
    caplog.set_level(logging.INFO, logger="pled.daemon.systemd.fdstore")
    return fdstore.adopt_stored(fds, {"t": region.plan("t", open_table(str(d)))}, fdstore.FdStore(Notifier({}), {}))


def test_the_same_files_are_adopted(staged, caplog):
    d, r = staged
    out = sort(d, [StoredFd(os.dup(r.fd), "pled.3.t")], caplog)
    adopted, generation = out.adopted["t"]
    assert generation == 3 and adopted.manifest == r.manifest
    adopted.close()


def test_a_shard_replaced_by_another_file_with_the_same_size_mtime_and_header_is_not_adopted(staged, caplog):
    d, r = staged
    path = d / "shard_1.safetensors"
    copy = d / "copy.tmp"
    shutil.copy2(path, copy)  # the same bytes and mtime, in another inode
    os.replace(copy, path)
    st = os.stat(path)
    entry = r.manifest.shards[1]
    assert (st.st_size, st.st_mtime_ns) == (entry.size, entry.mtime_ns) and st.st_ino != entry.ino
    fd = os.dup(r.fd)
    out = sort(d, [StoredFd(fd, "pled.1.t")], caplog)
    assert "t" not in out.adopted and out.generations["t"] == 2
    assert "shard_1.safetensors: replaced by another file" in caplog.text
    with pytest.raises(OSError):
        os.fstat(fd)  # closed: the store does not keep it either


def test_an_unsealed_region_is_not_adopted(staged, caplog):
    d, r = staged
    fd = os.memfd_create("pled:t", os.MFD_ALLOW_SEALING)
    os.write(fd, os.pread(r.fd, r.manifest.region_bytes, 0))  # the very bytes, but writable
    assert region.read_manifest(fd) == r.manifest and not region.is_sealed(fd)
    out = sort(d, [StoredFd(fd, "pled.1.t")], caplog)
    assert out.adopted == {}
    assert f"not a usable region (fd {fd} is not sealed (seals 0x0;" in caplog.text


def test_a_region_of_another_table_or_twice_the_same_table(staged, caplog):
    d, r = staged
    out = sort(d, [StoredFd(os.dup(r.fd), "pled.1.other")], caplog)
    assert out.adopted == {} and "table other is no longer in the config" in caplog.text
    out = sort(d, [StoredFd(os.dup(r.fd), "pled.2.t"), StoredFd(os.dup(r.fd), "pled.5.t")], caplog)
    adopted, generation = out.adopted["t"]
    assert generation == 5 and "table t is stored twice; keeping generation 5" in caplog.text
    adopted.close()


def test_a_stored_region_left_writable_by_mode_is_adopted_read_only_by_mode(staged, caplog):
    """A region stored by a pled from before regions were made 0444 (an upgrade that keeps the fd store): adopted,
    and made 0444, so that a client in pled's group cannot reopen its fd O_RDWR through /proc."""
    d, r = staged
    fd = os.dup(r.fd)
    os.fchmod(fd, 0o777)  # what memfd_create gives
    out = sort(d, [StoredFd(fd, "pled.1.t")], caplog)
    adopted, _ = out.adopted["t"]
    assert os.fstat(adopted.fd).st_mode & 0o777 == 0o444
    adopted.close()


@pytest.mark.root
def test_a_stored_region_whose_mode_pled_cannot_change_is_staged_anew(staged, caplog):
    """Owned by another uid (pled's User= changed): pled cannot make it 0444, so it does not adopt it."""
    d, r = staged
    fd = os.dup(r.fd)
    os.fchmod(fd, 0o666)
    os.fchown(fd, 4321, 4321)
    from forked import as_user  # pled as an unprivileged uid that does not own the memfd

    planned = {"t": region.plan("t", open_table(str(d)))}  # here: pytest's directory is closed to uid 65534
    caplog.set_level(logging.INFO, logger="pled.daemon.systemd.fdstore")

    def adopt() -> str:
        out = fdstore.adopt_stored([StoredFd(fd, "pled.1.t")], planned, fdstore.FdStore(Notifier({}), {}))
        return f"{sorted(out.adopted)} {caplog.text}"

    said = as_user(adopt, groups=[])
    assert said.startswith("[] ") and "not a usable region" in said and "Operation not permitted" in said, said
    assert os.fstat(fd).st_mode & 0o777 == 0o666
    os.close(fd)
