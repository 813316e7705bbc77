"""`pled status` and `pled verify` on a daemon serving several tables, where only one of them differs.

What the codes mean (README's command table, pled/cli.py, pled/verify.py, pled/shared/errors.py):

    pled status    0 every table ready and fully resident; 1 a table not ready or not fully resident;
                   3 pled not running, or not answering within --timeout. With --live (the liveness probe):
                   0 whenever pled answers, staging or not; 3 otherwise. With --format prometheus (a scrape
                   script keeps its output on exit 0 only): 0 whenever pled answers, its figures saying what is
                   not ready; 3 otherwise, nothing printed. ``sources`` (in --json) says whether a
                   table's files are still as staged, and does not enter the exit status.
    pled verify    0 every shard of every table (or of the one named) identical to its file; 1 any difference,
                   a source it cannot compare, or a table it cannot attach (not ready), each named, the other
                   tables still verified; 3 pled not running.

``sources`` compares each shard's size and mtime with those it was staged from; `pled verify` compares the bytes.
"""
from __future__ import annotations

import json
import os
import signal

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import Daemon, run_pled, wait_until
from pled import client
from pled.generator import make_sidecar
from pled.shared import protocol

NAMES = ("alpha", "bravo", "charlie")


def three_tables(tmp_path, **rows) -> dict[str, object]:
    """alpha (int4), bravo (fp8, uneven shards), charlie (nvfp4), in directories not named after them."""
    src = {n: tmp_path / f"src-{i}" for i, n in enumerate(NAMES)}
    make_sidecar(str(src["alpha"]), "ples_int4", shards=2, rows=rows.get("alpha", 300))
    make_sidecar(str(src["bravo"]), "ples_fp8", rows=rows.get("bravo", [200, 1, 300]))
    make_sidecar(str(src["charlie"]), "ples_nvfp4", shards=2, rows=rows.get("charlie", 300))
    return src


def status_rows(out: str) -> dict[str, tuple[str, str]]:
    """`pled status`'s table rows: name -> (STATE, GEN)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("TABLE")) + 1
    rows = {}
    for line in lines[start:]:
        if not line or line.startswith(" ") or "client(s) attached" in line:
            break
        fields = line.split()
        rows[fields[0]] = (fields[1], fields[-2])
    return rows


def sources(pled: Daemon) -> dict[str, str]:
    return {t["table"]: t["sources"] for t in client.call(protocol.STATUS, socket=pled.socket)["tables"]}


def verdicts(out: str) -> dict[str, str]:
    """`pled verify`'s last line per table: name -> 'all shards identical' or 'N shard(s) differ'."""
    return {line.split(":")[0].removeprefix("table "): line.split(": ", 1)[1]
            for line in out.splitlines() if line.startswith("table ") and ": " in line and " generation " not in line}


def flip_byte(path, at: int) -> None:
    """One byte flipped in place, ``at`` bytes from the end: same size, same header, other content."""
    with open(path, "r+b") as f:
        f.seek(-at, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-at, os.SEEK_END)
        f.write(bytes([byte ^ 0x5A]))


@pytest.mark.daemon
def test_status_and_verify_exit_0_for_three_good_tables_and_3_once_pled_is_gone(tmp_path, daemon):
    pled = daemon(three_tables(tmp_path))
    st = run_pled("status", "--socket", pled.socket)
    assert st.returncode == 0, st.stdout + st.stderr
    assert status_rows(st.stdout) == {n: ("ready", "1") for n in NAMES}
    js = run_pled("status", "--json", "--socket", pled.socket)
    assert js.returncode == 0 and json.loads(js.stdout)["healthy"] is True
    assert {t["table"]: t["sources"] for t in json.loads(js.stdout)["tables"]} == dict.fromkeys(NAMES, "unchanged")
    v = run_pled("verify", "--socket", pled.socket)
    assert v.returncode == 0, v.stdout + v.stderr
    assert verdicts(v.stdout) == dict.fromkeys(NAMES, "all shards identical")
    one = run_pled("verify", "bravo", "--socket", pled.socket)
    assert one.returncode == 0 and verdicts(one.stdout) == {"bravo": "all shards identical"}, one.stdout
    pled.stop()
    for command in ("status", "verify"):
        gone = run_pled(command, "--socket", pled.socket)
        assert gone.returncode == 3 and "pled is not running" in gone.stderr, (command, gone.stderr)
    gone = run_pled("status", "--format", "prometheus", "--socket", pled.socket)
    assert (gone.returncode, gone.stdout) == (3, "") and "pled is not running" in gone.stderr, gone.stderr


@pytest.mark.daemon
def test_one_changed_table_of_three_fails_verify_and_shows_in_sources_while_status_stays_0(tmp_path, daemon):
    src = three_tables(tmp_path)
    pled = daemon(src)
    shard = src["bravo"] / "shard_1.safetensors"  # the middle table's middle shard: 1 row
    flip_byte(shard, at=3)
    size = shard.stat().st_size

    wait_until(lambda: sources(pled)["bravo"] != "unchanged", 5, message=lambda: f"sources: {sources(pled)}")
    assert sources(pled) == {"alpha": "unchanged", "bravo": "changed: shard_1.safetensors", "charlie": "unchanged"}
    st = run_pled("status", "--socket", pled.socket)
    assert st.returncode == 0, st.stdout + st.stderr  # every table is still ready and resident
    assert status_rows(st.stdout) == {n: ("ready", "1") for n in NAMES}
    js = run_pled("status", "--json", "--socket", pled.socket)
    assert js.returncode == 0 and json.loads(js.stdout)["healthy"] is True

    v = run_pled("verify", "--socket", pled.socket)
    assert v.returncode == 1, v.stdout + v.stderr
    assert verdicts(v.stdout) == {"alpha": "all shards identical", "bravo": "1 shard(s) differ",
                                  "charlie": "all shards identical"}
    assert f"[2/3] bravo/shard_1.safetensors: DIFFERS at byte {size - 3}: " in v.stdout, v.stdout
    for name, code in (("alpha", 0), ("bravo", 1), ("charlie", 0)):
        one = run_pled("verify", name, "--socket", pled.socket)
        assert one.returncode == code and list(verdicts(one.stdout)) == [name], (name, one.stdout, one.stderr)


@pytest.mark.daemon
def test_sources_reports_a_same_size_rewrite_by_its_mtime_and_verify_by_its_bytes(tmp_path, daemon):
    """A shard rewritten in place with the same size and other bytes: ``sources`` says "changed" while the mtime
    differs from the one staged, and "unchanged" once the mtime is set back (it compares size and mtime only);
    `pled verify` finds the difference either way."""
    src = three_tables(tmp_path)
    pled = daemon(src)
    shard = src["charlie"] / "shard_0.safetensors"
    staged = os.stat(shard)
    flip_byte(shard, at=1000)
    if os.stat(shard).st_mtime_ns == staged.st_mtime_ns:  # a file system with coarse timestamps
        os.utime(shard, ns=(staged.st_atime_ns, staged.st_mtime_ns + 1_000_000_000))
    assert os.stat(shard).st_size == staged.st_size

    wait_until(lambda: sources(pled)["charlie"] != "unchanged", 5,
               message=lambda: f"a same-size rewrite with a new mtime not in sources: {sources(pled)}")
    assert sources(pled) == {"alpha": "unchanged", "bravo": "unchanged", "charlie": "changed: shard_0.safetensors"}
    v = run_pled("verify", "--socket", pled.socket)
    assert v.returncode == 1 and verdicts(v.stdout)["charlie"] == "1 shard(s) differ", v.stdout

    os.utime(shard, ns=(staged.st_atime_ns, staged.st_mtime_ns))  # the mtime set back: other bytes, same stat
    wait_until(lambda: sources(pled)["charlie"] == "unchanged", 5,
               message=lambda: f"sources after the mtime was set back: {sources(pled)}")
    assert sources(pled) == dict.fromkeys(NAMES, "unchanged")
    js = run_pled("status", "--json", "--socket", pled.socket)
    assert js.returncode == 0 and json.loads(js.stdout)["healthy"] is True
    v = run_pled("verify", "charlie", "--socket", pled.socket)
    assert v.returncode == 1 and "[1/2] charlie/shard_0.safetensors: DIFFERS at byte" in v.stdout, v.stdout


@pytest.mark.daemon
def test_status_exits_1_while_one_of_three_tables_is_still_staging(tmp_path, daemon):
    """Tables are staged one after another in config order; with staging held to 1 MB/s the last one (19 MiB)
    stages for about 20 s after the first two are ready. pled is stopped long before it is done. Meanwhile `pled
    status` exits 1, and `pled status --format prometheus` exits 0 with the figures that say so."""
    pled = daemon(three_tables(tmp_path, charlie=110_000), wait="listening on", staging_bandwidth="1MB/s")
    states = lambda: {t["table"]: t["state"] for t in client.call(protocol.STATUS, socket=pled.socket)["tables"]}  # noqa: E731
    wait_until(lambda: states()["bravo"] == "ready", 10, message=lambda: f"{states()}")

    st = run_pled("status", "--socket", pled.socket)
    js = run_pled("status", "--json", "--socket", pled.socket)
    prom = run_pled("status", "--format", "prometheus", "--socket", pled.socket)
    v = run_pled("verify", "--socket", pled.socket)
    one = run_pled("verify", "alpha", "--socket", pled.socket)
    assert states()["charlie"] == "staging", "charlie finished staging during the checks: slow it down further"
    assert st.returncode == 1, st.stdout + st.stderr
    # A scrape script keeps the Prometheus text only on exit 0: printed, exit 0, the figures saying it stages.
    assert prom.returncode == 0 and prom.stderr == "", prom.stdout + prom.stderr
    samples = {(s.name, s.labels.get("table"), s.labels.get("state")): s.value
               for family in text_string_to_metric_families(prom.stdout) for s in family.samples}
    assert [samples[("pled_table_state", n, "staging")] for n in NAMES] == [0, 0, 1], prom.stdout
    assert [samples[("pled_table_state", n, "ready")] for n in NAMES] == [1, 1, 0], prom.stdout
    assert status_rows(st.stdout) == {"alpha": ("ready", "1"), "bravo": ("ready", "1"), "charlie": ("staging", "1")}
    assert js.returncode == 1 and json.loads(js.stdout)["healthy"] is False
    assert [t["state"] for t in json.loads(js.stdout)["tables"]] == ["ready", "ready", "staging"]
    assert v.returncode == 1, v.stdout + v.stderr
    assert verdicts(v.stdout) == {"alpha": "all shards identical", "bravo": "all shards identical"}
    assert "pled verify: table 'charlie' is still being staged" in v.stderr, v.stderr
    assert one.returncode == 0 and verdicts(one.stdout) == {"alpha": "all shards identical"}, one.stdout

    # Staging is alive; a pled that stopped answering (stopped here by SIGSTOP, as a hung loop would be) is not.
    live = run_pled("status", "--live", "--socket", pled.socket)
    assert live.returncode == 0 and status_rows(live.stdout)["charlie"] == ("staging", "1"), live.stdout + live.stderr
    pled.send_signal(signal.SIGSTOP)
    try:
        stuck = run_pled("status", "--live", "--timeout", "1", "--socket", pled.socket)
        ready = run_pled("status", "--timeout", "1", "--socket", pled.socket)
    finally:
        pled.send_signal(signal.SIGCONT)
    assert stuck.returncode == 3 and "did not answer" in stuck.stderr, stuck.stdout + stuck.stderr
    assert ready.returncode == 3, ready.stdout + ready.stderr


@pytest.mark.daemon
def test_verify_goes_on_past_a_source_it_cannot_compare_and_names_it(tmp_path, daemon):
    """The first table's first source file is replaced by a FIFO (opened plainly, it would block pled verify
    until a writer came): that shard is named and counted, and every other shard of every table still compared."""
    src = three_tables(tmp_path)
    pled = daemon(src)
    shard = src["alpha"] / "shard_0.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    v = run_pled("verify", "--socket", pled.socket, timeout=60)
    assert v.returncode == 1, v.stdout + v.stderr
    assert "[1/2] alpha/shard_0.safetensors: cannot be compared: the source is a FIFO, not a regular file" in v.stdout
    assert verdicts(v.stdout) == {"alpha": "1 shard(s) differ", "bravo": "all shards identical",
                                  "charlie": "all shards identical"}, v.stdout


@pytest.mark.daemon
def test_verify_names_the_byte_and_both_values_of_a_difference_past_its_first_read(tmp_path, daemon):
    """`pled verify` reads a file CHUNK (16 MiB) at a time; in a 20 MB shard whose bytes differ only in its second
    read (two bytes, 300 apart), it names the first of them by its offset in the file and the values the region and
    the file hold there, as it does for one in the first read."""
    from pled.verify import CHUNK

    src = tmp_path / "big"
    make_sidecar(str(src), "ples_int4", shards=1, rows=200_000)  # one shard of 20,000,224 bytes
    shard = src / "shard_0.safetensors"
    size = shard.stat().st_size
    first, second = CHUNK + 1_234_567, CHUNK + 1_234_867
    assert CHUNK < first < second < size and size < 2 * CHUNK  # both in the second read, the last one
    pled = daemon({"t": src})
    with open(shard, "r+b") as f:
        was = []
        for at in (first, second):
            f.seek(at)
            was.append(f.read(1)[0])
            f.seek(at)
            f.write(bytes([was[-1] ^ 0xA5]))  # the same size and header, other content
    v = run_pled("verify", "t", "--socket", pled.socket)
    assert v.returncode == 1, v.stdout + v.stderr
    assert (f"[1/1] t/shard_0.safetensors: DIFFERS at byte {first}: the region has 0x{was[0]:02x}, the file "
            f"0x{was[0] ^ 0xA5:02x}") in v.stdout.splitlines(), v.stdout
    assert verdicts(v.stdout) == {"t": "1 shard(s) differ"}
