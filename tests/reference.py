"""A sidecar's rows read from its shard files alone, element by element, with struct and the layout table: the
reference the gathers are held against (tests/test_gather.py, tests/test_gather_scratch.py)."""
import json
import math
import struct

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * (man / 8) * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def reference_row(path: str, layout: str, r: int) -> list[float]:
    """Row r of one shard file, read with struct from the file itself."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    base = 8 + n

    def tensor(name):
        begin, end = header[name]["data_offsets"]
        return raw[base + begin : base + end], header[name]["shape"]

    out = []
    if layout == "ples_fp8":
        w, (_, width) = tensor("weight_fp8")
        s, _ = tensor("weight_scale")
        scale = struct.unpack_from("<f", s, 4 * r)[0]
        return [e4m3(w[r * width + c]) * scale for c in range(width)]
    packed_name = "weight_i4" if layout == "ples_int4" else "weight_e2m1"
    w, (_, half) = tensor(packed_name)
    s, (_, blocks) = tensor("weight_scale")
    for c in range(half * 2):
        byte = w[r * half + c // 2]
        code = byte & 0xF if c % 2 == 0 else byte >> 4
        if layout == "ples_int4":
            scale = struct.unpack_from("<e", s, 2 * (r * blocks + c // 16))[0]
            out.append((code - 8) * scale)
        else:
            scale = e4m3(s[r * blocks + c // 16])
            s2 = struct.unpack("<f", tensor("weight_scale_2")[0])[0]
            value = E2M1[code & 7] * (-1 if code & 8 else 1)
            out.append(value * scale * s2)
    return out
