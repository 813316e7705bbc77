"""The quantized PLE sidecar layouts: which tensors a shard holds, their dtypes and shapes.

Shapes are written with two symbols: R, the shard's rows, and W, the row width in
columns of the dequantized table (160 in the shipped sidecars). ``W/2`` is two 4-bit
codes per byte; ``W/16`` one scale per block of 16 columns.

| layout     | dequant of row r, column c                          |
|------------|-----------------------------------------------------|
| ples_fp8   | fp8[r, c] * scale[r]                                |
| ples_int4  | (nibble - 8) * scale[r, c // 16], low nibble first  |
| ples_nvfp4 | lut[code] * scale[r, c // 16] * scale_2             |
"""
from __future__ import annotations

from dataclasses import dataclass

from pled.shared.boundary import clip

# Any other set of tensors is a plain safetensors table (a checkpoint's own files, say).
GENERIC = "safetensors"
# The published sidecars' shape: 128 shards of 2,500,012 rows (320,001,536 in all), width 160. The published
# offload worker hard-codes the rows per shard and asserts shards * PUBLISHED_ROWS_PER_SHARD == rows.
PUBLISHED_ROWS_PER_SHARD = 2_500_012
PUBLISHED_WIDTH = 160
PUBLISHED_SHARDS = 128


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    dims: tuple[str, ...]  # each "R", "W", "W/2" or "W/16"


@dataclass(frozen=True)
class Layout:
    name: str
    tensors: tuple[TensorSpec, ...]  # the first one fixes R and W

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tensors)


LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("ples_fp8", (TensorSpec("weight_fp8", "F8_E4M3", ("R", "W")),
                            TensorSpec("weight_scale", "F32", ("R",)))),
        Layout("ples_int4", (TensorSpec("weight_i4", "U8", ("R", "W/2")),
                             TensorSpec("weight_scale", "F16", ("R", "W/16")))),
        Layout(
            "ples_nvfp4",
            (
                TensorSpec("weight_e2m1", "U8", ("R", "W/2")),
                TensorSpec("weight_scale", "F8_E4M3", ("R", "W/16")),
                TensorSpec("weight_scale_2", "F32", ()),
            ),
        ),
    )
}
_DIVISOR = {"W": 1, "W/2": 2, "W/16": 16}


def detect(names: set[str] | frozenset[str]) -> Layout | None:
    """The layout whose tensors these are, or None for a generic table.

    Raises ValueError when the names are a layout's main tensor with the rest wrong,
    which is a damaged sidecar rather than some other kind of file.
    """
    for layout in LAYOUTS.values():
        if names == layout.names:
            return layout
    for layout in LAYOUTS.values():
        if layout.tensors[0].name in names:
            missing = sorted(layout.names - names)
            extra = sorted(names - layout.names)
            parts = (([f"lacks {', '.join(missing)}"] if missing else [])
                     + ([f"has unexpected {clip(', '.join(extra[:5]), 400)}"
                         + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")] if extra else []))
            raise ValueError(f"looks like {layout.name} but {' and '.join(parts)}")
    return None


def rows_and_width(layout: Layout, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str]) -> tuple[int, int]:
    """Check one shard's tensors against the layout; return (rows, row width). ValueError names the tensor."""
    first = layout.tensors[0]
    shape = shapes[first.name]
    if len(shape) != len(first.dims):
        raise ValueError(f"tensor {first.name} has shape {list(shape)}; {layout.name} needs [rows, width]")
    rows, width = shape[0], shape[1] * _DIVISOR[first.dims[1]]
    if width % 16:
        raise ValueError(f"tensor {first.name} gives row width {width}, not a multiple of 16")
    for spec in layout.tensors:
        if dtypes[spec.name] != spec.dtype:
            raise ValueError(f"tensor {spec.name} is {dtypes[spec.name]}; {layout.name} stores it as {spec.dtype}")
        want = tuple(rows if d == "R" else width // _DIVISOR[d] for d in spec.dims)
        if shapes[spec.name] != want:
            raise ValueError(
                f"tensor {spec.name} has shape {list(shapes[spec.name])}; with {rows} rows of width {width} "
                f"{layout.name} needs {list(want)}"
            )
    return rows, width
