"""The vLLM 0.33 PLE seams' own rules (pled/client/ple_seams.py), where no vLLM is needed: what the start-up hook costs,
and a vLLM whose seam does not fit. The seams on the real 0.33 classes: tests/test_vllm_033_ple.py.

A vLLM whose seams do not fit is a stand-in package written here (the real 0.33's fit): its ngram_embedding and
ple modules have the classes by name, with other signatures, as a later vLLM might."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import harness
from pled.generator import make_checkpoint

PINNED = "vllm.models.qwen4_exp.common.ngram_embedding"
ROOT = Path(__file__).resolve().parent.parent


def python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120,
                          env=harness.clean_env(**env))


def test_the_start_up_hook_arranges_the_seams_and_imports_neither_numpy_nor_torch():
    r = python("import sys; from pled.client import import_hook\n"
               "print(sorted(m for m in ('numpy', 'torch', 'pled.client.ple_seams', 'pled.client.held_files') "
               "if m in sys.modules), sorted(n for n in import_hook._after if 'qwen4_exp' in n))",
               PLED_SOCKET="/nonexistent")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.strip() == ("[] ['vllm.models.qwen4_exp.common.ngram_embedding', "
                                "'vllm.models.qwen4_exp.common.ple']")


def stand_in_vllm(root) -> None:
    """A vLLM whose PLE classes take other parameters than 0.33's."""
    common = root / "vllm" / "models" / "qwen4_exp" / "common"
    common.mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "models", root / "vllm" / "models" / "qwen4_exp", common):
        (d / "__init__.py").write_text("")
    (common / "ple.py").write_text(textwrap.dedent("""
        class PLEVocabParallelEmbedding:
            def _compute_shard_overlap(self, *, checkpoint_start, checkpoint_rows):
                return None
            def weight_loader(self, param, loaded_weight, checkpoint_start=None, *, strict=True):
                return "vllm's own"
    """))
    (common / "ngram_embedding.py").write_text(textwrap.dedent("""
        from .ple import PLEVocabParallelEmbedding
        def get_accelerator_view_from_cpu_tensor(tensor):
            return tensor
        class Qwen4ExpPLEPinnedHostEmbedding(PLEVocabParallelEmbedding):
            def allocate_embedding_weight(self, num_embeddings, embedding_dim, dtype, device=None):
                return "vllm's own"
    """))


@pytest.mark.daemon
def test_a_seam_that_does_not_fit_fails_the_import_where_pled_serves_arrays(tmp_path, daemon, sidecar):
    stand_in_vllm(tmp_path / "site")
    make_checkpoint(str(tmp_path / "m"), "fp8", {0: 100}, width=32, parts=4, files=1)
    arrays = daemon({"ple": {"checkpoint": tmp_path / "m"}})
    files = daemon({"whole": sidecar("ples_int4", shards=2, rows=64)})
    code = f"import {PINNED} as m; print(m.Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight(None, 1, 2, 3))"
    site = f"{tmp_path / 'site'}{os.pathsep}{ROOT}"  # the stand-in vLLM, and this tree's pled (a mutation's too)
    refused = python(code, PYTHONPATH=site, PLED_SOCKET=arrays.socket)
    assert refused.returncode == 1 and "vllm's own" not in refused.stdout
    (line,) = [x for x in refused.stderr.splitlines() if x.startswith("pled.client.ple_seams.SeamUnfit")]
    assert "ple does not fit pled's seam: PLEVocabParallelEmbedding.weight_loader is (self, param, loaded_weight, " \
           "checkpoint_start, strict)" in line and "PLED_FALLBACK=disk" in line, line
    # with the fallback: vLLM's own path, and one warning for each module whose seam does not fit
    fell = python(code, PYTHONPATH=site, PLED_SOCKET=arrays.socket, PLED_FALLBACK="disk")
    assert fell.returncode == 0 and fell.stdout.strip() == "vllm's own", fell.stderr
    warned = [x for x in fell.stderr.splitlines() if "does not fit pled's seam" in x]
    assert len(warned) == 2 and all("fallback = \"disk\"" in x for x in warned), fell.stderr
    assert "allocate_embedding_weight is (self, num_embeddings, embedding_dim, dtype, device)" in warned[1]
    # pled serving no arrays, or not configured: vLLM's own classes, untouched, and nothing said
    for env in ({"PLED_SOCKET": files.socket}, {}):
        quiet = python(code, PYTHONPATH=site, **env)
        assert quiet.returncode == 0 and quiet.stdout.strip() == "vllm's own" and "seam" not in quiet.stderr, \
            quiet.stderr


class FakeRuntime:
    """FAKED (no GPU here): the CUDA registration calls pled.client.gpu makes, recorded."""

    def __init__(self) -> None:
        self.calls, self.unregistered = [], []

    def register(self, ptr, nbytes, flags):
        self.calls.append((ptr, nbytes, flags))
        return 0

    def unregister(self, ptr):
        self.unregistered.append(ptr)
        return 0

    def error(self, code):
        return f"fake error {code}"


def test_a_registration_is_page_rounded_chunked_at_64_gib_shared_and_released_with_its_last_owner():
    import gc

    from pled.client.gpu import registry

    fake = FakeRuntime()

    class Owner:  # what a tensor's storage keeps alive: the numpy array over the mapping
        pass

    start, nbytes = (1 << 40) + 100, 130 << 30  # a slice that starts and ends inside a page
    first, second = Owner(), Owner()
    key = registry.register(fake, first, "mapping", start, nbytes, "a slice")
    assert key == registry.register(fake, second, "mapping", start, nbytes, "the same slice again")
    page = registry.PAGE
    lo, hi = start - start % page, -(-(start + nbytes) // page) * page
    assert [(p, n) for p, n, _ in fake.calls] == [(lo, 64 << 30), (lo + (64 << 30), 64 << 30),
                                                  (lo + (128 << 30), hi - lo - (128 << 30))]
    assert {flags for _, _, flags in fake.calls} == {0x02 | 0x08}  # Mapped | ReadOnly, once for both owners
    del first
    gc.collect()
    assert fake.unregistered == []  # the other owner still holds the pages
    del second
    gc.collect()
    assert fake.unregistered == [p for p, _, _ in fake.calls]
    assert key not in registry.registrations.held
