"""Reloads that touch several tables at once, and what pled holds afterwards.

One reload may change, add, remove and keep tables all at once; each change shows where a user looks (the reply of
`pled reload`, Status, what a client attaches, what a client that attached before still reads). A reload in which
one table of several fails changes nothing at all: every table keeps its generation and a later good reload
switches them all. After every reload, failed or not, pled holds one memfd per table it serves and no other fd
more than before: it closes its own fd of a replaced generation at the switch, whoever still maps that generation,
and the generations a failed reload staged.

``open_fds``, ``memfd_tables`` and ``settled_fds`` count a running pled's fds through /proc/PID/fd; any test of a
daemon may use them (they belong in harness.py beside ``Daemon.fds``).
"""
from __future__ import annotations

import hashlib
import os

import pytest

from harness import Daemon, run_pled, wait_until, write_config
from pled import client
from pled.generator import make_sidecar
from pled.shared import protocol

MEMFD = "/memfd:"


# -- pled's fds, counted from outside ---------------------------------------------------------------------------

def open_fds(pid: int) -> dict[int, str]:
    """A process's open fds: number -> what /proc/PID/fd/N links to (one closed while listing is left out)."""
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
        except FileNotFoundError:
            pass
    return out


def memfd_tables(fds: dict[int, str]) -> list[str]:
    """The tables of pled's memfds among ``fds``, sorted, one entry per memfd ('/memfd:pled:a (deleted)' -> 'a')."""
    return sorted(link[len(MEMFD):].removesuffix(" (deleted)").removeprefix("pled:")
                  for link in fds.values() if link.startswith(MEMFD))


def settled_fds(pled: Daemon, served, others: int | None = None, timeout: float = 5) -> dict[int, str]:
    """Wait until pled holds exactly one memfd per table in ``served`` and, where ``others`` is given, exactly that
    many fds besides them; returns its fds then. A leak fails with the fds listed, within ``timeout`` s (pled
    closes a finished connection and a released generation in its loop, a moment after the reply)."""
    want = sorted(served)

    def settled():
        fds = open_fds(pled.pid)
        got = memfd_tables(fds)
        return fds if got == want and (others is None or len(fds) - len(got) == others) else None

    def why():
        fds = open_fds(pled.pid)
        return (f"pled (pid {pled.pid}) should hold memfds of {want} and {others} other fd(s); it holds "
                f"{len(fds)}: {dict(sorted(fds.items()))}")

    return wait_until(settled, timeout, message=why)


def non_memfds(fds: dict[int, str]) -> int:
    return len(fds) - len(memfd_tables(fds))


# -- what a user sees -------------------------------------------------------------------------------------------

def file_digests(d) -> list[str]:
    shards = sorted(d.glob("shard_*.safetensors"), key=lambda p: int(p.stem.split("_")[1]))
    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in shards]


def region_digests(t: client.Table) -> list[str]:
    return [hashlib.sha256(t.buffer[s.offset : s.offset + s.size]).hexdigest() for s in t.shards]


def served(pled: Daemon) -> list[tuple[str, int, str, str]]:
    """(table, generation, state, sources) of each table in Status, in config order."""
    st = client.call(protocol.STATUS, socket=pled.socket)
    return [(t["table"], t["generation"], t["state"], t["sources"]) for t in st["tables"]]


def attached(pled: Daemon, name: str) -> tuple[int, list[str]]:
    """The generation a client attaching now gets, and its shards' digests."""
    with client.attach(name, socket=pled.socket, populate=False) as t:
        return t.generation, region_digests(t)


def damage(path, at: int = -100) -> None:
    """One byte of a shard's data flipped in place: its size and header stay, its content (and digest) do not."""
    with open(path, "r+b") as f:
        f.seek(at, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(at, os.SEEK_END)
        f.write(bytes([byte ^ 0xFF]))


# -- the tests --------------------------------------------------------------------------------------------------

@pytest.mark.daemon
def test_one_reload_changes_adds_removes_and_keeps_tables_at_once(tmp_path, daemon):
    src = {name: tmp_path / f"src-{i}" for i, name in enumerate(("alpha", "bravo", "charlie", "delta"))}
    make_sidecar(str(src["alpha"]), "ples_int4", rows=[700, 1, 1300])  # uneven shards
    make_sidecar(str(src["bravo"]), "ples_fp8", shards=2, rows=400)
    make_sidecar(str(src["charlie"]), "ples_nvfp4", shards=2, rows=500)
    make_sidecar(str(src["delta"]), "ples_int4", shards=2, rows=300, seed=7)
    first = ("alpha", "bravo", "charlie")
    pled = daemon({n: src[n] for n in first})
    idle = non_memfds(settled_fds(pled, first))
    before = {n: file_digests(src[n]) for n in first}
    holders = {n: client.attach(n, socket=pled.socket) for n in first}  # one connection each, held throughout
    settled_fds(pled, first, idle + 3)

    make_sidecar(str(src["alpha"]), "ples_int4", rows=[700, 1, 1300], seed=1)  # re-quantized: same sizes
    write_config(pled.config, {n: src[n] for n in ("alpha", "charlie", "delta")}, socket=pled.socket,
                 headroom_margin=0)
    r = run_pled("reload", "--socket", pled.socket)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["changed: alpha (generation 2)", "added: delta (generation 1)", "removed: bravo",
                                     "unchanged: charlie"]
    assert served(pled) == [("alpha", 2, "ready", "unchanged"), ("charlie", 1, "ready", "unchanged"),
                            ("delta", 1, "ready", "unchanged")]
    for name, generation in (("alpha", 2), ("charlie", 1), ("delta", 1)):
        assert attached(pled, name) == (generation, file_digests(src[name])), name
    with pytest.raises(client.NoSuchTable):
        client.attach("bravo", socket=pled.socket)
    # Whoever attached before the reload keeps reading the generation it mapped, the removed table's included.
    for name, t in holders.items():
        assert (t.generation, region_digests(t)) == (1, before[name]), name
    log = pled.log()
    assert "table bravo generation 1 released (removed from the config: no longer offered); 1 connected" in log
    assert "table alpha generation 1 released (generation 2 now served); 1 connected" in log
    assert "reload done in" in log and "changed alpha, added delta, removed bravo, unchanged charlie" in log
    assert "reload: staging table charlie" not in log

    # pled's own fds: one memfd per served table, though clients still map alpha's and bravo's first generations.
    now = ("alpha", "charlie", "delta")
    settled_fds(pled, now, idle + 3)
    for t in holders.values():
        t.close()
    settled_fds(pled, now, idle)


@pytest.mark.daemon
def test_a_reload_where_one_of_several_tables_fails_changes_nothing_then_a_good_one_switches_them_all(tmp_path, daemon):
    names = ("alpha", "bravo", "charlie", "delta")
    src = {name: tmp_path / f"src-{i}" for i, name in enumerate(names)}
    shapes = {"alpha": ("ples_int4", [300, 700]), "bravo": ("ples_fp8", [500, 5, 500]),
              "charlie": ("ples_nvfp4", [400, 400]), "delta": ("ples_int4", [200, 200])}
    for name, (layout, rows) in shapes.items():
        make_sidecar(str(src[name]), layout, rows=rows)
    pled = daemon({n: src[n] for n in names})
    idle = non_memfds(settled_fds(pled, names))
    generation_1 = {n: file_digests(src[n]) for n in names}
    holder = client.attach("bravo", socket=pled.socket)
    settled_fds(pled, names, idle + 1)

    # alpha, bravo and charlie change (alpha and charlie re-quantized to the same sizes, each of bravo's shards a
    # row longer); bravo's last shard is damaged after its META.json digests were written. Staged in config order:
    # alpha's next generation is made, bravo's fails on its digest, charlie's is never begun.
    changed = ("alpha", "bravo", "charlie")
    for name in changed:
        layout, rows = shapes[name]
        make_sidecar(str(src[name]), layout, rows=[r + (name == "bravo") for r in rows], seed=3)
    damage(src["bravo"] / "shard_2.safetensors")
    r = run_pled("reload", "--socket", pled.socket)
    assert r.returncode == 1
    assert "reload failed, pled serves what it served before: staging table bravo failed" in r.stderr, r.stderr
    assert f"{src['bravo']}/shard_2.safetensors: content" in r.stderr and "does not match" in r.stderr
    assert "reload failed, nothing changed: staging table bravo failed" in pled.log()
    # Nothing changed: every table at generation 1, clients attach what was staged first, `pled status` says so.
    assert served(pled) == [(n, 1, "ready", "unchanged" if n == "delta" else
                             f"changed: {', '.join(f'shard_{i}.safetensors' for i in range(len(shapes[n][1])))}")
                            for n in names]
    for name in names:
        assert attached(pled, name) == (1, generation_1[name]), name
    st = run_pled("status", "--socket", pled.socket)
    assert st.returncode == 0, st.stdout + st.stderr
    rows = {line.split()[0]: line.split() for line in st.stdout.splitlines()[2:6]}
    assert {n: (rows[n][1], rows[n][-2]) for n in names} == {n: ("ready", "1") for n in names}, st.stdout  # STATE, GEN
    settled_fds(pled, names, idle + 1)  # alpha's staged generation 2 closed with the failed reload

    make_sidecar(str(src["bravo"]), shapes["bravo"][0], rows=[501, 6, 501], seed=3)  # bravo copied again, whole
    r = run_pled("reload", "--socket", pled.socket)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["changed: alpha (generation 2), bravo (generation 2), charlie (generation 2)",
                                     "unchanged: delta"]
    assert served(pled) == [(n, 1 if n == "delta" else 2, "ready", "unchanged") for n in names]
    for name in names:
        assert attached(pled, name) == (1 if name == "delta" else 2, file_digests(src[name])), name
    assert (holder.generation, region_digests(holder)) == (1, generation_1["bravo"])
    settled_fds(pled, names, idle + 1)
    holder.close()
    settled_fds(pled, names, idle)


@pytest.mark.daemon
def test_pleds_fds_return_to_their_baseline_after_every_kind_of_reload(tmp_path, daemon):
    """Good reloads, reloads that fail in staging and in planning, removing and adding a table back, reloads
    with nothing to do, three rounds: after each, one memfd per served table and no other fd more than at start,
    while a client holds the first generation of a table that keeps changing."""
    names = ("x", "y", "z")
    src = {n: tmp_path / f"src-{n}" for n in names}
    for i, n in enumerate(names):
        make_sidecar(str(src[n]), "ples_int4", shards=2, rows=300 + i)
    pled = daemon({n: src[n] for n in names})
    holder = client.attach("x", socket=pled.socket)
    baseline = non_memfds(settled_fds(pled, names))
    generations = dict.fromkeys(names, 1)
    seed = 10

    def reload(config: tuple[str, ...], outcome: str) -> None:
        write_config(pled.config, {n: src[n] for n in config}, socket=pled.socket, headroom_margin=0)
        assert pled.reload() == outcome
        assert [(n, g) for n, g, _, _ in served(pled)] == [(n, generations[n]) for n in config]
        settled_fds(pled, config, baseline)

    for _ in range(3):
        seed += 1
        make_sidecar(str(src["x"]), "ples_int4", shards=2, rows=300, seed=seed)
        make_sidecar(str(src["y"]), "ples_int4", shards=2, rows=301, seed=seed)
        generations["x"] += 1
        generations["y"] += 1
        reload(names, "reload done")

        make_sidecar(str(src["x"]), "ples_int4", shards=2, rows=300, seed=seed + 100)
        make_sidecar(str(src["y"]), "ples_int4", shards=2, rows=301, seed=seed + 100)
        damage(src["y"] / "shard_1.safetensors")  # staging fails on y, after x's next generation was made
        reload(names, "reload failed")
        (src["y"] / "shard_1.safetensors").write_bytes(b"not a safetensors file")  # planning fails
        reload(names, "reload failed")
        make_sidecar(str(src["y"]), "ples_int4", shards=2, rows=301, seed=seed + 100)
        generations["x"] += 1
        generations["y"] += 1
        reload(names, "reload done")

        del generations["z"]
        reload(("x", "y"), "reload done")  # z removed
        generations["z"] = 1
        reload(names, "reload done")  # and added back: generation 1 again
        reload(names, "reload done")  # nothing to do
    assert holder.generation == 1
    holder.close()
    settled_fds(pled, names, baseline - 1)
    assert pled.log().count("reload failed, nothing changed") == 6


@pytest.mark.daemon
def test_a_same_size_rewrite_that_keeps_its_mtime_is_not_reloaded_and_only_verify_finds_it(tmp_path, daemon):
    """What pled compares: a reload (and Status's ``sources``) takes a table as unchanged when every shard has
    the path, size, mtime, inode and header it was staged from; only `pled verify` reads the bytes. A sidecar
    re-quantized in place to the same shapes, its shards' mtimes set back, is therefore served as it was until
    a shard's mtime moves (here: touch)."""
    a, b = tmp_path / "src-a", tmp_path / "src-b"
    make_sidecar(str(a), "ples_int4", shards=2, rows=400)
    make_sidecar(str(b), "ples_fp8", shards=2, rows=400)
    pled = daemon({"a": a, "b": b})
    baseline = non_memfds(settled_fds(pled, ("a", "b")))
    staged = file_digests(b)
    shards = sorted(b.glob("shard_*.safetensors"))
    kept = {p: os.stat(p) for p in shards}
    make_sidecar(str(b), "ples_fp8", shards=2, rows=400, seed=9)  # same sizes and headers, other bytes
    for p, st in kept.items():
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert (os.stat(p).st_ino, os.stat(p).st_size) == (st.st_ino, st.st_size)
    assert file_digests(b) != staged

    r = run_pled("reload", "--socket", pled.socket)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["unchanged: a, b", "nothing changed"]
    assert served(pled) == [("a", 1, "ready", "unchanged"), ("b", 1, "ready", "unchanged")]
    assert attached(pled, "b") == (1, staged)
    v = run_pled("verify", "b", "--socket", pled.socket)
    assert v.returncode == 1 and "table b: 2 shard(s) differ" in v.stdout, v.stdout + v.stderr
    settled_fds(pled, ("a", "b"), baseline)

    os.utime(shards[1])  # touch: now the reload sees the table changed, and stages what is on disk
    r = run_pled("reload", "--socket", pled.socket)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["changed: b (generation 2)", "unchanged: a"]
    assert attached(pled, "b") == (2, file_digests(b))
    assert run_pled("verify", "--socket", pled.socket).returncode == 0
    settled_fds(pled, ("a", "b"), baseline)


@pytest.mark.daemon
def test_a_reload_refused_while_planning_names_the_table(tmp_path, daemon):
    src = {n: tmp_path / f"src-{i}" for i, n in enumerate(("alpha", "bravo"))}
    for d in src.values():
        make_sidecar(str(d), "ples_int4", shards=2, rows=100)
    pled = daemon(src)
    (src["bravo"] / "shard_1.safetensors").write_bytes(b"not a safetensors file")
    assert pled.reload() == "reload failed"
    failure = next(line for line in pled.log().splitlines() if "reload failed, nothing changed" in line)
    assert f"{src['bravo']}/shard_1.safetensors" in failure
    assert "bravo" in failure.replace(str(src["bravo"]), "")  # the table's name, not only its path


@pytest.mark.daemon
def test_a_reload_stages_its_changed_tables_as_the_reread_config_says_and_keeps_the_others_as_they_are(tmp_path,
                                                                                                      daemon):
    src = {n: tmp_path / f"src-{i}" for i, n in enumerate(("alpha", "bravo"))}
    for d in src.values():
        make_sidecar(str(d), "ples_int4", rows=[300, 200])
    pled = daemon(src, huge_pages="auto")
    notes = {t["table"]: t["huge_page_note"] for t in client.call(protocol.STATUS, socket=pled.socket)["tables"]}
    assert not any('huge_pages = "off"' in n for n in notes.values()), notes

    make_sidecar(str(src["bravo"]), "ples_int4", rows=[300, 201])
    write_config(pled.config, src, socket=pled.socket, headroom_margin=0, huge_pages="off")
    assert pled.reload() == "reload done"
    now = {t["table"]: t for t in client.call(protocol.STATUS, socket=pled.socket)["tables"]}
    assert now["bravo"]["generation"] == 2 and 'huge_pages = "off" in the config' in now["bravo"]["huge_page_note"]
    assert (now["alpha"]["generation"], now["alpha"]["huge_page_note"]) == (1, notes["alpha"])
