"""A Hugging Face hub cache as `huggingface_hub` lays it out (issue 48 class 5): the layout operators really have.

    <cache>/models--<org>--<name>/
        blobs/<sha256 of the file>           # LFS files (.safetensors): named by their sha256
        blobs/<git blob sha1 of the file>    # small files (config, index): by git's blob hash
        refs/main                            # the revision the snapshot is of
        snapshots/<revision>/<file name>     # -> ../../blobs/<hash>: relative symbolic links, one per file

``snapshot(files_dir, cache)`` moves every file of ``files_dir`` into that layout and returns the snapshot directory:
the path an operator (or vLLM, resolving a model name) hands on. Its entries are links, not copies: the real path
of each is its blob."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

LFS = (".safetensors", ".bin", ".pt")


def blob_name(path: Path) -> str:
    data = path.read_bytes()
    if path.name.endswith(LFS):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324 (git's blob name, not security)


def snapshot(files_dir: Path, cache: Path, repo: str = "pled-tests/qwen4-exp-tiny",
             revision: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    org, name = repo.split("/")
    top = Path(cache) / f"models--{org}--{name}"
    blobs, snap = top / "blobs", top / "snapshots" / revision
    blobs.mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    (top / "refs").mkdir(exist_ok=True)
    (top / "refs" / "main").write_text(revision)
    for f in sorted(Path(files_dir).iterdir()):
        blob = blobs / blob_name(f)
        shutil.move(str(f), str(blob))
        os.symlink(os.path.join("..", "..", "blobs", blob.name), snap / f.name)
    Path(files_dir).rmdir()
    return snap


def in_layout(layout: str, directory: Path) -> Path:
    """``directory`` as it is ("plain"), or its files moved into a hub cache beside it ("hf-snapshot"): the
    directory to point pled and the readers at."""
    if layout == "plain":
        return Path(directory)
    return snapshot(Path(directory), Path(directory).parent / f"{Path(directory).name}-hub")
