"""Breakages that the CPU tests of the device check's Engram section (tests/test_device_check_engram.py) must catch:
the CPU reference's decoding (ue8m0 as the kernel reads it, the e4m3 values, the scale's block), its masking (rows
outside the rank, padded heads), the packed form, the head sharding, the slice's size, and the section listed
where there is no CUDA (tools/mutations.py's format and runner).

    python tools/mutations_devengram.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_devengram.py --list     # and its other options (-k, --timeout)
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

T = "tests/test_device_check_engram.py::"
DTYPES = T + "test_the_reference_decodes_as_torchs_float8_dtypes"
BY_HAND = T + "test_the_reference_looks_up_the_ranks_heads_and_zeroes_the_rest"
SLICE = T + "test_the_slice_is_as_large_as_asked_and_sharded_as_vllm_shards_heads"
INTERP = T + "test_the_carried_kernel_computes_the_reference_in_tritons_interpreter"
LISTED = T + "test_without_cuda_the_engram_section_is_listed_and_not_run"
E = "bench/device/engram.py"

MUTATIONS = [
    Mutation("a ue8m0 byte read one exponent off", E, "(scale.astype(np.uint32) << 23)",
             "((scale.astype(np.uint32) + 1) << 23)", (DTYPES, BY_HAND, INTERP)),
    Mutation("the reference's scale block of 16, not 32", E, "block: int = 32) -> np.ndarray:",
             "block: int = 16) -> np.ndarray:", (BY_HAND,)),
    Mutation("rows outside the rank looked up too", E,
             "        owned = (col >= vocab_start) & (col < vocab_end)\n        rows = col[owned]",
             "        owned = col >= 0\n        rows = col[owned]", (BY_HAND, INTERP)),
    Mutation("a padded head read as the last real one", E,
             "        if h >= total:\n            continue  # a padded head: zeros",
             "        if h >= total:\n            h = total - 1", (BY_HAND,)),
    Mutation("the packed form with the scale bytes first", E, "np.concatenate([weight[col[owned]], scale[col[owned]]]",
             "np.concatenate([scale[col[owned]], weight[col[owned]]]", (BY_HAND, INTERP)),
    Mutation("a rank's heads start at its rank, not its rank times its share", E, "    start = rank * local\n",
             "    start = rank\n", (BY_HAND, SLICE, INTERP)),
    Mutation("the slice sized in rows, not bytes", E, "if (hi - lo) * row >= slice_bytes:",
             "if (hi - lo) >= slice_bytes // 64:", (SLICE,)),
    Mutation("the Engram section missing from the check's list", "bench/device/check.py",
             '"routes", "engram", "fp8")', '"routes", "fp8")', (LISTED,)),
]


if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
