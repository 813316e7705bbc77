"""The vLLM plugin against real vLLM (its CPU build), in its own virtual environment (.venv-vllm,
made by `make test`): a tiny random model whose .safetensors files pled holds, generated with and
without the plugin.

Skipped, with the reason, where that environment is missing (make test builds it; PLED_SKIP_VLLM=1
skips building it).
"""
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from harness import run_pled
from pled import client
from pled.shared import protocol
from pled.shared.pagecache import cached_bytes

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
HERE = Path(__file__).parent / "vllm_env"

VLLM_TMP = ["/tmp"]  # set by the vllm_tmpdir fixture

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def vllm_tmpdir():
    """vLLM leaves its IPC sockets and files in $TMPDIR: give it a short one of its own, removed afterwards
    (short, because a Unix socket path has at most 107 bytes)."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="pledv-", dir="/tmp")
    VLLM_TMP[0] = d
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny-llama") / "model"
    subprocess.run([str(VLLM_PYTHON), str(HERE / "make_model.py"), str(d)], check=True, capture_output=True,
                   timeout=300)
    assert len(list(d.glob("*.safetensors"))) >= 3, "the model should be in several files"
    return d


def generate(model: Path, env: dict | None = None, additional: dict | None = None, hold: bool = False):
    """Run vllm.LLM in a fresh process of the vLLM environment."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("PLED_")}
    full["TMPDIR"] = VLLM_TMP[0]
    full |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "OMP_NUM_THREADS": "2",
             "VLLM_LOGGING_LEVEL": "INFO", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"} | (env or {})
    args = [str(VLLM_PYTHON), str(HERE / "generate.py"), str(model)] + ([json.dumps(additional)] if additional else [])
    if hold:
        full["PLED_TEST_HOLD"] = "1"
        return subprocess.Popen(args, env=full, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    return subprocess.run(args, env=full, capture_output=True, text=True, timeout=900)


def tokens(output: str):
    line = next(line for line in output.splitlines() if line.startswith("PLED-TOKENS "))
    return json.loads(line[len("PLED-TOKENS "):])


def drop_cache(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def test_vllm_reads_the_model_from_pled(model, daemon):
    baseline = generate(model)
    assert baseline.returncode == 0, baseline.stdout[-3000:] + baseline.stderr[-3000:]
    expected = tokens(baseline.stdout)
    assert all(len(t) == 12 for t in expected)

    files = sorted(str(p) for p in model.glob("*.safetensors"))
    pled = daemon({"model": model / "model-*.safetensors"})
    drop_cache(files)
    assert sum(cached_bytes(f) for f in files) == 0
    proc = generate(model, env={"PLED_SOCKET": pled.socket}, hold=True)
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            if line.startswith("PLED-HOLDING"):
                break
        text = "".join(out)
        assert "PLED-HOLDING" in text, text[-4000:]
        assert tokens(text) == expected  # the same model, read from shared memory
        assert "pled: pid" in text and "mapped table model (generation 1)" in text
        assert f"{len(files)} of {len(files)} files" in text and "0 bytes read from disk for them" in text
        # vLLM never read the weight files: their page cache stayed empty through load and generation.
        assert [cached_bytes(f) for f in files] == [0] * len(files)
        st = client.call(protocol.STATUS, socket=pled.socket)
        pids = {c["pid"] for c in st["clients"]}
        assert pids and all("model" in c["tables"] for c in st["clients"])
        status = run_pled("status", "--socket", pled.socket).stdout
        assert "client(s) attached" in status and str(next(iter(pids))) in status
    finally:
        proc.stdin.write("\n")
        proc.stdin.close()
        proc.wait(timeout=120)
    assert "client attached: table model" in pled.log()


def test_pled_configured_but_stopped_fails_the_load(model, tmp_path):
    dead = str(tmp_path / "nothing-here.sock")
    r = generate(model, env={"PLED_SOCKET": dead})
    assert r.returncode != 0
    text = r.stdout + r.stderr
    assert f"pled: configured by PLED_SOCKET ({dead}) but cannot attach" in text
    assert "systemctl status pled" in text and '"fallback": "disk"' in text


def test_fallback_disk_warns_and_reads_from_disk(model, tmp_path):
    dead = str(tmp_path / "nothing-here.sock")
    r = generate(model, additional={"pled": {"socket": dead, "fallback": "disk"}})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = r.stdout + r.stderr
    assert "reading from disk instead (fallback = \"disk\")" in text
    assert len(tokens(r.stdout)) == 2


def test_safe_open_is_served_for_held_files_only(model, daemon, tmp_path):
    """Code outside vLLM's loader (a PLE offload worker) that maps shards with safetensors.safe_open."""
    import shutil

    model = Path(shutil.copytree(model, tmp_path / "copy"))  # this test changes a file; the others share `model`
    files = sorted(model.glob("*.safetensors"))
    pled = daemon({"model": model / "model-*.safetensors"})
    other = tmp_path / "other.safetensors"
    other.write_bytes(files[0].read_bytes())  # same bytes, but not a file pled holds
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PLED_")}, "PLED_SOCKET": pled.socket}
    r = subprocess.run([str(VLLM_PYTHON), str(HERE / "safe_open_check.py"), str(files[1]), str(other)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["patched"] and out["held_type"] == "PledSafeOpen" and out["other_type"] != "PledSafeOpen"
    assert out["zero_copy"] and out["equal"] and out["slice_equal"]
    assert out["metadata"] == {"format": "pt"}
    # A held file changed after staging: refused, naming the file, without a fallback.
    os.utime(files[1], ns=(time.time_ns(), time.time_ns()))
    r = subprocess.run([str(VLLM_PYTHON), str(HERE / "safe_open_check.py"), str(files[1]), str(other)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0
    assert f"{files[1]} changed since pled staged it into table model (modified, at the same size)" in r.stderr
    # Grown, then shrunk: the refusal gives the size it has and the size pled staged.
    staged = files[1].stat().st_size
    data = files[1].read_bytes()
    for size in (staged + 8, staged - 8):
        files[1].write_bytes(data + b" " * 8 if size > staged else data[:size])
        r = subprocess.run([str(VLLM_PYTHON), str(HERE / "safe_open_check.py"), str(files[1]), str(other)],
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode != 0
        assert f"{files[1]} changed since pled staged it into table model (size {size}, was {staged})" in r.stderr


@pytest.mark.parametrize("enabled_by", ["PLED_SOCKET", "--additional-config"])
def test_vllm_plugins_leaving_pled_out_turns_pled_off(model, tmp_path, enabled_by):
    """vLLM's allow-list wins over either way of enabling pled: with VLLM_PLUGINS naming another plugin, vLLM
    reads the model from disk, and each process that loads it says once why pled is off. The socket is dead:
    had pled been on, the load would have failed (no fallback)."""
    dead = str(tmp_path / "nothing-here.sock")
    env = {"VLLM_PLUGINS": "some_other_plugin"}
    if enabled_by == "PLED_SOCKET":
        r = generate(model, env=env | {"PLED_SOCKET": dead})
    else:
        r = generate(model, env=env, additional={"pled": {"socket": dead}})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(tokens(r.stdout)) == 2
    said = [line for line in (r.stdout + r.stderr).splitlines()
            if "VLLM_PLUGINS='some_other_plugin' leaves pled out" in line]
    pids = [line.split("(pid ")[1].split(")")[0] for line in said]
    assert pids and len(pids) == len(set(pids)), said  # once per process that loaded a table
    assert all((enabled_by if enabled_by == "PLED_SOCKET" else "--additional-config's pled socket") in line
               for line in said)
    assert "cannot attach" not in r.stdout + r.stderr
