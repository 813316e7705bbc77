"""Copy-on-write views of a table (pled/client/private_views.py): what pled's safe_open and vLLM's weight iterator
hand out in place of safetensors' writable tensors (issue 48 class 3). A real sealed region (staged from a real
checkpoint by pled's staging), mapped as a client maps it; no daemon.

- A view reads the region's bytes and may be written: the write lands in this process's private copy of that one
  page; the region (its memfd, and the client's shared read-only mapping of it) is unchanged.
- ``origin`` finds the table and region offset of an address in a view; ``unwritten`` says whether a range holds
  only the region's own pages, read from /proc/self/pagemap: false as soon as one byte of it was written.
"""
import os

import numpy as np
import pytest
import torch

from pled.client import private_views
from pled.client.mapped_table import Table
from pled.daemon.regions import staging
from pled.daemon.sources.checkpoint import open_checkpoint
from pled.generator import make_checkpoint


@pytest.fixture
def table(tmp_path):
    make_checkpoint(str(tmp_path / "m"), "bf16", {0: 3000, 1: 3100}, width=64, parts=8, files=2)
    with staging.stage("t", open_checkpoint(str(tmp_path / "m"))) as r:
        t = Table(os.dup(r.fd), 1, populate=False)
        try:
            yield t
        finally:
            t.close()


def test_a_view_reads_the_region_and_a_write_stays_in_this_process_and_page(table):
    a = table.manifest.arrays[1]
    mapping = private_views.PrivateMapping(table, a.offset, a.offset + a.nbytes)
    entries = [e for e in table.manifest.tensors if a.offset <= e.offset < a.offset + a.nbytes]
    views = {e.name: mapping.tensor(e) for e in entries}
    shared = {e.name: table.view(i) for i, e in enumerate(table.manifest.tensors) if e.name in views}
    before = bytes(table.buffer[a.offset:a.offset + a.nbytes])
    for name, v in views.items():
        assert torch.equal(v.view(torch.uint8), shared[name].view(torch.uint8)), name
        assert v.data_ptr() != shared[name].data_ptr()  # another mapping of the same pages
        assert private_views.origin(v.data_ptr()) == (table, next(e.offset for e in entries if e.name == name))
    first, *_, last = entries
    n = lambda e: e.nbytes  # noqa: E731
    v = views[last.name]
    assert private_views.unwritten(v.data_ptr(), n(last)) and private_views.unwritten(
        views[first.name].data_ptr(), n(first))
    v.view(torch.uint8).reshape(-1)[n(last) // 2] ^= 0x40  # a write: this page becomes this process's own
    assert not private_views.unwritten(v.data_ptr(), n(last))
    assert private_views.unwritten(views[first.name].data_ptr(), n(first))  # pages away from the write: still pled's
    assert bytes(table.buffer[a.offset:a.offset + a.nbytes]) == before  # the region: as it was
    assert os.pread(table.fd, a.nbytes, a.offset) == before
    assert not torch.equal(v.view(torch.uint8), shared[last.name].view(torch.uint8))
    other = private_views.PrivateMapping(table, last.offset, last.offset + last.nbytes).tensor(last)
    assert torch.equal(other.view(torch.uint8), shared[last.name].view(torch.uint8))  # each mapping its own
    array = private_views.PrivateMapping(table, first.offset, first.offset + first.nbytes).array(
        type(first)(first.name, first.shard, "I16", first.shape, first.offset, first.nbytes))
    assert array.flags.writeable and array.tobytes() == bytes(table.buffer[first.offset:first.offset + first.nbytes])


def test_origin_is_none_outside_every_view_and_forgotten_with_the_last_one(table):
    import gc

    e = table.manifest.tensors[0]
    t = private_views.PrivateMapping(table, e.offset, e.offset + e.nbytes).tensor(e)
    ptr = t.data_ptr()
    assert private_views.origin(ptr) == (table, e.offset)
    assert private_views.origin(table.address + e.offset) is None  # the shared mapping is not a private view
    assert private_views.origin(np.zeros(4).ctypes.data) is None
    del t
    gc.collect()
    assert private_views.origin(ptr) is None  # unmapped with the last view: nothing left to find there


def test_same_rows_is_the_same_offset_of_the_same_table_unwritten_and_nothing_else(table, tmp_path):
    """What the compare-only loaders take as pled's own rows without reading them (private_views.same_rows)."""
    a = table.manifest.arrays[0]
    rows = a.shape[0]
    shared = torch.from_numpy(np.frombuffer(table.buffer, dtype=np.uint8, count=a.nbytes, offset=a.offset)).view(
        torch.bfloat16).reshape(rows, -1)
    view = private_views.PrivateMapping(table, a.offset, a.offset + a.nbytes).bytes(a.offset, a.nbytes)
    mine = torch.from_numpy(view).view(torch.bfloat16).reshape(rows, -1)
    half = rows // 2
    assert private_views.same_rows(table, shared[half:], shared[half:])  # one address: the same bytes
    assert private_views.same_rows(table, mine[half:], shared[half:])  # the same offset, mapped copy-on-write
    assert not private_views.same_rows(table, mine[half:], shared[half - 1:-1])  # other rows
    assert not private_views.same_rows(table, mine[:, :8], shared[:, :8])  # not the rows as they lie
    make_checkpoint(str(tmp_path / "o"), "bf16", {0: 3000, 1: 3100}, width=64, parts=8, files=2)
    with staging.stage("o", open_checkpoint(str(tmp_path / "o"))) as r, Table(os.dup(r.fd), 1, populate=False) as o:
        assert not private_views.same_rows(o, mine[half:], shared[half:])  # another table's offset
    mine[half + 1, 0] = 2.0  # a write into those rows: this process's page now, not pled's
    assert not private_views.same_rows(table, mine[half:], shared[half:])
    assert private_views.same_rows(table, mine[:half // 4], shared[:half // 4])  # rows pages away still are
