"""The fifth attack on `pled make-checkpoint`: sizes at the bounds are refused in one line (exit 64) before anything
is drawn or written. Found: `--rows 99999999999999` ended in numpy's MemoryError traceback (exit 1); `--parts
1000000000` and `--kind engram --engram-vocab 99999999999` ran on (the latter filling the disk a million rows at a
time) until killed. Real `pled` processes on the tests' file system."""
import pytest

from harness import run_pled


@pytest.mark.parametrize("args, named", [
    (["--rows", "99999999999999"], "--rows 99999999999999"),
    (["--rows", "1", "--parts", "1000000000"], "--parts 1000000000"),
    (["--kind", "engram", "--engram-vocab", "99999999999"], "--engram-vocab 99999999999"),
    (["--kind", "engram", "--engram-vocab", "9" * 30], "--engram-vocab " + "9" * 30),
])
def test_a_checkpoint_too_large_to_write_is_refused_in_one_line_before_anything_is_written(tmp_path, args, named):
    target = tmp_path / "ck" / "sub"
    r = run_pled("make-checkpoint", str(target), *args, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 64 and len(lines) == 1 and named in lines[0], (r.returncode, r.stderr[-2000:])
    assert not (tmp_path / "ck").exists(), f"{sorted(p.name for p in (tmp_path / 'ck').rglob('*'))} written"


def test_a_small_checkpoint_is_still_written(tmp_path):
    for args in (["--rows", "5,6"], ["--kind", "engram"]):
        target = tmp_path / args[-1]
        r = run_pled("make-checkpoint", str(target), *args)
        assert r.returncode == 0 and any(target.glob("*.safetensors")), r.stderr
