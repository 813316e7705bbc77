"""vLLM's own loader module (weight_utils) with the pled plugin registered, as vLLM's plugin loader does.
Prints JSON. loader_check.py OTHER_FILE HELD_FILE...

Reads the held files through vLLM's safetensors_weights_iterator (with prefetch keywords) and its
safe_open, and says: the version, where each tensor lives, what the files' page cache held, and which
arguments vLLM's prefetch received (it reads the file pled does not hold). pled's log lines go to vLLM's
handler (stdout) or, before vLLM configured its logging, to stderr."""
import json
import sys

from pled.client import held_files, vllm_plugin
from pled.shared.pagecache import cached_bytes

vllm_plugin.register()  # what vLLM's plugin loader does in each of its processes

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.model_executor.model_loader import weight_utils as wu  # noqa: E402

other, held = sys.argv[1], sys.argv[2:]
prefetched = []
real_prefetch = wu._prefetch_all_checkpoints


def spy(sorted_files, *args, **kwargs):
    prefetched.append({"files": list(sorted_files), "args": list(args), "kwargs": kwargs})
    return real_prefetch(sorted_files, *args, **kwargs)


wu._prefetch_all_checkpoints = spy
out = {"version": vllm.__version__, "weight_utils": wu.__file__, "wrapped": getattr(wu.safetensors_weights_iterator, "__pled__", False)}
it = wu.safetensors_weights_iterator(held + [other], False, "prefetch", safetensors_prefetch_num_threads=3,
                                     safetensors_prefetch_block_size=1 << 20)
tensors = dict(it)
table = next(iter(held_files._state.tables.values()))
lo, hi = table.address, table.address + table.manifest.region_bytes
with wu.safe_open(held[0], framework="pt") as f:
    out["safe_open_type"] = type(f).__name__
    via_safe_open = {k: f.get_tensor(k) for k in f.keys()}
out["page_cache_held"] = [cached_bytes(p) for p in held]
out["in_region"] = sorted(k for k, t in tensors.items() if lo <= t.data_ptr() < hi)
out["safe_open_in_region"] = all(lo <= t.data_ptr() < hi for t in via_safe_open.values())
disk = {}
for p in held + [other]:
    with wu.safe_open.__wrapped__(p, framework="pt") as f:
        disk.update({k: f.get_tensor(k) for k in f.keys()})
out["names_equal"] = sorted(tensors) == sorted(disk)
out["equal"] = all(torch.equal(tensors[k], disk[k]) for k in disk)
out["safe_open_equal"] = all(torch.equal(t, disk[k]) for k, t in via_safe_open.items())
out["prefetched"] = prefetched
print("PLED-RESULT " + json.dumps(out))
