"""vLLM's weight iterator with the pled plugin registered (as vLLM's plugin loader does), for every rank of an
expert-parallel world: the (name, tensor) pairs it yields through pled and through vLLM's own iterator (the same
call with PLED_SOCKET unset), for the same files and ``local_expert_ids``. Prints PLED-RESULT and JSON.

    expert_skip_check.py '{"files": [FILE, ...], "experts": N, "ranks": R}'

The cases: ``local_expert_ids`` None (no expert parallelism), the empty set (a rank with no expert), and each
rank's set as vLLM's own compute_local_expert_ids makes it for R ranks, linear and round-robin; passed by keyword,
as vLLM's default loader passes it, and the linear ones positionally too. Per case: each pair's name and the
sha256 of its bytes through pled and through vLLM alone, and the names whose tensors lay in a region of pled's."""
import hashlib
import json
import os
import sys

from pled.client import held_files, private_views, vllm_plugin

vllm_plugin.register()

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.model_executor.model_loader import weight_utils as wu  # noqa: E402
from vllm.model_executor.model_loader.ep_weight_filter import compute_local_expert_ids  # noqa: E402

args = json.loads(sys.argv[1])
files = args["files"]
cases: dict[str, set[int] | None] = {"none": None, "empty": set()}
for placement in ("linear", "round_robin"):
    for rank in range(args["ranks"]):
        cases[f"{placement}-{rank}"] = compute_local_expert_ids(args["experts"], args["ranks"], rank, placement)
calls = [(case, positional) for case in cases for positional in ((False, True) if "linear" in case else (False,))]


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def read(ids, positional: bool) -> list:
    """One call as vLLM's default loader makes it (the files, no progress bar, the default strategy)."""
    if positional:
        return list(wu.safetensors_weights_iterator(files, False, None, ids))
    return list(wu.safetensors_weights_iterator(files, False, local_expert_ids=ids))


out = {"version": vllm.__version__, "weight_utils": wu.__file__,
       "wrapped": getattr(wu.safetensors_weights_iterator, "__pled__", False), "calls": {}}
for case, positional in calls:
    pairs = read(cases[case], positional)
    spans = [(t.address, t.address + t.manifest.region_bytes) for t in held_files.current().tables.values()]
    out["calls"][case + ("/positional" if positional else "")] = {
        "ids": None if cases[case] is None else sorted(cases[case]),
        "pled": sorted([name, sha(t)] for name, t in pairs),
        "in_region": sorted(name for name, t in pairs if any(lo <= t.data_ptr() < hi for lo, hi in spans)
                            or private_views.origin(t.data_ptr()) is not None)}  # copy-on-write views of a table
del os.environ["PLED_SOCKET"]  # vLLM without pled: the seams pass every call through
for case, positional in calls:
    out["calls"][case + ("/positional" if positional else "")]["vllm"] = sorted(
        [name, sha(t)] for name, t in read(cases[case], positional))
print("PLED-RESULT " + json.dumps(out))
