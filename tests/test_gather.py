"""Table.gather against a reference read from the shard files, element by element, from the layout table alone
(tests/reference.py)."""
import pytest
import torch

from harness import LAYOUTS
from pled import client
from reference import reference_row


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_matches_the_reference(sidecar, daemon, layout):
    d = sidecar(layout, shards=5, rows=300, seed=11)
    pled = daemon({layout: d})
    with client.attach(layout, socket=pled.socket) as t:
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(0, 1500, (64,), generator=g)
        ids[:4] = torch.tensor([0, 299, 300, 1499])  # shard edges
        out = torch.empty((64, 160), dtype=torch.float32)
        ptr = out.data_ptr()
        result = t.gather(ids, out=out)
        assert result is out and out.data_ptr() == ptr  # filled in place
        for i, row in enumerate(ids.tolist()):
            shard, local = divmod(row, 300)
            want = torch.tensor(reference_row(str(d / f"shard_{shard}.safetensors"), layout, local),
                                dtype=torch.float32)
            assert torch.allclose(out[i], want, rtol=1e-6, atol=0), (layout, row)
        bf16 = t.gather(ids)  # default output: bfloat16
        assert bf16.dtype == torch.bfloat16 and torch.allclose(bf16.float(), out, rtol=1e-2, atol=1e-6)
        assert torch.equal(t.gather(ids[:1], dtype=torch.float32), out[:1])  # one shard only: the fast path
        assert t.gather(torch.empty(0, dtype=torch.int64)).shape == (0, 160)


def test_gather_rejects_bad_requests(sidecar, daemon):
    pled = daemon({"t": sidecar("ples_int4", shards=2, rows=100)})
    with client.attach("t", socket=pled.socket) as t:
        with pytest.raises(IndexError, match=r"row id 200 is out of range .* \[0, 200\)"):
            t.gather([0, 200])
        with pytest.raises(IndexError, match="row id -1"):
            t.gather([-1])
        with pytest.raises(ValueError, match=r"out has shape \(3, 160\)"):
            t.gather([1, 2], out=torch.empty(3, 160))
        with pytest.raises(TypeError, match="integers"):
            t.gather(torch.tensor([1.5]))


def test_gather_on_a_generic_table_is_refused(tmp_path, daemon):
    import numpy as np

    from pled.daemon.sources.safetensors_file import write

    write(str(tmp_path / "model-00001-of-00001.safetensors"),
          [("w", "F32", (2, 2), np.ones((2, 2), np.float32).tobytes())])
    pled = daemon({"ckpt": tmp_path / "model-*.safetensors"})
    with client.attach("ckpt", socket=pled.socket) as t:
        assert torch.equal(t.tensors["w"], torch.ones(2, 2))
        with pytest.raises(ValueError, match="needs a PLE layout"):
            t.gather([0])
