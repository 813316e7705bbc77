"""vLLM's own loader module (weight_utils) with the pled plugin registered, as vLLM's plugin loader does.
Prints JSON. loader_check.py '{"held": [FILE, ...], "others": [FILE, ...]}'

Reads files through vLLM's safetensors_weights_iterator (with prefetch keywords) with pled holding none, some
and all of them, and through its safe_open, and says for each case: which lists vLLM's own iterator was
called with (it sizes the list it is given once per call: `_get_checkpoints_size_bytes`), what its prefetch
received, where each tensor lives, and whether the (name, tensor) pairs equal vLLM's own without pled (the
same call with PLED_SOCKET unset), byte for byte; and what the held files' page cache held before vLLM read
them without pled. pled's log lines go to vLLM's handler (stdout) or, before vLLM configured its logging, to
stderr."""
import json
import os
import sys

from pled.client import held_files, private_views, vllm_plugin
from pled.shared.pagecache import cached_bytes

vllm_plugin.register()  # what vLLM's plugin loader does in each of its processes

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.model_executor.model_loader import weight_utils as wu  # noqa: E402

files = json.loads(sys.argv[1])
held, others = files["held"], files["others"]
calls = {"sized": [], "prefetched": []}
real_size, real_prefetch = wu._get_checkpoints_size_bytes, wu._prefetch_all_checkpoints


def size_spy(sorted_files):
    calls["sized"].append(list(sorted_files))
    return real_size(sorted_files)


def prefetch_spy(sorted_files, *args, **kwargs):
    calls["prefetched"].append({"files": list(sorted_files), "args": list(args), "kwargs": kwargs})
    return real_prefetch(sorted_files, *args, **kwargs)


wu._get_checkpoints_size_bytes, wu._prefetch_all_checkpoints = size_spy, prefetch_spy


def read(paths, strategy="prefetch"):
    """One call of the iterator as vLLM's loader makes it, prefetch keywords and all."""
    calls["sized"].clear()
    calls["prefetched"].clear()
    it = wu.safetensors_weights_iterator(paths, False, strategy, safetensors_prefetch_num_threads=3,
                                         safetensors_prefetch_block_size=1 << 20)
    pairs = list(it)
    return pairs, {"sized": list(calls["sized"]), "prefetched": list(calls["prefetched"])}


def as_bytes(pairs):
    return sorted((name, str(t.dtype), tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                  for name, t in pairs)


out = {"version": vllm.__version__, "weight_utils": wu.__file__,
       "wrapped": getattr(wu.safetensors_weights_iterator, "__pled__", False)}
cases = {"none": others, "some": held[:1] + others + held[1:], "all": held}
through_pled = {}
for case, paths in cases.items():
    pairs, seen = read(paths)
    through_pled[case] = pairs
    out[case] = seen
# torchao rebuilds tensors across files: every file must reach vLLM's iterator (here it then refuses, torchao
# being absent, with its own error)
try:
    read(held + others, "torchao")
    out["torchao"] = {"error": None}
except Exception as err:
    out["torchao"] = {"error": f"{type(err).__name__}: {err}"}
out["torchao"]["sized"] = list(calls["sized"])
table = next(iter(held_files._state.tables.values()))
lo, hi = table.address, table.address + table.manifest.region_bytes
for case, pairs in through_pled.items():
    out[case]["in_region"] = sorted(name for name, t in pairs if lo <= t.data_ptr() < hi or  # shared, or
                                    private_views.origin(t.data_ptr()) is not None)  # mapped copy-on-write
with wu.safe_open(held[0], framework="pt") as f:
    out["safe_open_type"] = type(f).__name__
    via_safe_open = {k: f.get_tensor(k) for k in f.keys()}
out["safe_open_in_region"] = all(private_views.origin(t.data_ptr())[0] is table for t in via_safe_open.values())
out["page_cache_held"] = [cached_bytes(p) for p in held]  # before vLLM reads them without pled, below
socket = os.environ.pop("PLED_SOCKET")  # vLLM without pled: the seams pass every call through
for case, paths in cases.items():
    pairs, _ = read(paths)
    out[case]["equal_to_vllm"] = as_bytes(through_pled[case]) == as_bytes(pairs)
    out[case]["names"] = sorted(name for name, _ in pairs)
with wu.safe_open(held[0], framework="pt") as f:
    out["safe_open_equal"] = all(torch.equal(via_safe_open[k], f.get_tensor(k)) for k in f.keys())
os.environ["PLED_SOCKET"] = socket
print("PLED-RESULT " + json.dumps(out))
