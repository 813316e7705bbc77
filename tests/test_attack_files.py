"""What a file or a config can do: ordinary accidents and hostile files at start (one-line refusals, exit 78), at a
reload (the reload fails, nothing changes) and under Status, against a real daemon."""
import json
import os
import shutil
import socket
import struct
import subprocess
import sys

import pytest

from attack import assert_serving, baseline
from harness import run_pled, start, wait_until, write_config
from pled import client
from pled.shared import protocol

pytestmark = pytest.mark.daemon
SHARD = "shard_1.safetensors"


def st_file(path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def symlink_loop(p):
    os.symlink(p.name, p)  # points at itself


def proc_mem(p):
    os.symlink("/proc/self/mem", p)


def unix_socket(p):
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(p))
    s.close()


def fifo(p):
    os.mkfifo(p)


def nested_header(p):
    st_file(p, b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}")


def huge_int_header(p):
    st_file(p, b'{"w":{"dtype":"U8","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,1]}}', b"x")


def huge_header(p):
    header = json.dumps({f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
                         for i in range(200_000)}).encode()
    st_file(p, header)  # valid, 11 MB, 200,000 zero-size tensors


def repeated_key(p):
    st_file(p, b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
               b'"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x")


def bad_metadata(p):
    st_file(p, b'{"__metadata__":{"k":[1,2]},"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x")


def many_extents_header(p):
    """Finding 5: 300 extents of 10**19, whose product pled once printed in its refusal (more digits than int->str
    allows: exit 1 and a traceback, not 78)."""
    st_file(p, b'{"w":{"dtype":"U8","shape":[' + b",".join([b"10000000000000000000"] * 300)
            + b'],"data_offsets":[0,1]}}', b"x")


def negative_extents_header(p):
    st_file(p, b'{"w":{"dtype":"U8","shape":[-4,-4],"data_offsets":[0,16]}}', b"x" * 16)


BAD_SHARDS = {  # how a shard goes bad -> words the refusal must hold
    "symlink loop": (symlink_loop, "symlink loop"),
    "/proc/self/mem": (proc_mem, "/proc or /sys file"),
    "unix socket": (unix_socket, "Unix socket"),
    "fifo": (fifo, "FIFO"),
    "nested header": (nested_header, "nests more than 4 levels"),
    "5000-digit integer": (huge_int_header, "5000 digits"),
    "huge header": (huge_header, "pled reads headers of at most"),
    "repeated tensor": (repeated_key, "twice"),
    "metadata not strings": (bad_metadata, "__metadata__ must be an object of strings"),
    "300 extents of 10**19": (many_extents_header, "has 300 dimensions; at most 64 are accepted"),
    "negative extents": (negative_extents_header, "has a negative extent"),
}


def broken_copy(src, dst, how):
    shutil.copytree(src, dst)
    (dst / SHARD).unlink()
    (dst / "META.json").unlink()
    how(dst / SHARD)
    return dst


def assert_one_line_refusal(r, *words):
    assert r.returncode == 78, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if " ERROR " in line or not line.startswith("20")]  # not INFO lines
    assert len(lines) == 1, r.stderr[-2000:]
    for w in words:
        assert w in lines[0], lines[0]


@pytest.mark.parametrize("case", list(BAD_SHARDS))
def test_inspect_and_serve_refuse_a_bad_shard_in_one_line(tmp_path, sidecar, case):
    how, words = BAD_SHARDS[case]
    bad = broken_copy(sidecar(shards=4, rows=64), tmp_path / "bad", how)
    assert_one_line_refusal(run_pled("inspect", bad, timeout=60), str(bad / SHARD), words)
    cfg = write_config(tmp_path / "pled.toml", {"t": bad}, headroom_margin=0)
    assert_one_line_refusal(run_pled("serve", "-c", cfg, timeout=60), str(bad / SHARD), words)


CONFIGS = {  # a config that goes bad -> words
    "symlink loop": (lambda p: symlink_loop(p), "symlink loop"),
    "fifo": (lambda p: fifo(p), "FIFO"),
    "huge": (lambda p: p.write_text("# x\n" * 400_000), "a config may have at most"),
    "400 nines": (lambda p: p.write_text(f'headroom_margin = "{"9" * 400}"\n'), "headroom_margin"),
    "huge size": (lambda p: p.write_text(f'headroom_margin = "{"9" * 20}.5TiB"\n'), "headroom_margin"),
    "nul in socket": (lambda p: p.write_text('socket = "/run/pled/a\\u0000b"\n'), "NUL"),
    "nested": (lambda p: p.write_text("a = " + "[" * 3000 + "]" * 3000 + "\n"), "levels deep"),
}


# The keys `pled status -c` does not read: it needs the file and its socket only, read with tomllib alone (a probe
# runs it every few seconds), and asks the pled running (started from an earlier, good file) about the rest.
NOT_READ_BY_STATUS = {"400 nines", "huge size"}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_serve_and_status_refuse_a_bad_config_in_one_line(tmp_path, case):
    how, words = CONFIGS[case]
    cfg = tmp_path / "pled.toml"
    how(cfg)
    assert_one_line_refusal(run_pled("serve", "-c", cfg, timeout=60), str(cfg), words)
    status = run_pled("status", "-c", cfg, timeout=60)
    if case in NOT_READ_BY_STATUS:
        assert status.returncode == 3 and "not running" in status.stderr, status.stderr  # the default socket's pled
    else:
        assert_one_line_refusal(status, str(cfg), words)


def test_a_fifo_as_the_table_path_is_refused_at_once(tmp_path):
    os.mkfifo(tmp_path / "t.safetensors")
    assert_one_line_refusal(run_pled("inspect", tmp_path / "t.safetensors", timeout=60), "FIFO")
    cfg = write_config(tmp_path / "pled.toml", {"t": tmp_path / "t.safetensors"}, headroom_margin=0)
    assert_one_line_refusal(run_pled("serve", "-c", cfg, timeout=60), "FIFO")


@pytest.fixture
def served(tmp_path, sidecar):
    d = sidecar(shards=4, rows=64)
    pled = start(tmp_path, {"t1": d})
    yield pled, d
    pled.stop()


@pytest.mark.slow
def test_a_reload_onto_bad_files_fails_and_changes_nothing(tmp_path, served):
    pled, d = served
    before = baseline(pled, "t1")
    cfg = pled.config
    good = cfg.read_text()
    for case, (how, words) in BAD_SHARDS.items():
        bad = broken_copy(d, tmp_path / f"bad-{case.replace(' ', '_').replace('/', '_')}", how)
        write_config(cfg, {"t1": d, "x": bad}, socket=pled.socket, headroom_margin=0)
        r = run_pled("reload", "--socket", pled.socket, timeout=120)
        assert r.returncode == 1 and "reload failed" in r.stderr and words in r.stderr, (case, r.stderr)
        assert_serving(pled, "t1", d)
    for case, (how, words) in CONFIGS.items():
        cfg.unlink()
        how(cfg)
        r = run_pled("reload", "--socket", pled.socket, timeout=120)
        assert r.returncode == 1 and "reload failed" in r.stderr and words in r.stderr, (case, r.stderr)
        assert_serving(pled, "t1", d)
    cfg.unlink()
    cfg.write_text(good)  # as it was
    assert run_pled("reload", "--socket", pled.socket, timeout=120).returncode == 0
    assert_serving(pled, "t1", d, before)


@pytest.mark.parametrize("how", ["file", "symlink loop"])
def test_status_survives_a_sidecar_directory_replaced(tmp_path, sidecar, how):
    d = sidecar(shards=4, rows=64)
    pled = start(tmp_path, {"t1": d})
    try:
        before = baseline(pled, "t1")
        moved = tmp_path / "moved"
        d.rename(moved)
        if how == "file":
            d.write_text("not a directory")
        else:
            os.symlink(d.name, d)
        st = client.call(protocol.STATUS, socket=pled.socket)
        assert "unreadable" in st["tables"][0]["sources"] or "missing" in st["tables"][0]["sources"], st
        assert run_pled("status", "--socket", pled.socket).returncode == 0
        assert_serving(pled, "t1", None, before)  # the region still holds the table
    finally:
        pled.stop()


GATE = """
import os, time
import pled.daemon.sources.sidecar as s
_open = s.open_table
def open_table(path):
    if os.path.exists(path + ".gate"):  # a sidecar on a disk that takes its time
        open(path + ".waiting", "w").close()
    while os.path.exists(path + ".gate"):
        time.sleep(0.05)
    return _open(path)
s.open_table = open_table
"""
# A reload's planning (which opens the sidecars) runs in a child interpreter (pled/daemon/regions/parsing.py): the
# child gets the same gate, put before its own code.
GATED = GATE + f"GATE_SRC = {GATE!r}\n" + """
import subprocess as _sp
import pled.daemon.regions.parsing as _parsing
class _Sub:
    PIPE = _sp.PIPE
    Popen = staticmethod(lambda argv, *a, **k: _sp.Popen([argv[0], "-c", GATE_SRC + argv[2], *argv[3:]], *a, **k))
_parsing.subprocess = _Sub
"""


def test_a_slow_sidecar_in_a_reload_delays_no_client(tmp_path, sidecar):
    d, slow = sidecar(shards=4, rows=64), sidecar("ples_fp8", shards=2, rows=64)
    pled = start(tmp_path, {"t1": d}, patch=GATED)
    try:
        gate = tmp_path / (slow.name + ".gate")
        gate.touch()
        write_config(pled.config, {"t1": d, "slow": slow}, socket=pled.socket, headroom_margin=0)
        reload = subprocess.Popen([sys.executable, "-m", "pled", "reload", "--socket", pled.socket],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until((tmp_path / (slow.name + ".waiting")).exists, 30, message="the reload never opened the slow sidecar")
        for _ in range(5):  # while the reload reads the slow sidecar
            assert client.call(protocol.PING, socket=pled.socket, timeout=5) == {}
            assert_serving(pled, "t1", d)
        assert reload.poll() is None  # still waiting for the slow sidecar
        gate.unlink()
        out, err = reload.communicate(timeout=60)
        assert reload.returncode == 0 and "added: slow (generation 1)" in out, err
    finally:
        pled.stop()


def test_the_same_files_under_two_names_are_refused(tmp_path, sidecar):
    d = sidecar(shards=4, rows=64)
    cfg = write_config(tmp_path / "pled.toml", {"a": d, "b": f"{d}/", "c": f"{d}/*.safetensors"}, headroom_margin=0)
    assert_one_line_refusal(run_pled("serve", "-c", cfg, timeout=60), "tables a and b both hold", "shard_0")


def test_a_world_writable_socket_directory_is_refused(tmp_path, sidecar):
    d = sidecar(shards=1, rows=16)
    run = tmp_path / "open"
    run.mkdir()
    run.chmod(0o1777)
    cfg = write_config(tmp_path / "pled.toml", {"t": d}, headroom_margin=0, socket=str(run / "pled.sock"))
    assert_one_line_refusal(run_pled("serve", "-c", cfg, timeout=60), str(run), "writable by every user")
    assert not (run / "pled.sock").exists()


@pytest.mark.root
def test_a_socket_directory_another_group_can_write_is_warned_about(tmp_path, sidecar):
    d = sidecar(shards=1, rows=16)
    run = tmp_path / "grp"
    run.mkdir()
    os.chown(run, 0, 65534)
    run.chmod(0o770)
    pled = start(tmp_path, {"t": d}, socket=str(run / "pled.sock"))
    try:
        assert "is writable by group 65534, which pled is not in" in pled.log()
    finally:
        pled.stop()

