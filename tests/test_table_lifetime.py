"""Tensors taken from a table stay valid after the table is closed: the mapping goes with the last of them.

A vLLM process may close a Table (or let it be collected) while its loader still holds weights it took from
it. Those tensors must keep reading the table's bytes, never memory that was unmapped under them. Each check
runs in a child process, so that a fault there is a failed test, not a dead test run.
"""
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.daemon

CHILD = textwrap.dedent("""
    import gc, sys, numpy as np
    from pled import client
    t = client.attach("t1", socket=sys.argv[1])
    before = {name: v.clone() for name, v in t.tensors.items()}
    views = dict(t.tensors.items())
    rows = t.gather([0, 1, 255], dtype=__import__("torch").float32)
    t.close()
    del t
    gc.collect()
    filler = [np.ones(1 << 20, dtype=np.uint8) for _ in range(64)]  # reuse whatever was freed
    same = all(bool((views[name] == before[name]).all()) for name in before)
    print("OK" if same and rows.shape == (3, 160) else "DIFFERENT", flush=True)
""")


def test_tensors_taken_from_a_table_outlive_its_close(daemon, sidecar):
    pled = daemon({"t1": sidecar(shards=2, rows=128)})
    r = subprocess.run([sys.executable, "-c", CHILD, pled.socket], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "OK", (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
