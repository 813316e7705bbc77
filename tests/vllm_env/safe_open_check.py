"""safetensors.safe_open in a process where the pled plugin is registered (as vLLM's plugin loader does):
held files come from pled's region, others from disk. Prints JSON. safe_open_check.py HELD_FILE OTHER_FILE"""
import json
import sys

from pled.client import held_files, private_views, vllm_plugin

vllm_plugin.register()  # what vLLM does in every process; safetensors is imported after it here

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

held, other = sys.argv[1], sys.argv[2]
out = {"patched": getattr(safe_open, "__pled__", False)}
with safe_open(held, framework="pt") as f:
    out["held_type"] = type(f).__name__
    name = f.keys()[0]
    t = f.get_tensor(name)
    out["held_keys"] = f.keys()
    out["metadata"] = f.metadata()
    table = held_files._state.tables["model"]
    found = private_views.origin(t.data_ptr())  # a copy-on-write mapping of the region, as safetensors' of the file
    out["zero_copy"] = found is not None and found[0] is table
    with safe_open.__wrapped__(held, framework="pt") as disk:
        out["equal"] = all(torch.equal(f.get_tensor(k), disk.get_tensor(k)) for k in f.keys())
        out["slice_equal"] = torch.equal(f.get_slice(name)[:2], disk.get_slice(name)[:2])
with safe_open(other, framework="pt") as f:
    out["other_type"] = type(f).__name__
print(json.dumps(out))
