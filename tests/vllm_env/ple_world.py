"""Real gloo worlds of vLLM 0.33 processes building PLE tables (ple_rank.py), for tests/test_vllm_033_ple.py and the
benchmark's section on vLLM 0.33's own PLE path (bench/ple033.py)."""
import json
import os
import socket
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_033 = ROOT / ".cache" / "vllm-0.33.0"
RANK = Path(__file__).parent / "ple_rank.py"


def vllm_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLED_", "VLLM_"))}
    return env | {"OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)} | extra


def sizes(text: dict, layers: list[int]) -> dict[int, int]:
    """Each layer's padded rows, as vLLM 0.33 computes them from ``text`` (a Qwen4ExpTextConfig's keys)."""
    r = subprocess.run([str(VLLM_PYTHON), str(RANK), "sizes", json.dumps(text), json.dumps(layers), str(VLLM_033)],
                       capture_output=True, text=True, env=vllm_env(), timeout=300, cwd="/")
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    return {int(k): v for k, v in json.loads(r.stdout.split("PLED-RESULT ")[1]).items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, text: dict, cases: list[dict], env: dict | None = None,
              load_plugins: bool = True) -> list[dict]:
    """One process per rank, all at once (gloo needs every rank); each rank's report."""
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    for rank in range(world):
        spec = {"rank": rank, "world": world, "init": init, "vllm_path": str(VLLM_033), "text": text,
                "cases": cases, "load_plugins": load_plugins}
        procs.append(subprocess.Popen([str(VLLM_PYTHON), str(RANK), json.dumps(spec)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=vllm_env(**(env or {})), cwd="/"))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=1200)
        if p.returncode != 0:
            raise RuntimeError(f"rank exited {p.returncode}:\n{stdout[-3000:]}{stderr[-5000:]}")
        report = json.loads(stdout.split("PLED-RESULT ")[1])
        report["stderr"] = stderr
        out.append(report)
    return out
