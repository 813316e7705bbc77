"""Breakages that the tests of the arrays form (a `checkpoint` table) and of vLLM 0.33's own PLE path on pled's pages
must catch (tools/mutations.py's format).

    python tools/mutations_arrays.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_arrays.py --list     # and its other options

tools/mutations.py runs these with its own (``every_mutation()``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

TABLES = "tests/test_checkpoint_tables.py::"
V033 = "tests/test_vllm_033_ple.py::"
WORLD = V033 + "test_every_rank_views_pleds_sealed_region_and_equals_upstreams_copy[1]"
REFUSALS = V033 + "test_refusals_name_the_tensor_or_the_device_and_the_fallback_warns_once"
BYTES = TABLES + "test_each_array_is_its_shards_bytes_in_row_order_on_a_2mib_boundary"

MUTATIONS = [
    # The arrays form, daemon side.
    Mutation("an array placed right after the one before it, not on a 2 MiB boundary", "pled/shared/arrays.py",
             "        offset = _align(offset + lo * row_bytes)\n", "        offset = offset + lo * row_bytes\n",
             (BYTES,)),
    Mutation("a checkpoint's tensor copied from the start of its file", "pled/daemon/regions/staging.py",
             "        at = piece.begin + done\n", "        at = done\n", (BYTES,)),
    Mutation("shards not split as vLLM splits them are accepted", "pled/daemon/sources/checkpoint.py",
             "if total == 0 or (numbers != [None] and rows != expected):", "if total == 0:",
             (TABLES + "test_a_checkpoint_pled_cannot_serve_is_refused_naming_the_file_and_what_to_do",)),
    Mutation("a file held whole by one table and its PLE tensors by another both staged",
             "pled/daemon/regions/planning.py",
             "        for shard in sidecar.shards:\n            key = (shard.dev, shard.ino)",
             "        for shard in () if sidecar.arrays else sidecar.shards:\n            key = (shard.dev, shard.ino)",
             (TABLES + "test_a_checkpoint_table_pled_cannot_serve_is_a_refusal_78",)),
    Mutation("verify compares a checkpoint tensor with its file's first bytes", "pled/verify.py",
             "os.pread(fd, min(CHUNK, piece.nbytes - done), piece.begin + done)",
             "os.pread(fd, min(CHUNK, piece.nbytes - done), done)",
             (TABLES + "test_pled_serves_verifies_and_reloads_a_checkpoint_table",)),
    Mutation("a sidecar's manifest written with an empty arrays key (pled 0.1.0's clients refuse it)",
             "pled/shared/region.py", "        if not self.arrays:  # a sidecar's manifest is exactly",
             "        if False:  # a sidecar's manifest is exactly",
             (TABLES + "test_a_client_of_the_previous_release_is_refused_naming_the_form",)),
    Mutation("a manifest's pieces worked out again at every call (Status, each staging tick)", "pled/shared/region.py",
             "    @cached_property\n    def _pieces(self)", "    @property\n    def _pieces(self)",
             (TABLES + "test_a_manifest_works_out_its_pieces_once",)),
    Mutation("verify compares a checkpoint file's tensors but not its header", "pled/verify.py",
             'if table.manifest.form == "arrays" and not _same_header(fd, shard):',
             'if False and not _same_header(fd, shard):',
             (TABLES + "test_verify_finds_a_checkpoint_files_header_rewritten_at_the_same_size_and_mtime",)),
    Mutation("nvfp4's block scales taken without their weight", "pled/daemon/sources/checkpoint.py",
             "        if weight is None:\n", "        if False:\n",
             (TABLES + "test_a_table_vllm_would_read_otherwise_is_refused_naming_the_tensor",)),
    # vLLM 0.33's seams.
    Mutation("vLLM's private pinned copy allocated whatever pled holds", "pled/client/ple_seams.py",
             "        found = _find(st, self, dtype, embedding_dim) if st is not None else None\n",
             "        found = None\n", (WORLD,)),
    Mutation("the loader copies into pled's sealed table (upstream's weight_loader)", "pled/client/ple_seams.py",
             "        return _compare(self, table, param, loaded_weight, checkpoint_start)\n",
             "        return original(self, param, loaded_weight, checkpoint_start)\n", (WORLD,)),
    Mutation("registered without cudaHostRegisterReadOnly", "pled/client/gpu/registry.py",
             "FLAGS = MAPPED | READ_ONLY\n", "FLAGS = MAPPED\n", (WORLD,)),
    Mutation("registrations never released", "pled/client/gpu/registry.py",
             "        code = rt.unregister(p)\n", "        code = 0\n", (WORLD,)),
    Mutation("a slice not pinned after registration handed to vLLM all the same", "pled/client/gpu/view.py",
             "    if taken.registered is not None and not tensor.is_pinned():\n",
             "    if False:\n", (REFUSALS,)),
    Mutation("the UVA guard takes a pled slice that is not pinned", "pled/client/gpu/view.py",
             "        if not tensor.is_pinned():\n            raise PledUnavailable(",
             "        if False:\n            raise PledUnavailable(", (WORLD,)),
    Mutation("a checkpoint row that differs from pled's is taken", "pled/client/ple_seams.py",
             "    if not torch.equal(source.contiguous().view(torch.uint8), target.view(torch.uint8)):",
             "    if False:", (REFUSALS,)),
    Mutation("an array of another dtype viewed as vLLM's (a cast)", "pled/client/ple_seams.py",
             "    exact = [(t, a) for t, a in fits if a.dtype == code]\n", "    exact = fits[:1]\n", (REFUSALS,)),
    Mutation("an array of another row count viewed as vLLM's table", "pled/client/ple_seams.py",
             "if a.shape[1] == width and a.shape[0] == rows]", "if a.shape[1] == width]", (REFUSALS,)),
    Mutation("the disk fallback warns at every refusal, not once a process", "pled/client/held_files.py",
             "                if once is not None and once in self.said:\n", "                if False:\n",
             (REFUSALS,)),
    Mutation("a seam that does not fit is one line and vLLM's own copy", "pled/client/import_hook.py",
             '        if getattr(err, "fatal_to_import", False):\n', "        if False:\n",
             ("tests/test_ple_seams.py::test_a_seam_that_does_not_fit_fails_the_import_where_pled_serves_arrays",)),
]


if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
