"""Every parser of untrusted bytes in pled, as one table (issue 32): what it reads, its size limit, the errors it
documents, and its worst inputs of any size. tests/test_linear_parsers.py holds each to its properties (any input
ends accepted or refused with a documented error; time linear in the size, against json.loads of the same bytes
where it is JSON); tools/fuzz.py fuzzes each, coverage-guided, from the seeds in tests/fuzz_corpus/<name>/.

A worst input is a function of a size in bytes: the shapes a helper attacking as a group member found (text of
escaped quotes, brackets, shapes of many large extents, dotted keys) and the shapes that cost each parser most per
byte (many small objects, many numbers). ``valid`` marks those that are well-formed JSON (a ratio against json.loads
means something there: json.loads refuses most hostile text at its first byte).
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pled.daemon import config
from pled.daemon.memory import hostmem, numa
from pled.daemon.sources import checkpoint, safetensors_file, sidecar, sidecar_meta
from pled.shared import boundary, protocol, region
from pled.shared.errors import PledError

CORPUS = Path(__file__).resolve().parent / "fuzz_corpus"
HEX64 = "ab" * 32


@dataclass(frozen=True)
class Parser:
    name: str
    parse: Callable[[bytes], object]
    limit: int  # bytes: what pled reads at most
    errors: tuple[type[BaseException], ...]  # what a refusal raises (its documented error)
    json: bool  # JSON text: the baseline is json.loads of the same bytes
    worst: dict[str, Callable[[int], bytes]] = field(default_factory=dict)  # shape -> (size -> input)
    valid: frozenset[str] = frozenset()  # the worst shapes that are well-formed JSON


def _quotes(n: int) -> bytes:
    """What froze pled for 16 s: escaped quotes, here inside a string (valid JSON), about n bytes."""
    return b'"' + b'\\"' * max(0, (n - 2) // 2) + b'"'


def _raw_quotes(n: int) -> bytes:
    return b'\\"' * (n // 2)


def _brackets(n: int) -> bytes:
    return b"[" + b"[]," * max(0, (n - 4) // 3) + b"[]]"


def _strings_with_brackets(n: int) -> bytes:
    return b"[" + b",".join([b'"[{"'] * max(1, n // 5)) + b"]"


def _numbers(n: int) -> bytes:
    return b"[" + b",".join([b"12345678901234567890"] * max(1, n // 21)) + b"]"


def _objects(n: int) -> bytes:
    return b"[" + b",".join([b'{"a":0}'] * max(1, n // 8)) + b"]"


def _in(prefix: bytes, suffix: bytes, value: Callable[[int], bytes]) -> Callable[[int], bytes]:
    return lambda n: prefix + value(max(2, n - len(prefix) - len(suffix))) + suffix


def _call(raw: bytes) -> object:
    return protocol.parse_call(raw)


def _reply(raw: bytes) -> object:
    return boundary.load_json(raw, max_bytes=protocol.MAX_REPLY, max_values=protocol.MAX_REPLY_VALUES)


def _header(raw: bytes) -> object:
    """The header, and each of its names as a checkpoint reads them (a PLE tensor's shard number)."""
    header = safetensors_file.parse_header("shard_0.safetensors", 8 + len(raw), raw)
    return header, [checkpoint.ple_name(t.name, header.path) for t in header.tensors]


def _header_tensors(n: int) -> bytes:
    entries, offset = [], 0
    for i in range(max(1, n // 60)):
        entries.append(f'"t{i}":{{"dtype":"U8","shape":[1],"data_offsets":[{offset},{offset + 1}]}}')
        offset += 1
    return ("{" + ",".join(entries) + "}").encode()


def _header_shape(n: int) -> bytes:
    """Finding 4: a shape of many extents of 10**19 and a 0 (a valid empty tensor, were the rank not capped)."""
    dims = ",".join(["10000000000000000000"] * max(1, n // 21) + ["0"])
    return f'{{"w":{{"dtype":"U8","shape":[{dims}],"data_offsets":[0,0]}}}}'.encode()


def _meta(raw: bytes) -> object:
    meta = boundary.load_json(raw, max_bytes=sidecar.MAX_META, max_values=sidecar.MAX_META // 8)
    if not isinstance(meta, dict):
        raise PledError("not an object")
    sidecar_meta.check("META.json", meta, "ples_int4", 2, 128, 160)
    return meta


def _index(raw: bytes) -> object:
    """The checkpoint's own index parser: the JSON within bounds, then its weight_map's names and file names."""
    return checkpoint.parse_index("model.safetensors.index.json", raw)


def _index_names(n: int) -> bytes:
    """An index of PLE shard names (each parsed for its shard number), as many as fit in about n bytes."""
    prefix = "model.language_model.layers.0.ple.ple_embedding.ngram_embedding.shard_"
    names = {f"{prefix}{i}.weight": "model-00001-of-00001.safetensors" for i in range(max(1, n // 110))}
    return json.dumps({"weight_map": names}, separators=(",", ":")).encode()


def _manifest(raw: bytes) -> object:
    return region.Manifest.from_json(raw)


def _manifest_tensors(n: int) -> bytes:
    shard = {"index": 0, "path": "/s", "size": 0, "mtime_ns": 1, "dev": 2, "ino": 3, "fingerprint": HEX64,
             "offset": region.ALIGN, "rows": 0, "digest": ""}
    tensors = [{"name": f"t{i}", "shard": 0, "dtype": "U8", "shape": [0], "offset": region.ALIGN, "nbytes": 0}
               for i in range(max(1, n // 80))]
    return json.dumps({"table": "t", "layout": "safetensors", "rows": 0, "row_width": 0, "data_offset": region.ALIGN,
                       "region_bytes": 2 * region.ALIGN, "fingerprint": HEX64, "shards": [shard],
                       "tensors": tensors, "format": 1}, separators=(",", ":")).encode()


def _sums(raw: bytes) -> object:
    return sidecar.parse_sums("B3SUMS", "blake3", raw)


def _sums_lines(n: int) -> bytes:
    return b"".join(f"{HEX64}  shard_{i}.safetensors\n".encode() for i in range(max(1, n // 90)))


def _config(raw: bytes) -> object:
    return config.parse(raw.decode("utf-8", "replace"), "/etc/pled/pled.toml")


def _kernel(raw: bytes) -> object:
    """The /proc and /sys readers, on a fixture root holding ``raw`` as each file they read."""
    with tempfile.TemporaryDirectory() as root:
        for rel in ("proc/meminfo", "proc/self/cgroup", "proc/self/mountinfo"):
            os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
            with open(os.path.join(root, rel), "wb") as f:
                f.write(raw)
        text = raw.decode("ascii", "replace")
        return hostmem.read_meminfo(root), hostmem.read_cgroup(root), _nodelist(text)


def _nodelist(text: str) -> object:
    try:
        return numa.parse_nodelist(text)
    except ValueError:
        return None


def _meminfo_lines(n: int) -> bytes:
    return b"".join(b"MemTotal: %d kB\n" % i for i in range(max(1, n // 24))) + b"MemFree: 1 kB\n"


JSON_WORST = {"escaped quotes": _quotes, "escaped quotes outside strings": _raw_quotes, "brackets": _brackets,
              "strings of brackets": _strings_with_brackets, "20-digit numbers": _numbers, "objects": _objects}
JSON_VALID = frozenset({"escaped quotes", "brackets", "strings of brackets", "20-digit numbers", "objects"})

PARSERS = {p.name: p for p in [
    Parser("call", _call, protocol.MAX_CALL, (ValueError,), True,
           {"escaped quotes": _in(b'{"method":"io.pled.Ping","parameters":{"a":', b"}}", _quotes),
            "escaped quotes outside strings": _raw_quotes,
            "brackets": _in(b'{"method":"io.pled.Ping","parameters":{"a":', b"}}", _brackets),
            "objects": _in(b'{"method":"io.pled.Ping","parameters":{"a":', b"}}", _objects)},
           frozenset({"escaped quotes", "brackets", "objects"})),
    Parser("reply", _reply, protocol.MAX_REPLY, (boundary.BoundaryError,), True, JSON_WORST, JSON_VALID),
    Parser("manifest", _manifest, region.MAX_MANIFEST, (ValueError,), True,
           {**JSON_WORST, "escaped quotes in the table's name": _in(b'{"table":', b"}", _quotes),
            "tensors": _manifest_tensors}, JSON_VALID | {"escaped quotes in the table's name", "tensors"}),
    Parser("header", _header, safetensors_file.MAX_HEADER, (PledError,), True,
           {**JSON_WORST, "shape of many extents": _header_shape, "tensors": _header_tensors},
           JSON_VALID | {"shape of many extents", "tensors"}),
    Parser("meta", _meta, sidecar.MAX_META, (PledError, boundary.BoundaryError), True,
           {**JSON_WORST, "escaped quotes in layout": _in(b'{"layout":', b"}", _quotes)},
           JSON_VALID | {"escaped quotes in layout"}),
    Parser("index", _index, checkpoint.MAX_INDEX, (PledError,), True,
           {**JSON_WORST, "PLE names": _index_names}, JSON_VALID | {"PLE names"}),
    Parser("sums", _sums, sidecar.MAX_SUMS, (PledError,), False,
           {"lines": _sums_lines, "one long line": lambda n: b"a" * n, "spaces": lambda n: b" " * n}),
    Parser("config", _config, 1 << 20, (PledError,), False,
           {"dotted key": lambda n: b"a" + b".a" * (n // 2) + b" = 1\n",
            "dotted table": lambda n: b"[" + b"a." * (n // 2) + b"a]\n",
            "escaped quotes": lambda n: b'a = "' + b'\\"' * (n // 2) + b'"\n',
            "escaped quotes on lines": lambda n: b'a = """' + b'\\"\\"\\"\n' * (n // 7) + b'"""\n',
            "array on lines": lambda n: b"a = [\n" + b"1,\n" * (n // 3) + b"]\n",
            "tables": lambda n: b"".join(b"[t%d]\n" % i for i in range(n // 8)),
            "array": lambda n: b"a = [" + b"1," * (n // 2) + b"]\n",
            "digits": lambda n: b"a = " + b"1" * n + b"\n"}),
    Parser("kernel", _kernel, hostmem.MAX_TEXT, (hostmem.HostInfoUnavailable,), False,
           {"meminfo lines": _meminfo_lines, "one long line": lambda n: b"1" * n,
            "node ranges": lambda n: b",".join([b"0-1023"] * (n // 7))}),
]}


def corpus(name: str) -> list[bytes]:
    """The seeds kept for parser ``name`` (tests/fuzz_corpus/<name>/): small forms of its worst shapes and
    ordinary inputs."""
    d = CORPUS / name
    return [p.read_bytes() for p in sorted(d.iterdir())] if d.is_dir() else []


def write_corpus() -> None:
    """(Re)write the seeds: each worst shape at 4 KiB, and an ordinary input of each parser."""
    ordinary = {
        "call": [protocol.call(protocol.ATTACH, table="ples_int4")[:-1]],
        "reply": [b'{"parameters":{"table":"t","generation":1}}'],
        "manifest": [_manifest_tensors(400)],
        "header": [_header_tensors(400)],
        "meta": [b'{"layout":"group16_int4_fp16scale_lownibblefirst","shards":2,"rows":128,"width":160}'],
        "index": [b'{"metadata":{"total_size":1},"weight_map":{"a":"model-00001-of-00002.safetensors"}}',
                  *(json.dumps({"weight_map": {f"m.ple.ple_embedding.ngram_embedding.shard_{n}.weight": f}}).encode()
                    for n, f in (("1000000000", "model-00001-of-00001.safetensors"),
                                 ("\u00b2", "model-00001-of-00001.safetensors"),
                                 ("0", "\ud800.safetensors"), ("\u0661", "a.safetensors")))],
        "sums": [_sums_lines(200)],
        "config": [b'socket = "/run/pled/pled.sock"\n[[table]]\nname = "t"\npath = "/srv/t"\n'],
        "kernel": [b"MemTotal: 100 kB\nMemFree: 50 kB\nMemAvailable: 70 kB\n0-3,5\n"],
    }
    for name, parser in PARSERS.items():
        d = CORPUS / name
        d.mkdir(parents=True, exist_ok=True)
        for i, seed in enumerate(ordinary[name]):
            (d / f"ordinary-{i}").write_bytes(seed)
        for shape, make in parser.worst.items():
            (d / ("worst-" + shape.replace(" ", "-").replace("'", ""))).write_bytes(make(4096))


if __name__ == "__main__":
    write_corpus()
