import os
import subprocess
import sys
from pathlib import Path

import pytest

from pled.generator import make_sidecar

LAYOUTS = ["ples_fp8", "ples_int4", "ples_nvfp4"]


@pytest.fixture
def sidecar(tmp_path):
    """make(layout, shards, rows) -> the directory of a fresh synthetic sidecar."""

    def make(layout="ples_int4", shards=4, rows=256, **kw) -> Path:
        d = tmp_path / f"{layout}-{shards}x{rows}"
        make_sidecar(str(d), layout, shards=shards, rows=rows, **kw)
        return d

    return make


def run_pled(*args, env=None, timeout=60, **kw) -> subprocess.CompletedProcess:
    """The real CLI in a real process."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("NOTIFY_SOCKET", None)
    full_env.pop("JOURNAL_STREAM", None)
    return subprocess.run([sys.executable, "-m", "pled", *map(str, args)], capture_output=True, text=True,
                          env=full_env, timeout=timeout, **kw)


def write_config(path: Path, tables: dict[str, Path | str], **keys) -> Path:
    lines = [f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v}" for k, v in keys.items()]
    for name, p in tables.items():
        lines += ["[[table]]", f'name = "{name}"', f'path = "{p}"']
    path.write_text("\n".join(lines).replace("'", '"') + "\n")
    return path
