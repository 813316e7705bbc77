"""Breakages of DeepSeek V4.1's Engram tables on pled (issue 46) that its tests must catch (tools/mutations.py's
format and runner).

    python tools/mutations_engram.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_engram.py --list     # and its other options (-k, --timeout)

The seam's mutations run tests/test_vllm_033_engram.py, which needs .venv-vllm and .cache/vllm-0.33.0 (`make test`).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation, main  # noqa: E402

CK = "tests/test_engram_checkpoint.py::"
V = "tests/test_vllm_033_engram.py::"
REFUSALS = V + "test_refusals_name_the_tensor_in_one_line"
TP2 = V + "test_every_rank_views_pleds_sealed_region_and_equals_upstreams[1-2]"
SHM = V + "test_a_64mib_dev_shm_keeps_sharing_on_with_one_copy"

MUTATIONS = [
    Mutation("an Engram table's scale tensor not recognised (only its weight held)",
             "pled/daemon/sources/engram.py", "    if not sep or not head or param not in arrays.ENGRAM_PARAMS:",
             "    if not sep or not head or param != \"weight\":",
             (CK + "test_each_engram_layer_is_two_arrays_in_checkpoint_order_verbatim",)),
    Mutation("an Engram scale of another dtype taken (vLLM would convert it)",
             "pled/daemon/sources/engram.py", "            if a.dtype != dtype:",
             "            if a.dtype != dtype and param == \"weight\":",
             (CK + "test_an_engram_checkpoint_pled_cannot_serve_is_refused_naming_the_tensor",)),
    Mutation("an Engram scale with other rows than its weight taken",
             "pled/daemon/sources/engram.py", "                or weight.rows != scale.rows:",
             "                or weight.rows < 0:",
             (CK + "test_an_engram_checkpoint_pled_cannot_serve_is_refused_naming_the_tensor",)),
    Mutation("vLLM's private pinned copy shown without torch's power-of-two rounding",
             "pled/daemon/sources/engram.py", "    return 1 << max(0, n - 1).bit_length() if n > 0 else 0",
             "    return n", (CK + "test_pled_inspect_lists_engram_tables_and_vllms_private_copies",)),
    Mutation("the loader takes a changed checkpoint byte (no comparison)",
             "pled/client/engram_seams.py",
             "    if not torch.equal(shard.contiguous().view(torch.uint8), param.data.view(torch.uint8)):",
             "    if False:", (REFUSALS,)),
    Mutation("load_format=dummy let through to write into the sealed table",
             "pled/client/engram_seams.py", "    if load_format == \"dummy\":", "    if load_format == \"dummies\":",
             (REFUSALS,)),
    Mutation("an Engram layer matched by width alone (another row count taken)",
             "pled/client/engram_seams.py",
             "held if w.shape == (rows, dim) and s.shape == (rows, dim // layer.block_size)]",
             "held if w.shape[1] == dim]", (REFUSALS,)),
    Mutation("upstream's copying loader left on pled's views (it writes into the sealed region)",
             "pled/client/engram_seams.py", "            self._weight_loader = _compare\n",
             "            pass\n", (TP2,)),
    Mutation("can_share_engram_tables left to /dev/shm's free space",
             "pled/client/engram_seams.py", "        if not held or size <= 1 or",
             "        if True or not held or size <= 1 or", (SHM,)),
]

if __name__ == "__main__":
    sys.exit(main(MUTATIONS))
