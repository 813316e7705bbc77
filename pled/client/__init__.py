"""The client side: the library (attach to a table pled holds, zero copy, read-only), the vLLM plugin and
its start-up hook. Never imports daemon code (pled.daemon); torch comes from the environment it runs in.

    from pled.client import attach
    with attach("ples_int4") as table:          # maps the daemon's sealed memfd
        table.tensors["shard_0/weight_i4"]      # torch views into the mapping, no copy
        table.gather(row_ids, out=pinned_buf)   # CPU gather + dequant, [n, 160]

The library's names are imported on first use (PEP 562): the start-up hook (pled.autoload) imports
pled.client.vllm_plugin in every interpreter of vLLM's environment where PLED_SOCKET is set, and must not pay
for numpy there. ``attach`` is in library.py, the wire connection in connection.py, the mapped table in
mapped_table.py, the gather in gather.py.
"""
from __future__ import annotations

from importlib import import_module

_HOME = {
    "attach": "library",
    **dict.fromkeys(("call", "socket_path", "Connection", "DEFAULT_SOCKET", "ENV_SOCKET", "ClientError",
                     "DaemonUnavailable", "PermissionDenied", "NotWritable", "NoSuchTable", "NotReady", "ReloadFailed",
                     "ProtocolError", "BadRegion"), "connection"),
    **dict.fromkeys(("Table", "TensorViews"), "mapped_table"),
}
__all__ = list(_HOME)


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
