"""vLLM's weight iterator and safetensors.safe_open, with the pled plugin registered (as vLLM's plugin loader does),
over files pled holds, one of which was rewritten after pled staged it. Prints PLED-RESULT and JSON.

    changed_check.py '{"held": [FILE, ...], "changed": FILE, "table": NAME}'

Without the fallback: what the iterator (over every held file) and safe_open (of the changed one) raise, and how
many pairs the iterator yielded before; what safe_open of an unchanged held file is. Then with PLED_FALLBACK=disk:
each pair's name, the sha256 of its bytes and whether it lies in pled's region; and whether the pairs equal vLLM's
own (the same call with PLED_SOCKET unset), byte for byte."""
import hashlib
import json
import os
import sys

from pled.client import held_files, private_views, vllm_plugin

vllm_plugin.register()  # what vLLM's plugin loader does in each of its processes

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from vllm.model_executor.model_loader import weight_utils as wu  # noqa: E402

args = json.loads(sys.argv[1])
held, changed = args["held"], args["changed"]


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def failure(call) -> str | None:
    try:
        call()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


out: dict = {"yielded_before_error": 0}


def iterate() -> None:
    for _ in wu.safetensors_weights_iterator(held, False):
        out["yielded_before_error"] += 1


out["iterator_error"] = failure(iterate)
out["safe_open_error"] = failure(lambda: safe_open(changed, framework="pt"))
with safe_open(next(p for p in held if p != changed), framework="pt") as f:
    out["unchanged_type"] = type(f).__name__

os.environ["PLED_FALLBACK"] = "disk"
table = held_files.current().tables[args["table"]]
lo, hi = table.address, table.address + table.manifest.region_bytes
pairs = list(wu.safetensors_weights_iterator(held, False))
out["fallback"] = sorted([name, sha(t), lo <= t.data_ptr() < hi or private_views.origin(t.data_ptr()) is not None]
                         for name, t in pairs)  # the region's pages: shared, or mapped copy-on-write
with safe_open(changed, framework="pt") as f:
    out["fallback_safe_open"] = sorted([name, sha(f.get_tensor(name))] for name in f.keys())
del os.environ["PLED_SOCKET"]  # vLLM without pled: the seams pass every call through
own = list(wu.safetensors_weights_iterator(held, False))
out["equal_to_vllm"] = sorted([name, sha(t)] for name, t in own) == [p[:2] for p in out["fallback"]]
print("PLED-RESULT " + json.dumps(out))
