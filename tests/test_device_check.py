"""The device check (bench/device/check.py, `make device-check`) on this machine, which has no GPU: it exits 0
saying so in one line and in its JSON; its run call for the device tool fits the tool's limits; the kernels it
carries from vLLM 0.33.0 name their source and licence, are vLLM's text, and compute what pled's reference says
(run by Triton's CPU interpreter); the decoders they use read the bytes as pled's numpy reference does.

Nothing here touches a GPU: what the check measures there is untested until it runs on one.
"""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.device import check as device_check, lookup as device_lookup
from pled.shared import dequant

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "bench" / "ple_kernels.py"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_033 = ROOT / ".cache" / "vllm-0.33.0" / "vllm"
CARRIED = {  # the function, and the vLLM 0.33.0 file it comes from
    "_e2m1_inline": "model_executor/layers/quantization/utils/nvfp4_emulation_utils.py",
    "_e4m3_inline": "model_executor/layers/quantization/utils/nvfp4_emulation_utils.py",
    "_lookup_nvfp4_ple_embedding_kernel": "models/qwen4_exp/common/ngram_embedding.py",
    "_lookup_ple_embedding_from_pinned_kernel": "models/qwen4_exp/common/ngram_embedding.py",
}


def test_without_cuda_it_says_so_and_exits_0(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}  # the device tool's variable: the JSON goes there
    done = subprocess.run([sys.executable, "-m", "bench.device.check"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("device check: no CUDA: "), done.stdout
    result = json.loads((tmp_path / "device_check.json").read_text())
    assert result["cuda"] is False and result["reason"].startswith("no CUDA: ")
    assert "pages" not in result and result["errors"] == []


def test_the_run_call_fits_the_device_tool():
    done = subprocess.run([sys.executable, "-m", "bench.device.check", "--plan"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    run, travel = plan["run"], plan["travel"]
    assert run == device_check.RUN and len(run["command"]) <= 2000 and len(run["carry"]) <= 8
    assert run["timeout_s"] <= 600 and "-m bench.device.check" in run["command"]
    assert travel["total"] < travel["limit"] == 64 << 20
    assert travel["tracked"] > 0 and set(travel["carried"]) == {".whl"}


def test_the_makefile_documents_the_same_run_call():
    """The Makefile's comment gives the command over several lines; joined, it is the one --plan prints."""
    text = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(text) if "run(carry=" in line)
    assert '[".whl"]' in text[start] and f"timeout_s={device_check.RUN['timeout_s']}" in text[start]
    parts = []
    for line in text[start + 1:]:
        if not line.startswith("#     "):
            break
        parts.append(line[len("#     "):].strip())
    assert " ".join(parts).removesuffix(")") == device_check.COMMAND


def test_the_carried_kernels_name_their_source_and_licence():
    text = KERNELS.read_text()
    head = text[:text.index('"""', text.index('"""') + 3)]
    assert text.startswith("# SPDX-License-Identifier: Apache-2.0\n")
    assert "Copyright contributors to the vLLM project" in text.splitlines()[1]
    assert "vLLM 0.33.0" in head and "Apache" in head and "License 2.0" in head
    for name, source in CARRIED.items():
        assert f"vllm/{source}" in head and name in head
        assert f"def {name}(" in text


def _functions(path: Path) -> dict[str, str]:
    """Each top-level function's source, decorators included."""
    text = path.read_text()
    tree = ast.parse(text)
    lines = text.splitlines()
    return {f.name: "\n".join(lines[f.decorator_list[0].lineno - 1 if f.decorator_list else f.lineno - 1:f.end_lineno])
            for f in tree.body if isinstance(f, ast.FunctionDef)}


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_033.exists(), reason="vLLM 0.33.0's sources are not unpacked: `make vllm-env`")
def test_the_carried_kernels_are_vllm_0_33s_text():
    carried = _functions(KERNELS)
    for name, source in CARRIED.items():
        assert carried[name] == _functions(VLLM_033 / source)[name], f"{name} differs from vllm/{source}"


@pytest.mark.vllm
@pytest.mark.slow
def test_the_carried_kernels_compute_pleds_reference_in_tritons_interpreter():
    """Triton's CPU interpreter runs the carried kernels (nvfp4 into float32 and bf16, raw rows) over a rank's
    rows, with every e4m3 scale code and ids outside the rank; float32 is pled's reference bit for bit."""
    done = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_env" / "carried_kernels.py")], cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["float32"]["equal"] and out["float32"]["bitwise_equal_except_nan"] and out["float32"]["nans"]
    assert out["bfloat16"]["nans_match"] and out["bfloat16"]["max_ulp"] <= 1  # the interpreter truncates
    assert out["rows"]["equal"] and 0 < out["owned"] < 400


# -- the decoders, bit by bit, in numpy: vLLM's _e2m1_inline / _e4m3_inline against pled's tables ----------------

def _e2m1_as_vllm(nibble: np.ndarray) -> np.ndarray:
    """vLLM 0.33's _e2m1_inline, line for line in numpy."""
    magnitude, sign = nibble & 0x07, (nibble >> 3) & 1
    val = (0x3F000000 + (magnitude.astype(np.int32) << 22)).astype(np.int32).view(np.float32)
    val = np.where(magnitude == 0, np.float32(0.0), val)
    val = np.where(magnitude == 1, np.float32(0.5), val)
    return np.where(sign == 1, -val, val).astype(np.float32)


def _e4m3_as_vllm(byte: np.ndarray) -> np.ndarray:
    """vLLM 0.33's _e4m3_inline, line for line in numpy (float32 throughout, as Triton computes it)."""
    bits = byte.astype(np.int32)
    exponent, mantissa = (bits >> 3) & 0xF, (bits & 0x7).astype(np.float32)
    normal = (np.float32(1.0) + mantissa * np.float32(0.125)) * np.exp2((exponent - 7).astype(np.float32))
    val = np.where(exponent == 0, mantissa * np.float32(0.001953125), normal)
    val = np.where((bits & 0x7F) == 0x7F, np.float32("nan"), val)
    return np.where((bits & 0x80) != 0, -val, val).astype(np.float32)


def test_vllms_decoders_read_every_code_as_pleds_reference():
    e2m1 = _e2m1_as_vllm(np.arange(16, dtype=np.uint8))
    assert np.array_equal(e2m1.view(np.uint32), dequant.E2M1_LUT.view(np.uint32))  # -0.0 for code 8 too
    e4m3 = _e4m3_as_vllm(np.arange(256, dtype=np.uint8))
    nan = np.isnan(dequant.E4M3_LUT)
    assert np.array_equal(np.isnan(e4m3), nan) and nan.sum() == 2
    assert np.array_equal(e4m3[~nan].view(np.uint32), dequant.E4M3_LUT[~nan].view(np.uint32))


def test_vllms_nvfp4_lookup_layout_is_pleds_reference():
    """The nvfp4 kernel's indexing (the low nibble the even element, one e4m3 scale per 16 elements, the global
    scale, zero rows outside the rank), written out in numpy over the whole table, equals the reference the device
    check holds the GPU to (bench/device/lookup.py, pled's dequantizer)."""
    rng = np.random.default_rng(5)
    rows, width, lo, hi = 300, 64, 100, 200
    weight = rng.integers(0, 256, (rows, width // 2), dtype=np.uint8)
    scale = rng.integers(0, 256, (rows, width // 16), dtype=np.uint8)
    ids = device_lookup.check_ids(rows, lo, hi, 500, seed=6)
    g = np.float32(0.0041)
    offsets = np.arange(width)
    owned = (ids >= lo) & (ids < hi)
    local = np.where(owned, ids, 0)  # the kernel reads row idx - lo of the rank's view: row idx of the table
    packed = np.where(owned[:, None], weight[local][:, offsets // 2], 0)
    codes = (packed >> ((offsets % 2) * 4)) & 0xF
    scales = _e4m3_as_vllm(np.where(owned[:, None], scale[local][:, offsets // 16], 0))
    kernel = _e2m1_as_vllm(codes) * scales * g
    want = device_lookup.reference_nvfp4(weight, scale, float(g), ids, lo, hi)
    assert device_lookup.f32_compare(kernel, want) | {"max_abs_diff": 0.0} == {
        "equal": True, "bitwise_equal_except_nan": True, "nans": int(np.isnan(want).sum()), "max_abs_diff": 0.0}
