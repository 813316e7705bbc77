"""The commands that make test tables (issue 47, item 5): `pled make-checkpoint` writes what
pled.generator.make_checkpoint writes, byte for byte, for the same options and seed; `--help` of make-sidecar and
make-checkpoint names every option and its default; arguments it cannot use are one line and exit 64."""
import argparse
import filecmp
import os
import re

import pytest

from harness import run_pled
from pled import cli, generator


def files_of(d) -> dict[str, bytes]:
    return {name: open(os.path.join(d, name), "rb").read() for name in sorted(os.listdir(d))}


@pytest.mark.parametrize(("argv", "kwargs"), [
    ([], {}),
    (["--dtype", "fp8", "--rows", "300,17,5", "--width", "48", "--parts", "4", "--files", "2", "--seed", "9"],
     {"dtype": "fp8", "rows": {0: 300, 1: 17, 2: 5}, "width": 48, "parts": 4, "files": 2, "seed": 9}),
    (["--dtype", "bf16", "--no-index"], {"dtype": "bf16", "index": False}),
])
def test_make_checkpoint_writes_what_the_library_writes(tmp_path, argv, kwargs):
    r = run_pled("make-checkpoint", tmp_path / "cli", *argv)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith(f"wrote {kwargs.get('files', 3)} checkpoint file(s)"), r.stdout
    generator.make_checkpoint(str(tmp_path / "lib"), **kwargs)
    assert files_of(tmp_path / "cli") == files_of(tmp_path / "lib")
    assert ("model.safetensors.index.json" in os.listdir(tmp_path / "cli")) == kwargs.get("index", True)
    # what it wrote is a checkpoint pled takes
    inspected = run_pled("inspect", "--checkpoint", tmp_path / "cli")
    assert inspected.returncode == 0, inspected.stderr


def test_make_checkpoint_is_deterministic_and_its_seed_matters(tmp_path):
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        assert run_pled("make-checkpoint", tmp_path / name, "--seed", seed).returncode == 0
    names = sorted(os.listdir(tmp_path / "a"))
    assert filecmp.cmpfiles(tmp_path / "a", tmp_path / "b", names, shallow=False)[0] == names
    assert files_of(tmp_path / "a") != files_of(tmp_path / "c")


@pytest.mark.parametrize("argv", [["--rows", "3,x"], ["--rows", "0"], ["--width", "8"], ["--parts", "0"],
                                  ["--files", "0"], ["--dtype", "bf16", "--width", "0"]])
def test_make_checkpoint_refuses_what_it_cannot_use_in_one_line(tmp_path, argv):
    r = run_pled("make-checkpoint", tmp_path / "x", *argv)
    assert r.returncode == 64 and len(r.stderr.splitlines()) == 1, (r.returncode, r.stderr)
    assert r.stderr.startswith(f"pled make-checkpoint: {argv[-2]} "), r.stderr
    assert not (tmp_path / "x").exists()


def subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["make-sidecar", "make-checkpoint"])
def test_help_names_every_option_and_its_default(command):
    text = run_pled(command, "--help").stdout
    options = [a for a in subparser(command)._actions if a.option_strings and a.dest != "help"]
    assert options
    flat = re.sub(r"\s+", " ", text)
    for a in options:
        flag = a.option_strings[-1]
        shown = re.search(rf"{re.escape(flag)}( [A-Z_]+| \{{[^}}]*\}})? (.*?)(?= --|\Z)", flat[flat.index("options:"):])
        assert shown and "default" in shown.group(2), (flag, flat)
        if a.default not in (None, False):
            assert f"default {a.default}" in shown.group(2), (flag, shown.group(2))


def test_the_commands_dtypes_are_the_generators():
    assert cli.CHECKPOINT_DTYPES == generator.CHECKPOINT_DTYPES
