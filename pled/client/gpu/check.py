"""``pled gpu-check``: run as the vLLM user on the GPU host, the first thing to run on new hardware.

For every device: the probe's answers (pled.client.gpu.probe). For every table pled serves: its gpu_access, its
route order, whether this uid is one of its writers, and on each device the route it takes and why the routes
before it were passed over, found by taking the route for the table's first page (a registration really made, then
released; a writer's mapping made read-only, as vLLM's would be). Exit status: 0 every table has a route on every
device; 1 a table has none on some device (the line says what it lacks and the options); 3 no pled answers at the
socket; 4 no CUDA device in this process (torch without CUDA, no driver, or no GPU): the tables are listed, nothing
is probed.
"""
from __future__ import annotations

import gc
import json
import os

from pled.shared.errors import EX_NOT_RUNNING

EX_NO_DEVICE = 4


def _tables(socket: str) -> list:
    from pled import client
    from pled.client.held_files import _served_tables
    from pled.shared import protocol

    names = _served_tables(client.call(protocol.STATUS, socket=socket), socket)
    return [client.attach(name, socket=socket, populate=False) for name in names]


def _first_page(rt, p, table) -> tuple[str | None, list[str]]:
    """The route ``table`` takes on device ``p.device`` for its first page (released at once), and why the routes
    before it were passed over; (None, [the refusal]) where none works."""
    import numpy as np

    from pled.client.gpu import routes
    from pled.client.gpu.registry import PAGE

    owner = np.frombuffer(table.buffer, dtype=np.uint8, count=min(PAGE, len(table.buffer)))
    try:
        taken = routes.take(rt, p, table, owner, table.address, len(owner), f"table {table.name}'s first page")
    except routes.NoRoute as err:
        return None, [str(err)]
    finally:
        del owner
        gc.collect()  # its registration released now
    return taken.route, taken.skipped


def run(socket: str, as_json: bool = False) -> int:
    from pled import client
    from pled.client.gpu import cuda, probe
    from pled.client.gpu.routes import NAMES

    try:
        tables = _tables(socket)
    except client.DaemonUnavailable as err:
        print(f"pled gpu-check: {err}")
        return EX_NOT_RUNNING
    except client.ClientError as err:
        print(f"pled gpu-check: {err}")
        return 1
    uid = os.geteuid()
    out: dict = {"uid": uid, "tables": {t.name: {"gpu_access": t.gpu_access, "gpu_routes": list(t.gpu_routes),
                                                 "writer": t.writer, "routes": {}} for t in tables}, "devices": []}
    lines = [f"table {t.name}: gpu_access = \"{t.gpu_access}\", routes {', '.join(t.gpu_routes)}; uid {uid} is "
             + ("one of its writers" if t.writer else "not a writer") for t in tables]
    try:
        rt = cuda.runtime()
        count = rt.device_count() if rt is not None else 0
    except RuntimeError as err:
        rt, count, lines = None, 0, [*lines, f"CUDA: {err}"]
    code = 0
    if rt is None or count == 0:
        lines.append(f"no CUDA device in this process (pid {os.getpid()}): torch without CUDA, no NVIDIA driver, or "
                     "no GPU; nothing probed (exit 4). Run pled gpu-check as the vLLM user, in vLLM's environment, "
                     "on the GPU host")
        code = EX_NO_DEVICE
    for d in range(count):
        rt.set_device(d)
        p = probe.probe(rt, d)
        out["devices"].append(p.describe())
        kind = "ATS" if p.ats else "HMM" if p.hmm else "none"
        lines.append(f"device {d} ({p.name}): host registration {_yn(p.register_supported)} (99), read-only "
                     f"{_yn(p.read_only_supported)} (113), pageable access {_yn(p.pageable)} (88) through the host's "
                     f"page tables {_yn(p.pageable_uses_host_page_tables)} (100: {kind}), "
                     f"host pointer for registered memory {_yn(p.host_pointer_for_registered)} (91); "
                     f"{probe.versions_text(p)}, kernel module "
                     f"{'open' if p.open_module else 'proprietary' if p.open_module is False else 'unknown'}"
                     + "".join(f"; unknown: {u}" for u in p.unknown))
        for t in tables:
            route, why = _first_page(rt, p, t)
            out["tables"][t.name]["routes"][str(d)] = {"route": route, "passed_over": why}
            if route is None:
                code = code or 1
                lines.append(f"  table {t.name}: NO ROUTE: {why[0]}")
            else:
                lines.append(f"  table {t.name}: {NAMES[route]}" + (f" (passed over: {'; '.join(why)})" if why else ""))
    for t in tables:
        t.close()
    out["exit"] = code
    print(json.dumps(out, indent=2) if as_json else "\n".join(lines))
    return code


def _yn(value: bool) -> str:
    return "yes" if value else "no"
