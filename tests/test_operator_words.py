"""What pled tells an operator is true (issue 47): found by trying the Debian package as a new operator would
(install, config, start, status, reload, restart, verify, upgrade, remove, purge), each checked here on a real pled
serve and the real `pled` command.

- The staging line counts a table's source files by what they are: a sidecar's shards, a glob's files, a model
  checkpoint's files (a checkpoint table's "shards" are the pieces each PLE table is split into, not its files; the
  journal said "staged: 78.5 KiB in 3 shards" for a checkpoint of 3 files).
- `pled status` says when a table's files on disk are no longer the ones it staged (its JSON said
  "sources": "changed: ...", the table view said nothing), and what to do.
"""
from __future__ import annotations

import os

import pytest

import harness
from pled.daemon.sources.safetensors_file import write
from pled.generator import make_checkpoint, make_sidecar

pytestmark = pytest.mark.daemon


def test_the_staging_line_names_shards_files_and_checkpoint_files_and_status_notes_changed_sources(tmp_path, daemon):
    make_sidecar(str(tmp_path / "sidecar"), "ples_int4", shards=2, rows=256)
    make_checkpoint(str(tmp_path / "ckpt"), "nvfp4", {0: 500, 1: 700}, width=64, parts=4, files=3)
    (tmp_path / "glob").mkdir()
    for i in range(2):  # any .safetensors files (no PLE layout's tensors): a generic table, staged file by file
        write(str(tmp_path / "glob" / f"part{i}.safetensors"), [("embed", "U8", (64, 32), bytes(range(256)) * 8)])
    pled = daemon({"side": tmp_path / "sidecar", "qwen": {"checkpoint": tmp_path / "ckpt"},
                   "loose": tmp_path / "glob" / "*.safetensors"})
    log = pled.log()
    assert "table side staged: " in log and "table qwen staged: " in log and "table loose staged: " in log, log
    lines = {name: next(line for line in log.splitlines() if f"table {name} staged: " in line)
             for name in ("side", "qwen", "loose")}
    assert " in 2 shards, " in lines["side"], lines
    assert " in 3 checkpoint files, " in lines["qwen"] and "shard" not in lines["qwen"], lines
    assert " in 2 files, " in lines["loose"] and "shard" not in lines["loose"], lines

    before = harness.run_pled("status", "--socket", pled.socket)
    assert before.returncode == 0 and "source files" not in before.stdout, before.stdout
    changed = tmp_path / "ckpt" / "model-00002-of-00003.safetensors"
    st = os.stat(changed)
    os.utime(changed, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # as a copy of a new checkpoint over it leaves it
    after = harness.run_pled("status", "--socket", pled.socket)
    assert after.returncode == 0, after.stderr  # served as staged: healthy; the note says what differs
    notes = [line for line in after.stdout.splitlines() if "source files" in line]
    assert notes == ["  note: qwen: served as staged, but its source files are not as pled staged them (changed: "
                     "model-00002-of-00003.safetensors): `pled verify qwen` compares them, `pled reload` stages "
                     "what is there now"], after.stdout
