"""Table.gather keeps its scratch: a request of a size seen before allocates nothing and takes no page
fault; its results equal, bit for bit, a reference read from the shard files with struct and the per-shard
op chain (bench/op_chain.py) that gather was before it kept scratch, for all three layouts."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import LAYOUTS
from pled import client
from reference import reference_row

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("op_chain", ROOT / "bench" / "op_chain.py")
op_chain = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(op_chain)

SHARDS, ROWS = 5, 2000


def in_a_process_of_its_own(script: str, *args) -> list[str]:
    """Run ``script`` in a fresh Python; its output lines. Page faults are counted there: in pytest's process,
    every fork an earlier test made (a subprocess with preexec_fn, a forked client) leaves its pages
    copy-on-write, and the first write to each is a fault that no gather caused."""
    r = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.splitlines()


def chain(t, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    starts = torch.tensor([i * ROWS for i in range(SHARDS)])
    out = torch.empty((len(ids), 160), dtype=dtype)
    return op_chain.gather(t.manifest.layout, [t.shard_tensors(s) for s in range(SHARDS)], starts, ids, out)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_equals_the_references_bit_for_bit(sidecar, daemon, layout):
    d = sidecar(layout, shards=SHARDS, rows=ROWS, seed=5)
    pled = daemon({layout: d})
    with client.attach(layout, socket=pled.socket) as t:
        ids = torch.randint(0, SHARDS * ROWS, (3000,), generator=torch.Generator().manual_seed(7))
        ids[:6] = torch.tensor([0, ROWS - 1, ROWS, SHARDS * ROWS - 1, 17, 17])  # shard edges, a repeated id
        got = t.gather(ids, dtype=torch.float32)
        assert torch.equal(got.view(torch.int32), chain(t, ids, torch.float32).view(torch.int32))  # -0.0 included
        for dtype in (torch.bfloat16, torch.float16):
            assert torch.equal(t.gather(ids, dtype=dtype).view(torch.int16), chain(t, ids, dtype).view(torch.int16))
        for i in range(0, 3000, 97):
            shard, local = divmod(int(ids[i]), ROWS)
            want = torch.tensor(reference_row(str(d / f"shard_{shard}.safetensors"), layout, local),
                                dtype=torch.float32)
            assert torch.equal(got[i], want), (layout, int(ids[i]))
        # ids as int32, as a list, in a strided tensor: the same rows
        assert torch.equal(t.gather(ids.to(torch.int32), dtype=torch.float32), got)
        assert torch.equal(t.gather(ids[::2].tolist(), dtype=torch.float32), got[::2])
        assert torch.equal(t.gather(ids.view(2, -1).t().reshape(-1), dtype=torch.float32),
                           got.view(2, -1, 160).transpose(0, 1).reshape(-1, 160))
        # a caller's non-contiguous float32 output is filled in place
        wide = torch.zeros((3000, 320), dtype=torch.float32)
        t.gather(ids, out=wide[:, 160:])
        assert torch.equal(wide[:, 160:], got) and not wide[:, :160].any()


REPEATED_GATHERS = """
import resource, sys, torch
from pled import client
layout, sock, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
with client.attach(layout, socket=sock) as t:
    g = torch.Generator().manual_seed(1)
    n = 4096  # every per-request buffer is over glibc's 128 KiB mmap threshold: a fresh one would fault
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty((n, 160), dtype=dtype)
        t.gather(torch.randint(0, total, (n,), generator=g), out=out)  # the first pays
        ptrs = [b.data_ptr() for b in t.scratch.buffers()]
        for _ in range(3):
            ids = torch.randint(0, total, (n,), generator=g)
            before = faults()
            t.gather(ids, out=out)
            print(dtype, "faults", faults() - before)
        t.gather(ids[: n // 2], out=out[: n // 2])  # smaller requests use the same scratch
        print(dtype, "same scratch", [b.data_ptr() for b in t.scratch.buffers()] == ptrs)
"""


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_second_gather_of_the_same_size_allocates_nothing(sidecar, daemon, layout):
    d = sidecar(layout, shards=SHARDS, rows=ROWS, seed=6)
    pled = daemon({layout: d})
    lines = in_a_process_of_its_own(REPEATED_GATHERS, layout, pled.socket, SHARDS * ROWS)
    assert len(lines) == 8, lines
    for line in lines:
        assert line.endswith(" faults 0") or line.endswith(" same scratch True"), f"{layout}: {line}"


WARM_THEN_GATHER = """
import resource, sys, torch
from pled import client
sock, total = sys.argv[1], int(sys.argv[2])
out = torch.empty((4096, 160), dtype=torch.bfloat16)
out.zero_()
with client.attach("t", socket=sock, warm_rows=4096) as t:
    ids = torch.randint(0, total, (4096,))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t.gather(ids, out=out)
    print("rows", t.scratch.rows, "faults", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_warm_rows_pays_the_first_request_at_attach(sidecar, daemon):
    d = sidecar("ples_int4", shards=SHARDS, rows=ROWS)
    pled = daemon({"t": d})
    assert in_a_process_of_its_own(WARM_THEN_GATHER, pled.socket, SHARDS * ROWS) == ["rows 4096 faults 0"]


@pytest.mark.parametrize("times,expected", [([], False), ([1.0], False), ([1.0, 1.049], True), ([1.0, 0.951], True),
                                             ([1.0, 1.06], False), ([2.0, 1.0, 1.04], True), ([1.0, 0.5], False)])
def test_settled_compares_the_last_two_gathers(times, expected):
    from pled.client.gather import settled

    assert settled(times) is expected


def test_warm_runs_gathers_until_their_time_settles(sidecar, daemon):
    """One warm-up gather left a fresh process's next requests at ~0.85 of their speed (measured when warm was
    changed); warm repeats until two gathers take the same time, within its bound, and leaves torch's RNG alone."""
    from pled.client.gather import WARM_MAX_GATHERS, settled

    d = sidecar("ples_int4", shards=SHARDS, rows=ROWS)
    pled = daemon({"t": d})
    rng = torch.get_rng_state()
    with client.attach("t", socket=pled.socket, warm_rows=2048) as t:
        assert torch.equal(torch.get_rng_state(), rng), "warm-up drew from torch's global generator"
        times = t.warm(2048)
        assert 2 <= len(times) <= WARM_MAX_GATHERS
        assert settled(times) or len(times) == WARM_MAX_GATHERS
        assert not any(settled(times[:k]) for k in range(len(times))), "warm-up went on after it had settled"
        assert t.scratch.rows == 2048


@pytest.mark.parametrize("durations,gathers", [([5.0, 3.0, 2.0, 2.05, 9.0, 9.0, 9.0, 9.0], 4),  # settles at the 4th
                                               ([1.0, 2.0] * 4, 8)])  # never settles: stops at the bound
def test_warm_stops_where_the_gathers_settle(sidecar, daemon, durations, gathers):
    """The stopping rule, with each gather's duration scripted by the clock (the gathers themselves are real)."""
    d = sidecar("ples_int4", shards=SHARDS, rows=ROWS)
    pled = daemon({"t": d})

    def ticks():
        now = 0.0
        for step in durations:
            yield now
            now += step
            yield now

    tick = ticks()
    with client.attach("t", socket=pled.socket) as t:
        times = t._gather_for().warm(256, clock=lambda: next(tick))
        assert times == pytest.approx(durations[:gathers])
