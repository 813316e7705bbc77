"""The pled command in real processes: inspect, preflight, serve, demo, make-sidecar."""
import json
import os
import subprocess
import sys

import pytest

from harness import run_pled, write_config


def test_make_sidecar_and_inspect(tmp_path):
    d = tmp_path / "sc"
    r = run_pled("make-sidecar", d, "--layout", "ples_fp8", "--shards", 11, "--rows", 50, "--seed", 3)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("synthetic shape: 11 shards x 50 rows, width 160, layout string 'pled_rowwise_e4m3")
    r = run_pled("inspect", d)
    assert r.returncode == 0, r.stderr
    assert "layout     ples_fp8" in r.stdout
    assert "shards     11 (shard_0.safetensors .. shard_10.safetensors)" in r.stdout
    assert "rows       550 (50 per shard)" in r.stdout
    assert "row width  160" in r.stdout
    size = sum(p.stat().st_size for p in d.glob("*.safetensors"))
    assert f"bytes      {size} " in r.stdout
    j = json.loads(run_pled("inspect", d, "--json").stdout)
    assert (j["layout"], j["shards"], j["rows"], j["bytes"]) == ("ples_fp8", 11, 550, size)


@pytest.mark.slow  # writes a 250 MB shard
def test_make_sidecar_writes_the_published_shape(tmp_path):
    from pled.daemon.sources.safetensors_file import read_header
    from pled.shared.layouts import PUBLISHED_ROWS_PER_SHARD, PUBLISHED_WIDTH

    d = tmp_path / "pub"
    r = run_pled("make-sidecar", d, "--published-shape", "--shards", 1, timeout=120)  # int4: one 250 MB shard
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == ("published shape: 1 shards x 2,500,012 rows, width 160, "
                                        "layout string 'group16_int4_fp16scale_lownibblefirst'")
    shapes = {t.name: t.shape for t in read_header(str(d / "shard_0.safetensors")).tensors}
    assert shapes == {"weight_i4": (PUBLISHED_ROWS_PER_SHARD, PUBLISHED_WIDTH // 2),
                      "weight_scale": (PUBLISHED_ROWS_PER_SHARD, PUBLISHED_WIDTH // 16)}
    meta = json.loads((d / "META.json").read_text())
    assert meta["shards"] * 2_500_012 == meta["rows"] and meta["width"] == 160  # the published offload worker's check
    (d / "shard_0.safetensors").unlink()
    for extra in (["--rows", 5], ["--width", 128]):
        r = run_pled("make-sidecar", tmp_path / "no", "--published-shape", *extra)
        assert r.returncode == 64 and "--published-shape writes 2,500,012 rows per shard of width 160" in r.stderr
        assert not (tmp_path / "no").exists()


def test_generator_is_deterministic(tmp_path):
    for name in ("a", "b"):
        assert run_pled("make-sidecar", tmp_path / name, "--shards", 2, "--rows", 30, "--seed", 7).returncode == 0
    assert (tmp_path / "a/shard_1.safetensors").read_bytes() == (tmp_path / "b/shard_1.safetensors").read_bytes()
    assert run_pled("make-sidecar", tmp_path / "c", "--shards", 2, "--rows", 30, "--seed", 8).returncode == 0
    assert (tmp_path / "a/shard_1.safetensors").read_bytes() != (tmp_path / "c/shard_1.safetensors").read_bytes()


def test_inspect_refuses_a_bad_sidecar_with_78(sidecar):
    d = sidecar(shards=3, rows=20)
    (d / "shard_1.safetensors").unlink()
    r = run_pled("inspect", d)
    assert r.returncode == 78
    assert "shard numbering has a gap: number 1 missing" in r.stderr and str(d) in r.stderr


def test_preflight_passes_and_refuses(sidecar, tmp_path):
    d = sidecar(shards=2, rows=100)
    ok = write_config(tmp_path / "ok.toml", {"ples_int4": d}, headroom_margin="1MiB")
    r = run_pled("preflight", "-c", ok)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("preflight passed: 6.0 MiB for table ples_int4")
    j = json.loads(run_pled("preflight", "-c", ok, "--json").stdout)
    assert j["ok"] and j["needed_bytes"] == 6 * 1024**2 and j["available_bytes"] > 0
    big = write_config(tmp_path / "big.toml", {"ples_int4": d}, headroom_margin="1000TiB")
    r = run_pled("preflight", "-c", big)
    assert r.returncode == 78
    assert "pled needs 6.0 MiB for table ples_int4 plus 1024000.0 GiB headroom_margin but only" in r.stdout
    r = run_pled("preflight", env={"PLED_CONFIG": str(big)})  # the environment names the config too
    assert r.returncode == 78


@pytest.mark.daemon
def test_serve_refuses_bad_config_and_bad_sidecar_with_78(tmp_path, sidecar):
    bad = write_config(tmp_path / "bad.toml", {}, huge_pages="sometimes")
    r = run_pled("serve", "-c", bad)
    assert r.returncode == 78 and f"{bad}: key huge_pages" in r.stderr
    empty = tmp_path / "empty.toml"
    empty.write_text("")  # no config at all
    r = run_pled("serve", "-c", empty)
    assert r.returncode == 78 and "no [[table]] configured" in r.stderr
    d = sidecar(shards=2, rows=20)
    (d / "shard_0.safetensors").write_bytes(b"garbage!" * 3)
    r = run_pled("serve", "-c", write_config(tmp_path / "t.toml", {"t": d}, headroom_margin=0))
    assert r.returncode == 78 and "shard_0.safetensors: not a safetensors file" in r.stderr


def test_serve_stages_holds_and_stops_on_sigterm(sidecar, daemon):
    d1 = sidecar("ples_int4", shards=3, rows=2000)
    d2 = sidecar("ples_nvfp4", shards=2, rows=2000)
    pled = daemon({"ples_int4": d1, "ples_nvfp4": d2}, wait="ready: 2 table(s)", headroom_margin="1MiB")
    log = pled.log()
    assert "preflight passed" in log
    assert "table ples_int4: shard 1/3 shard_0.safetensors" in log and "GB/s" in log
    assert "table ples_nvfp4: shard 2/2 shard_1.safetensors" in log
    assert "table ples_int4 staged:" in log and "sealed" in log and "huge pages" in log
    # The regions are held: the daemon's fds point at sealed memfds named after the tables.
    fds = {os.readlink(f"/proc/{pled.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pled.pid}/fd")}
    assert any(f.startswith("/memfd:pled:ples_int4") for f in fds), fds
    assert any(f.startswith("/memfd:pled:ples_nvfp4") for f in fds), fds
    assert pled.stop() == 0
    assert "stopped: released 2 table(s)" in pled.log()


def test_demo_runs_and_checks_rows(tmp_path):
    r = run_pled("demo", "--shards", 4, "--rows", 5000, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("identical to the file: True") == 5
    assert "a writable mapping of the region is refused (EPERM)" in r.stdout


def test_the_calls_to_a_running_pled_import_neither_pydantic_nor_the_daemon(tmp_path):
    """`pled status` (run by a Kubernetes probe every few seconds), `reload` and `verify` read the config for its
    socket with tomllib alone: no pydantic, nothing of the daemon but its logging."""
    cfg = write_config(tmp_path / "pled.toml", {}, socket=str(tmp_path / "none.sock"))
    code = ("import sys; from pled.cli import main; rc = main(sys.argv[1:]); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pydantic' or m.startswith('pled.daemon'))); "
            "sys.exit(rc)")
    for argv in (["status", "-c", str(cfg)], ["status", "--socket", str(tmp_path / "none.sock")],
                 ["reload", "-c", str(cfg)], ["verify", "-c", str(cfg)]):
        r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
        assert r.returncode == 3 and "not running" in r.stderr, (argv, r.stderr)  # it read the socket, and asked
        loaded = set(json.loads(r.stdout.replace("'", '"')))
        logging_only = {"pled.daemon", "pled.daemon.health", "pled.daemon.health.logs", "pled.daemon.health.journal"}
        assert loaded <= logging_only, (argv, loaded)


def test_status_finds_the_socket_in_the_config_and_refuses_a_socket_no_pled_could_bind(tmp_path):
    for value, words in (("relative.sock", "must be an absolute path"), ("/" + "s" * 120, "at most 107"),
                         (7, "expected the path of pled's Unix socket")):
        cfg = tmp_path / "pled.toml"
        cfg.write_text(f"socket = {json.dumps(value)}\n")
        r = run_pled("status", "-c", cfg)
        assert r.returncode == 78 and str(cfg) in r.stderr and "key socket" in r.stderr and words in r.stderr, r.stderr
    cfg.write_text(f'socket = "{tmp_path}/elsewhere.sock"\n[[table]]\nname = "t"\npath = "/nowhere"\n')
    r = run_pled("status", "-c", cfg)
    assert r.returncode == 3 and f"{tmp_path}/elsewhere.sock" in r.stderr, r.stderr
