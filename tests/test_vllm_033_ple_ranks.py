"""Every rank, every table form (issue 48 class 2): vLLM 0.33's own PLE classes on pled's arrays for ranks > 0 of a
real gloo world of 3, for each form and dtype pled serves them in: the sharded form
(`…ngram_embedding.shard_<i>.weight`, bf16, fp8 and nvfp4) and the unsharded `…ngram_embedding.weight` (bf16 and
fp8, the forms vLLM loads unsharded).

For each, on every rank: the pinned parameters are views of pled's region at that rank's rows, and equal byte for
byte to what vLLM builds without pled. Then, for each rank r, a copy of the checkpoint with one row changed in the
middle of rank r's rows: rank r refuses it, naming the tensor (the compare-only loader compares this rank's rows,
not rows from 0); the other ranks load it as before, their rows being unchanged (the row is not their business).

Real: `pled serve` (two: the sharded and the unsharded checkpoints, which hold the same layer in the same dtype),
vLLM 0.33's modules, its weight iterator and load_weights, gloo. FAKED, because this machine has no GPU: the CUDA
registration call, Tensor.is_pinned for registered ranges, the UVA view and upstream's pin_memory
(tests/vllm_env/ple_rank.py says how). Skipped where .venv-vllm or the 0.33.0 copy is missing (`make vllm-env`).
"""
import json
import os
import shutil

import numpy as np
import pytest

import harness
from pled.daemon.sources.safetensors_file import read_header, write
from pled.generator import PLE_PREFIX, make_checkpoint, shard_rows
from vllm_env.ple_world import VLLM_033, run_world, sizes

WORLD = 3
# 4 n-gram heads of 64 columns, a few thousand rows; a divisor 3 ranks divide; 40 shards (the last ones partial)
TEXT = {"ngram_size": 3, "heads_per_ngram": 2, "ple_embed_dim": 256, "ngram_vocab_size_base": 1_500,
        "make_ngram_vocab_size_divisible_by": 6, "split_ngram_parts": 40, "eos_token_id": 1, "vocab_size": 1000}
WIDTH = TEXT["ple_embed_dim"] // 4
FORMS = [("sharded", "bf16"), ("sharded", "fp8"), ("sharded", "nvfp4"), ("unsharded", "bf16"), ("unsharded", "fp8")]
PINNED = {"bf16": ["weight"], "fp8": ["weight"], "nvfp4": ["weight", "weight_scale"]}

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.daemon, pytest.mark.timeout(1800),
              pytest.mark.skipif(not (VLLM_033 / ".ready").exists(),
                                 reason="no .cache/vllm-0.33.0: run `make vllm-env` (it installs it there)")]


def unsharded_checkpoint(directory, dtype: str, rows: int, seed: int) -> None:
    """One file (and its index) holding layer 0's table as one `…ngram_embedding.weight` (and fp8's per-tensor
    scale), beside a norm, as a checkpoint that vLLM loads unsharded has it."""
    rng = np.random.default_rng(seed)
    prefix = PLE_PREFIX.format(layer=0) + ".ngram_embedding"
    if dtype == "bf16":
        weight = ("BF16", (rng.standard_normal((rows, WIDTH), dtype=np.float32).view(np.uint32) >> 16)
                  .astype(np.uint16))
    else:
        codes = rng.integers(0, 254, size=(rows, WIDTH), dtype=np.uint16)
        weight = ("F8_E4M3", (codes + (codes >= 0x7F)).astype(np.uint8))  # no NaN codes
    tensors = [("model.language_model.layers.0.input_layernorm.weight", "F32", (WIDTH,),
                rng.standard_normal(WIDTH, dtype=np.float32)),
               (f"{prefix}.weight", weight[0], (rows, WIDTH), weight[1])]
    if dtype == "fp8":
        tensors.append((f"{prefix}.weight_scale", "F32", (1,), np.array([0.004], dtype=np.float32)))
    os.makedirs(directory)
    name = "model-00001-of-00001.safetensors"
    write(os.path.join(directory, name), [(n, d, s, np.ascontiguousarray(a).tobytes()) for n, d, s, a in tensors],
          metadata={"format": "pt"})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: name for n, *_ in tensors}}, f)


def change_row(directory, form: str, rows: int, row: int) -> str:
    """Flip one bit of global row ``row`` of layer 0's weight in the checkpoint at ``directory``; the name of the
    tensor that holds it."""
    prefix = PLE_PREFIX.format(layer=0) + ".ngram_embedding"
    if form == "unsharded":
        name, inside = f"{prefix}.weight", row
    else:
        counts = shard_rows(rows, TEXT["split_ngram_parts"])
        starts = np.cumsum([0, *counts])
        shard = int(np.searchsorted(starts, row, side="right") - 1)
        name, inside = f"{prefix}.shard_{shard}.weight", row - int(starts[shard])
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    path = directory / weight_map[name]
    t = next(t for t in read_header(str(path)).tensors if t.name == name)
    at = t.begin + inside * (t.nbytes // t.shape[0]) + 1
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x04]))
    return name


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    harness.require_marker("daemon", "this module's fixture starts pled")
    d = tmp_path_factory.mktemp("ple033ranks")
    rows = sizes(TEXT, [0])[0]
    assert rows % WORLD == 0
    dirs = {}
    for i, (form, dtype) in enumerate(FORMS):
        dirs[form, dtype] = d / f"{form}-{dtype}"
        if form == "sharded":
            make_checkpoint(str(dirs[form, dtype]), dtype, {0: rows}, width=WIDTH, parts=TEXT["split_ngram_parts"],
                            files=2, seed=i)
        else:
            unsharded_checkpoint(str(dirs[form, dtype]), dtype, rows, seed=i)
    pleds = {form: harness.start(d, {f"{f}-{t}": {"checkpoint": dirs[f, t]} for f, t in FORMS if f == form},
                                 name=form) for form in ("sharded", "unsharded")}
    try:
        yield pleds, dirs, rows, d
    finally:
        for pled in pleds.values():
            pled.stop()


def test_every_rank_of_every_form_views_its_rows_and_refuses_a_change_in_them_only(served):
    pleds, dirs, rows, d = served
    share = rows // WORLD
    cases, changed = [], {}
    for form, dtype in FORMS:
        env = {"PLED_SOCKET": pleds[form].socket}
        cases.append({"name": f"{form}-{dtype}", "dtype": dtype, "checkpoint": str(dirs[form, dtype]),
                      "layers": [0], "env": env, "upstream": True})
        for rank in range(WORLD):
            copy = d / f"{form}-{dtype}-changed-{rank}"
            if not copy.exists():
                shutil.copytree(dirs[form, dtype], copy)
                changed[form, dtype, rank] = change_row(copy, form, rows, rank * share + share // 2 + 1)
            cases.append({"name": f"{form}-{dtype}-changed-{rank}", "dtype": dtype, "checkpoint": str(copy),
                          "layers": [0], "env": env, "lean": False})
    reports = run_world(WORLD, TEXT, cases)
    assert sorted(r["rank"] for r in reports) == list(range(WORLD))
    for report in reports:
        rank = report["rank"]
        assert report["etp"] == [rank, WORLD]
        for form, dtype in FORMS:
            what = (form, dtype, rank)
            rec = report["cases"][f"{form}-{dtype}"]["layers"]["0"]
            assert "error" not in rec, (what, rec.get("traceback"))
            assert rec["range"] == [rank * share, (rank + 1) * share], what
            assert set(rec["params"]) == set(PINNED[dtype]), what
            for name, p in rec["params"].items():  # a view of pled's region at this rank's rows, pinned
                assert p["ptr"] == p["storage"] == p["expected"], (what, name, p)
                assert p["mapping"].startswith(f"r--s /memfd:pled:{form}-{dtype}"), (what, p["mapping"])
                assert p["pinned"] and p["shape"][0] == share, (what, p)
            assert rec["equal_to_upstream"] == {n: True for n in rec["digests"]}, (what, rec["equal_to_upstream"])
            # the checkpoint's tensors were pled's (copy-on-write views of the same rows): none compared by reading
            assert rec["rows_compared"] == 0, what
            for other in range(WORLD):
                got = report["cases"][f"{form}-{dtype}-changed-{other}"]["layers"]["0"]
                assert "error" in got or got["rows_compared"] > 0, (what, other)  # read from disk: compared
                if other == rank:  # the changed row is this rank's: refused, naming the tensor, in one line
                    error = got.get("error", "")
                    assert f"{changed[form, dtype, other]} differs from the rows pled's region holds" in error, \
                        (what, got)
                    assert "\n" not in error
                else:  # another rank's row: not this rank's business
                    assert "error" not in got, (what, other, got.get("traceback"))
                    assert got["digests"] == rec["digests"], (what, other)
