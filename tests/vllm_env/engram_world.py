"""Real gloo worlds of vLLM 0.33 processes building DeepSeek V4.1 Engram tables (engram_rank.py), DP x TP, for
tests/test_vllm_033_engram.py and the benchmark (bench/engram033.py)."""
import json
import subprocess
from pathlib import Path

try:
    from vllm_env.ple_world import VLLM_033, VLLM_PYTHON, free_port, vllm_env
except ImportError:  # imported as tests.vllm_env.engram_world (the benchmark)
    from tests.vllm_env.ple_world import VLLM_033, VLLM_PYTHON, free_port, vllm_env

RANK = Path(__file__).parent / "engram_rank.py"


def run_world(dp: int, tp: int, checkpoint: str, cases: list[dict], env: dict | None = None,
              load_plugins: bool = True, prefix: list[str] | None = None, timeout: float = 1200,
              hang_seconds: float = 900) -> list[dict]:
    """One process per rank (DP x TP), all at once (gloo needs every rank), each started through ``prefix`` (a
    command that runs its arguments: a mount namespace, a cgroup) where given; each rank's report."""
    init, dp_port = f"tcp://127.0.0.1:{free_port()}", free_port()
    procs = []
    for rank in range(dp * tp):
        spec = {"rank": rank, "dp": dp, "tp": tp, "init": init, "dp_port": dp_port, "vllm_path": str(VLLM_033),
                "checkpoint": checkpoint, "cases": cases, "load_plugins": load_plugins,
                "hang_seconds": hang_seconds}
        cmd = [*(prefix or []), str(VLLM_PYTHON), str(RANK), json.dumps(spec)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=vllm_env(**(env or {})), cwd="/"))
    out = []
    failed = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        if p.returncode != 0 or "PLED-RESULT " not in stdout:
            failed.append(f"rank exited {p.returncode}:\n{stdout[-3000:]}{stderr[-5000:]}")
            continue
        report = json.loads(stdout.split("PLED-RESULT ")[1])
        report["stderr"] = stderr
        out.append(report)
    if failed:
        raise RuntimeError("\n".join(failed))
    return out
