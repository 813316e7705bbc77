"""A table's file names: which ``.safetensors`` files a table path names, in what order, and whether their
numbers run without a gap (``shard_N``, ``model-0000K-of-0000M``). Names are read from the end with str methods,
in time linear in their length; no digit run goes through int() unless it is short enough to be a count."""
from __future__ import annotations

import glob
import os
import re

from pled.shared.errors import SidecarError

SUFFIX = ".safetensors"


def _trailing_number(stem: str) -> tuple[str, str]:
    """(what comes before, the run of decimal digits that ends ``stem``), from the end in one pass."""
    i = len(stem)
    while i and stem[i - 1].isdecimal():  # what \d matches in a str pattern
        i -= 1
    if len(stem[i:].lstrip("0")) > 18:  # no shard count or number has so many digits (and int() refuses 4,300)
        return stem, ""
    return stem[:i], stem[i:]


def numbered(name: str) -> tuple[str, int] | None:
    r"""(prefix, n) of ``<prefix><n>.safetensors`` (shard_12.safetensors: ("shard_", 12)), else None. Read from the
    end with str methods: a pattern with a lazy prefix (``^(.*?)(\d+)\.safetensors$``) took time that grew with the
    square of a name's digits (1.7 ms for one name of 240), and a directory may hold any number of names."""
    if not name.endswith(SUFFIX):
        return None
    prefix, digits = _trailing_number(name[:-len(SUFFIX)])
    return (prefix, int(digits)) if digits else None


def numbered_of(name: str) -> tuple[str, int, int] | None:
    """(prefix, n, total) of ``<prefix>-<n>-of-<total>.safetensors`` (model-00002-of-00004.safetensors), else
    None; as ``numbered``, from the end."""
    if not name.endswith(SUFFIX):
        return None
    rest, total = _trailing_number(name[:-len(SUFFIX)])
    if not total or not rest.endswith("-of-"):
        return None
    rest, n = _trailing_number(rest[:-len("-of-")])
    if not n or not rest.endswith("-"):
        return None
    return rest[:-1], int(n), int(total)


def odd_one_out(values: list) -> tuple[int, int] | None:
    """(the index of the first of ``values`` that differs from the value most of them share (on a tie, the value
    seen first), the index of the first that has that value), None when all agree: the shard a refusal names is the
    one that disagrees with the table's others, not whichever came after the first (issue 48: a table's first shard
    of another dtype named its second). Linear."""
    counts: dict = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    if len(counts) <= 1:
        return None
    common = max(counts, key=counts.__getitem__)  # the first of the most common, in the order first seen
    return next(i for i, v in enumerate(values) if v != common), next(i for i, v in enumerate(values) if v == common)


def natural_key(name: str) -> list:
    """shard_2 before shard_10: runs of ASCII digits compared as numbers (by length without leading zeros, then
    text: no int() of a run however long), everything else as text."""
    parts: list = re.split(r"(\d+)", name, flags=re.ASCII)
    for i in range(1, len(parts), 2):
        digits = parts[i].lstrip("0")
        parts[i] = (len(digits), digits)
    return parts


def find_files(source: str, numbering: bool = True) -> list[str]:
    """The .safetensors files a table path names, in numeric order; with ``numbering``, a gap in their numbers
    refused (a sidecar's, or a glob's; a checkpoint's files are whatever holds its PLE tensors)."""
    if "\0" in source:
        raise SidecarError(source, "the table's path contains a NUL byte")
    if os.path.isdir(source):
        try:
            names = [n for n in os.listdir(source) if n.endswith(".safetensors")]
        except OSError as err:
            raise SidecarError(source,
                               f"cannot list the directory ({err.strerror or err}); give pled's user access") from err
        if not names:
            raise SidecarError(source, "directory holds no .safetensors files; "
                                       "point the table at a sidecar directory or a glob")
        files = [os.path.join(source, n) for n in names]
    elif glob.has_magic(source):
        files = [f for f in glob.glob(source) if os.path.isfile(f)]
        if not files:
            raise SidecarError(source, "the pattern matches no files; check the table's path")
        not_st = [f for f in files if not f.endswith(".safetensors")]
        if not_st:
            raise SidecarError(not_st[0],
                               "matched by the table's pattern but not a .safetensors file; narrow the pattern")
    elif os.path.exists(source):
        files = [source]
    else:
        raise SidecarError(source, "no such file or directory; check the table's path")
    files.sort(key=lambda f: natural_key(os.path.basename(f)))
    if numbering:
        check_numbering(files)
    return files


def check_numbering(files: list[str]) -> None:
    """Refuse a gap or a duplicate in shard_N or model-0000K-of-0000M numbering."""
    names = [os.path.basename(f) for f in files]
    of = [numbered_of(n) for n in names]
    if all(of) and len({m[0] for m in of if m}) == 1:
        totals = {m[2] for m in of if m}
        if len(totals) != 1:
            raise SidecarError(files[0], f"files disagree on the shard count ({sorted(totals)})")
        (total,) = totals
        _contiguous(files, [m[1] for m in of if m], expect=range(1, total + 1))
        return
    found = [numbered(n) for n in names]
    if all(found) and len({m[0] for m in found if m}) == 1 and len(files) > 1:
        numbers = [m[1] for m in found if m]
        start = min(numbers)
        if start not in (0, 1):
            raise SidecarError(files[0], f"shard numbering starts at {start}; shards before it are missing")
        _contiguous(files, numbers, expect=range(start, start + len(numbers)))


def _contiguous(files: list[str], numbers: list[int], expect: range) -> None:
    seen: dict[int, str] = {}
    for n, f in zip(numbers, files, strict=True):
        if n in seen:
            raise SidecarError(f, f"shard number {n} appears twice (also {os.path.basename(seen[n])})")
        seen[n] = f
    missing = []  # the first few: a name may claim a count of 10**18 (model-00001-of-99999999999999)
    for n in expect:
        if n not in seen:
            missing.append(n)
            if len(missing) > 5:
                break
    if missing:
        directory = os.path.dirname(files[0])
        shown = ", ".join(str(n) for n in missing[:5]) + (" …" if len(missing) > 5 else "")
        raise SidecarError(directory,
                           f"shard numbering has a gap: number {shown} missing of {expect.start}..{expect.stop - 1}")
    if len(seen) != len(expect):
        extra = sorted(n for n in seen if n not in expect)
        raise SidecarError(seen[extra[0]], f"shard number {extra[0]} is outside {expect.start}..{expect.stop - 1}")
