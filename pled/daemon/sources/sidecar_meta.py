"""What a sidecar's META.json says, checked against what its shards hold.

The published sidecars (``ples_int4``, ``ples_fp8``, ``ples_nvfp4``) write::

    {"layout": "group16_int4_fp16scale_lownibblefirst", "shards": 128, "rows": 320001536, "width": 160, ...}

``layout`` is a description, not one of pled's names: readers tell the families apart by words, ``e2m1``
(nvfp4), then ``e4m3`` (fp8), else int4; pled also ignores case. Of fp8's published string only its ``e4m3`` is
known, so any string naming ``e4m3`` (and not ``e2m1``) is fp8: ``rowwise_e4m3_fp32scale``, ``E4M3_rowwise``,
``fp8-e4m3fn``. Here the shards' tensors decide the layout; the string is refused
only when its words name a different family than the tensors hold, and a string with none of the words is
a warning. ``shards``, ``rows`` and ``width`` identify a build and must match the shards. pled's earlier
keys (``num_shards``, ``total_rows``, ``row_width``, ``layout`` as a pled name) are still accepted. Any
other key is kept as it is and shown by ``pled inspect``.
"""
from __future__ import annotations

import logging

from pled.shared import layouts
from pled.shared.boundary import clip
from pled.shared.errors import SidecarError

log = logging.getLogger(__name__)

# The string each layout's published META.json carries, where it is known.
PUBLISHED_LAYOUT = {
    "ples_int4": "group16_int4_fp16scale_lownibblefirst",
    "ples_nvfp4": "group16_e2m1_e4m3scale_lownibblefirst",
}
# fp8's published string is not known (only that it names e4m3): `pled make-sidecar` writes a string of pled's
# own, marked as such, which readers take for fp8 by its e4m3 as they would the published one.
PLED_FP8_LAYOUT = "pled_rowwise_e4m3_fp32scale"
# What `pled make-sidecar` writes as META.json's layout, for each layout.
META_LAYOUT = {**PUBLISHED_LAYOUT, "ples_fp8": PLED_FP8_LAYOUT}
# Keys that identify a build, published and pled's earlier names, -> what of the shards they state.
COUNT_KEYS = {"shards": "shards", "rows": "rows", "width": "width",
              "num_shards": "shards", "total_rows": "rows", "row_width": "width"}


def layout_family(text: str) -> str | None:
    """pled's layout for a META.json ``layout`` string, by the readers' words; None when it names none."""
    if text in layouts.LAYOUTS:
        return text
    words = text.lower()
    if "e2m1" in words:
        return "ples_nvfp4"
    if "e4m3" in words:
        return "ples_fp8"
    if "int4" in words:
        return "ples_int4"
    return None


def check(path: str, meta: dict, layout: str, shards: int, rows: int, width: int) -> None:
    """Refuse a META.json (at ``path``) that contradicts the shards; warn about a layout string it cannot read."""
    actual = {"shards": shards, "rows": rows, "width": width}
    is_ple = layout in layouts.LAYOUTS
    for key, what in COUNT_KEYS.items():
        if key not in meta or (what != "shards" and not is_ple):
            continue  # a generic table has no rows or width to compare
        value = meta[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise SidecarError(path, f"says {key} = {clip(repr(value), 80)}, not a whole number; the shards give "
                                     f"{actual[what]}")
        if value != actual[what]:
            raise SidecarError(path, f"says {key} = {value!r} but the shards give {actual[what]!r}")  # <= 20 digits
    if "layout" not in meta:
        return
    text = meta["layout"]
    if not isinstance(text, str):
        raise SidecarError(path, f"says layout = {clip(repr(text), 80)}, not a string; remove the key or write the "
                                 "layout's name")
    family = layout_family(text)
    if family is None:
        log.warning("%s: layout %s names no known family (e2m1, e4m3, int4); the shards' tensors say %s",
                    path, clip(repr(text), 120), layout)
    elif family != layout:
        held = f"{layout} ({', '.join(sorted(layouts.LAYOUTS[layout].names))})" if is_ple else "no PLE layout"
        raise SidecarError(path, f"says layout = {clip(repr(text), 120)}, which is {family}, but the shards hold "
                                 f"{held}; fix META.json or the shards")


def other_keys(meta: dict) -> dict:
    """What META.json says besides the identity keys and the digests: kept, and shown by `pled inspect`."""
    return {k: v for k, v in meta.items() if k not in COUNT_KEYS and k not in ("layout", "digests")}
