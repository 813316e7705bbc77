"""Table generations on a real daemon: reload beside the old generation, switch, let the old one go."""
import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

from forked import become
from harness import Daemon, run_pled, write_config
from pled import client
from pled.generator import make_sidecar
from pled.shared import protocol

HOLDER = textwrap.dedent("""
    import hashlib, json, sys
    from pled.client import attach
    t = attach(sys.argv[1], socket=sys.argv[2])
    print(json.dumps({"generation": t.generation}), flush=True)
    sys.stdin.readline()  # the test reloads pled meanwhile
    digests = [hashlib.sha256(t.buffer[s.offset : s.offset + s.size]).hexdigest() for s in t.shards]
    print(json.dumps({"generation": t.generation, "digests": digests}), flush=True)
""")


def file_digests(d) -> list[str]:
    return [hashlib.sha256((d / f"shard_{i}.safetensors").read_bytes()).hexdigest()
            for i in range(len(list(d.glob("*.safetensors"))))]


@pytest.mark.daemon
def test_reload_switches_generations_while_a_client_reads_the_old_one(tmp_path, notify_socket):
    d = tmp_path / "sc"
    make_sidecar(str(d), "ples_int4", shards=3, rows=30_000)
    old = file_digests(d)
    cfg = write_config(tmp_path / "pled.toml", {"t": d}, headroom_margin=0)
    sock = str(tmp_path / "run/pled.sock")
    log = tmp_path / "pled.log"
    pled = Daemon(cfg, env={"NOTIFY_SOCKET": notify_socket.path}, log=log)
    try:
        notify_socket.wait_for("READY=1")
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, "t", sock], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert json.loads(holder.stdout.readline())["generation"] == 1
        make_sidecar(str(d), "ples_int4", shards=3, rows=30_000, seed=42)  # re-quantized in place
        new = file_digests(d)
        assert new != old
        r = run_pled("reload", "--socket", sock)
        assert r.returncode == 0, r.stderr
        assert "changed: t (generation 2)" in r.stdout
        with client.attach("t", socket=sock) as t:
            assert t.generation == 2
            assert [hashlib.sha256(t.buffer[s.offset : s.offset + s.size]).hexdigest() for s in t.shards] == new
        # The client that attached before the reload reads its whole generation-1 mapping, unharmed.
        holder.stdin.write("\n")
        holder.stdin.flush()
        seen = json.loads(holder.stdout.readline())
        assert seen == {"generation": 1, "digests": old}
        assert holder.wait(timeout=30) == 0
        st = client.call(protocol.STATUS, socket=sock)
        assert [(x["table"], x["generation"], x["sources"]) for x in st["tables"]] == [("t", 2, "unchanged")]
    finally:
        pled.stop()
    lines = notify_socket.lines()
    reloading = lines.index("RELOADING=1")
    assert lines[reloading + 1].startswith("MONOTONIC_USEC=")
    stored = [n for n, _ in notify_socket.stored()]
    assert stored == ["pled.1.t", "pled.2.t"]
    removed = lines.index("FDSTOREREMOVE=1")
    assert lines[removed + 1] == "FDNAME=pled.1.t" and removed > reloading
    assert lines.index("READY=1", reloading) > removed  # READY=1 again once the switch is done
    text = log.read_text()
    assert "reload: staging table t as generation 2 next to generation 1" in text
    assert "table t generation 1 released (generation 2 now served); 1 connected client(s) attached to it" in text


def test_failed_reloads_change_nothing_and_say_why(tmp_path, daemon, sidecar):
    d = sidecar(shards=2, rows=1000)
    pled = daemon({"t": d})
    sock = pled.socket
    cfg = pled.config

    def reload_fails(words: str) -> None:
        r = run_pled("reload", "--socket", sock)
        assert r.returncode == 1 and "reload failed, pled serves what it served before" in r.stderr
        assert words in r.stderr, r.stderr
        with client.attach("t", socket=sock, populate=False) as t:
            assert t.generation == 1

    write_config(cfg, {"t": {"path": d, "colour": "blue"}}, socket=sock, headroom_margin=0)
    reload_fails("key table[0].colour: unknown key")
    write_config(cfg, {"t": d}, socket=sock, headroom_margin="1000TiB")
    make_sidecar(str(d), "ples_int4", shards=2, rows=1000, seed=3)  # something to stage, so the preflight runs
    reload_fails("but only")
    write_config(cfg, {"t": d}, socket=sock, headroom_margin=0)
    (d / "shard_1.safetensors").write_bytes(b"not safetensors at all")
    reload_fails("shard_1.safetensors: not a safetensors file")
    assert "reload failed, nothing changed" in pled.log()
    assert pled.proc.poll() is None


def test_a_removed_table_stops_being_offered_and_sighup_reloads(tmp_path, daemon, sidecar):
    a, b = sidecar(shards=1, rows=100), sidecar("ples_fp8", shards=1, rows=100)
    pled = daemon({"a": a, "b": b})
    held = client.attach("b", socket=pled.socket)
    write_config(pled.config, {"a": a}, socket=pled.socket, headroom_margin=0)
    assert pled.reload() == "reload done"
    with pytest.raises(client.NoSuchTable):
        client.attach("b", socket=pled.socket)
    assert ("table b generation 1 released (removed from the config: no longer offered); "
            "1 connected client(s) attached to it") in pled.log()
    with open(b / "shard_0.safetensors", "rb") as f:  # the holder's mapping is intact
        assert held.buffer[held.shards[0].offset : held.shards[0].offset + held.shards[0].size] == f.read()
    held.close()


def test_sources_gone_after_staging_do_not_disturb_serving(tmp_path, daemon, sidecar):
    d = sidecar(shards=2, rows=1000)
    pled = daemon({"t": d})
    (d / "shard_1.safetensors").unlink()
    st = client.call(protocol.STATUS, socket=pled.socket)
    assert st["tables"][0]["sources"] == "missing: shard_1.safetensors" and st["tables"][0]["state"] == "ready"
    with client.attach("t", socket=pled.socket) as t:
        assert t.residency() == 1.0
    r = run_pled("verify", "--socket", pled.socket)
    assert r.returncode == 1 and "shard_1.safetensors: the source file is gone" in r.stdout


@pytest.mark.root
def test_reload_is_for_root_and_pleds_user_only(tmp_path, daemon, sidecar):
    import tempfile

    run = tempfile.mkdtemp(prefix="pled-reload-", dir="/tmp")
    os.chmod(run, 0o755)
    sock = os.path.join(run, "pled.sock")
    try:
        pled = daemon({"t": sidecar(shards=1, rows=10)}, socket=sock, allow_uids=[65534])
        os.chmod(sock, 0o666)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                become(65534)
                try:
                    client.call(protocol.RELOAD, socket=sock)
                    os.write(w, b"reloaded")
                except client.PermissionDenied:
                    os.write(w, b"denied")
            finally:
                os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        with os.fdopen(r) as f:
            assert f.read() == "denied"
        assert "refused io.pled.Reload from pid" in pled.wait_for("refused io.pled.Reload")
        pled.stop()
    finally:
        for name in os.listdir(run):
            os.unlink(os.path.join(run, name))
        os.rmdir(run)
