"""Breakages of the vLLM seams and what they rest on that the tests of issue 48 (classes 2, 3, 5 and 9) must catch
(tools/mutations.py's format and runner).

    python tools/mutations_seams.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_seams.py --list     # and its other options (-k, --timeout)

tools/mutations.py runs these with its own (``every_mutation()``). Some tests need .venv-vllm (`make vllm-env`).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

REPLY_FDS = "tests/test_reply_fds.py::test_an_attach_reply_without_exactly_one_fd_is_refused_and_every_fd_closed"
BINDING = ("tests/test_hugetlb_readers.py::"
           "test_the_binding_hugetlb_level_is_the_tightest_on_the_path_not_ours_nor_the_first")
IDENTITY = ("tests/test_held_file_identity.py::"
            "test_a_held_file_replaced_by_rename_at_the_same_size_and_mtime_is_refused_never_served_stale")

RANKS = ("tests/test_vllm_033_ple_ranks.py::"
         "test_every_rank_of_every_form_views_its_rows_and_refuses_a_change_in_them_only")

SNAPSHOT = ("tests/test_held_file_identity.py::"
            "test_a_hugging_face_snapshot_is_one_set_of_files_from_its_links_and_from_its_blobs")
CK = "tests/test_checkpoint_tables.py::"
FIDELITY = "tests/test_safe_open_fidelity.py::test_pled_safe_open_matches_safetensors_call_for_call"
PRIVATE = "tests/test_private_views.py"

MUTATIONS = [
    # 3: what pled hands out in place of safetensors' tensors: writable as theirs, shared as theirs, never pled's pages.
    Mutation("safe_open's pt tensors are views of pled's read-only shared mapping (a write faults)",
             "pled/client/safe_open_seam.py", "        return self._private().tensor(e)  #",
             "        return self._table.view(index).detach()  #", (FIDELITY,)),
    Mutation("safe_open's pt/mmap tensors each in their own mapping (a write not seen by the handle's next ones)",
             "pled/client/safe_open_seam.py", "        return self._private().tensor(e)  #",
             "        return self._own(index).tensor(e)  #", (FIDELITY,)),
    Mutation("the pread backend's tensors share the handle's mapping (a write shows in the next get_tensor)",
             "pled/client/safe_open_seam.py", "            return self._own(index).tensor(e, file_shape=True)\n",
             "            return self._private().tensor(e, file_shape=True)\n", (FIDELITY,)),
    Mutation("numpy's get_tensor returns pled's read-only array", "pled/client/safe_open_seam.py",
             "            return self._own(index).array(e)  #", "            return self._table.array(index)  #",
             (FIDELITY,)),
    Mutation("a private view mapped shared (a write would reach pled's pages: refused by the seal, or worse)",
             "pled/client/private_views.py", "flags=mmap.MAP_PRIVATE | MAP_NORESERVE,",
             "flags=mmap.MAP_SHARED | MAP_NORESERVE,", (PRIVATE, FIDELITY)),
    Mutation("a written page of a private view taken as pled's own", "pled/client/private_views.py",
             "    return not bool(own.any())\n", "    return True\n", (PRIVATE,)),
    Mutation("the identity of rows checked by table and offset alone, written pages or not",
             "pled/client/private_views.py",
             "    return source.is_contiguous() and unwritten(",
             "    return source.is_contiguous() or unwritten(", (PRIVATE,)),
    Mutation("the compare-only loader takes only the same address as the same rows (every start reads them)",
             "pled/client/ple_seams.py", "    if private_views.same_rows(table, source, target):\n",
             "    if source.data_ptr() == target.data_ptr():\n", (RANKS,)),
    # 5: a Hugging Face snapshot (links into blobs/) is the same files, from its links and from its blobs.
    Mutation("a held file looked up by the path as given (a snapshot's link is not its blob)",
             "pled/client/held_files.py",
             "        real = os.path.realpath(path)\n        held = self.files.get(real)\n",
             "        real = os.path.abspath(path)\n        held = self.files.get(real)\n", (SNAPSHOT,)),
    Mutation("a checkpoint's files recorded by the path as found (a snapshot's link, not its real path)",
             "pled/daemon/sources/checkpoint.py", "    return Shard(index=index, path=os.path.realpath(path),",
             "    return Shard(index=index, path=os.path.abspath(path),",
             (SNAPSHOT, CK + "test_the_region_reads_back_alone_and_a_client_maps_the_checkpoint_tensors")),
    # 2: every rank, every form: each rank views and compares its own rows.
    Mutation("the unsharded ngram_embedding.weight compared from row 0 on every rank", "pled/client/ple_seams.py",
             "        source, target = loaded.narrow(0, start, end - start), param.narrow(0, 0, end - start)\n",
             "        source, target = loaded.narrow(0, 0, end - start), param.narrow(0, 0, end - start)\n", (RANKS,)),
    Mutation("a rank's rows compared by their first row only", "pled/client/ple_seams.py",
             "    if not torch.equal(source.contiguous().view(torch.uint8), target.view(torch.uint8)):\n",
             "    if not torch.equal(source[:1].contiguous().view(torch.uint8), target[:1].view(torch.uint8)):\n",
             (RANKS,)),
    Mutation("every rank's pinned view starts at the array's row 0", "pled/client/gpu/view.py",
             "count=(hi - lo) * row, offset=array.offset + lo * row)", "count=(hi - lo) * row, offset=array.offset)",
             (RANKS,)),
    # 9a: an Attach reply with more than one fd: refused, every fd that came closed.
    Mutation("a reply may carry four fds (the client's whole ancillary buffer); the first is mapped",
             "pled/client/connection.py", "MAX_REPLY_FDS = 1  #", "MAX_REPLY_FDS = 4  #", (REPLY_FDS,)),
    Mutation("a refused reply's fds closed but for the first (the region's memfd left open in the client)",
             "pled/client/connection.py",
             "its fds are ours to close\n            close_all(fds)\n",
             "its fds are ours to close\n            close_all(fds[1:])\n", (REPLY_FDS,)),
    # 9b: a hugetlb limit on a parent cgroup tighter than pled's own binds.
    Mutation("the hugetlb binding level is pled's own cgroup's, or the first limited one on the path",
             "pled/daemon/memory/hugetlb.py",
             "        return min(self.limited, key=lambda lv: lv.headroom, default=None)",
             "        return self.limited[0] if self.limited else None", (BINDING,)),
    Mutation("the hugetlb binding level is the loosest on the path", "pled/daemon/memory/hugetlb.py",
             "        return min(self.limited, key=lambda lv: lv.headroom, default=None)",
             "        return max(self.limited, key=lambda lv: lv.headroom, default=None)", (BINDING,)),
    Mutation("a hugetlb level's headroom ignores its reservation limit", "pled/daemon/memory/hugetlb.py",
             "        return max(0, min(self.limit - self.usage, self.rsvd_limit - self.rsvd_usage))",
             "        return max(0, self.limit - self.usage)", (BINDING,)),
    # 9c: a held file rewritten (or replaced) at the same size is never served from pled's older region.
    Mutation("a held file known by its size and mtime alone (one replaced by a rename, mtime kept, served stale)",
             "pled/client/held_files.py",
             "        if (st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino) != (shard.size, shard.mtime_ns, shard.dev, "
             "shard.ino):\n",
             "        if (st.st_size, st.st_mtime_ns) != (shard.size, shard.mtime_ns):\n", (IDENTITY,)),
]


if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
