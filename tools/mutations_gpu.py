"""Breakages that the tests of the GPU side (issue 45: pled.client.gpu's probe, routes, views and gpu-check; issue 48
class 1: registration bookkeeping) must catch (tools/mutations.py's format).

    python tools/mutations_gpu.py            # these alone, through tools/mutations.py's runner
    python tools/mutations.py -k gpu:        # the same

tools/mutations.py runs these with its own (``every_mutation()``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

R = "tests/test_gpu_routes.py::"
CHOICE = R + "test_each_table_takes_the_first_route_that_works_and_each_rank_logs_one_line"
ORDER = R + "test_the_table_s_route_order_is_followed_and_kept_for_its_other_slices"
PART_WAY = R + "test_a_registration_failing_part_way_releases_every_chunk_registered_before"
LAST_OWNER = R + "test_a_range_released_by_its_last_owner_leaves_the_table_and_registers_again_for_real"
TWO = R + "test_two_slices_of_one_table_are_registered_each_and_a_covered_one_not_again"
WRITER_FAILS = R + "test_a_writer_whose_writable_registration_fails_is_left_read_only"
PROBE = R + "test_the_probe_reads_the_attributes_versions_and_kernel_module"
NO_CUDA = R + "test_without_cuda_the_view_is_plain_and_said_once"
CHECK = "tests/test_gpu_check.py"
SEAM = "tests/test_vllm_033_ple.py::test_the_seam_takes_each_gpu_route_and_never_a_private_copy"

MUTATIONS = [
    # Registration bookkeeping (issue 48, class 1).
    Mutation("gpu: a registration failing part-way keeps the chunks registered before", "pled/client/gpu/registry.py",
             "            for p, _ in done:  # every chunk", "            for p, _ in done[:0]:  # every chunk",
             (PART_WAY,)),
    Mutation("gpu: a registration failing part-way leaves only its last chunk undone", "pled/client/gpu/registry.py",
             "            for p, _ in done:  # every chunk", "            for p, _ in done[-1:]:  # every chunk",
             (PART_WAY,)),
    Mutation("gpu: a range released by its last owner stays in the table", "pled/client/gpu/registry.py",
             "        del registrations.held[key]  # the last owner", "        pass  # the last owner",
             (LAST_OWNER,)),
    Mutation("gpu: a range released while another owner holds it", "pled/client/gpu/registry.py",
             "        if held.users:\n            return\n", "", (LAST_OWNER,)),
    Mutation("gpu: a range not covered by the one held is taken as registered", "pled/client/gpu/registry.py",
             "            if s <= start and start + length <= s + n:", "            if s <= start:",
             (TWO,)),
    # The probe and the route choice.
    Mutation("gpu: every kernel module taken as the open one", "pled/client/gpu/probe.py",
             '    return "open kernel module" in text.lower()', "    return True", (PROBE,)),
    Mutation("gpu: an attribute the driver does not know taken as yes", "pled/client/gpu/probe.py",
             "            values[key] = False\n", "            values[key] = True\n", (PROBE,)),
    Mutation("gpu: read-only registration tried where the device says it has none", "pled/client/gpu/routes.py",
             "        if not p.read_only_supported:\n", "        if False:\n", (CHOICE,)),
    Mutation("gpu: pageable access taken on HMM without the operator's opt-in", "pled/client/gpu/routes.py",
             "        if not p.ats and not hmm_opted_in():", "        if False:", (CHOICE,)),
    Mutation("gpu: pageable access taken on ATS only when HMM is opted in", "pled/client/gpu/probe.py",
             "        return self.pageable and self.pageable_uses_host_page_tables\n",
             "        return False\n", (CHOICE,)),
    Mutation("gpu: a non-writer takes the writable route", "pled/client/gpu/routes.py",
             "        if not getattr(table, \"writer\", False):\n", "        if False:\n", (CHOICE,)),
    Mutation("gpu: a registration that failed is not moved on from", "pled/client/gpu/routes.py",
             "            except RegistrationError as err:\n                why = f\"{err}\"",
             "            except KeyError as err:\n                why = f\"{err}\"", (CHOICE, CHECK)),
    Mutation("gpu: the table's route order ignored", "pled/client/gpu/routes.py",
             "    routes = tuple(getattr(table, \"gpu_routes\", ROUTES))", "    routes = ROUTES", (ORDER,)),
    Mutation("gpu: the route a table took not kept for its other slices", "pled/client/gpu/routes.py",
             "                    _chosen[key] = (weakref.ref(table), route)", "                    pass",
             (ORDER, SEAM)),
    Mutation("gpu: the writable route registers read-only", "pled/client/gpu/routes.py",
             "                                 flags=MAPPED)", "                                 flags=MAPPED | 0x08)",
             (CHOICE,)),
    Mutation("gpu: the writable route leaves the writer's mapping writable", "pled/client/gpu/routes.py",
             "        table.protect()  # registered or not", "        pass  # registered or not", (WRITER_FAILS,)),
    Mutation("gpu: the writable route registers only the slice, not the mapping", "pled/client/gpu/routes.py",
             "registry.register(rt, owner, table.buffer, table.address, len(table.buffer),",
             "registry.register(rt, owner, table.buffer, ptr, nbytes,", (CHOICE, ORDER)),
    Mutation("gpu: the refusal names no options", "pled/client/gpu/routes.py",
             "            \"; options: \" + \", or \".join(options)", "            \"\"", (CHOICE,)),
    # The view and the UVA guard.
    Mutation("gpu: no log line for a rank's route", "pled/client/gpu/view.py",
             "    held_files.emit(logging.INFO, \"pled: rank %s: %s: %s on device",
             "    (logging.INFO, \"pled: rank %s: %s: %s on device",
             (CHOICE,)),
    Mutation("gpu: without CUDA the view is refused", "pled/client/gpu/view.py",
             "    if rt is None:\n        if not _said_no_cuda:",
             "    if rt is None and False:\n        if not _said_no_cuda:",
             (NO_CUDA,)),
    Mutation("gpu: the UVA guard hands the pageable route to the copying helper", "pled/client/gpu/view.py",
             "        if route == \"pageable\":\n", "        if False:\n", (SEAM,)),
    Mutation("gpu: NVFP4's block scales left without their view on the pageable route", "pled/client/ple_seams.py",
             "            self._uva_weight_scale = getattr(module, UVA)(scale)", "            pass", (SEAM,)),
    # gpu-check.
    Mutation("gpu: gpu-check exits 0 with a table that has no route", "pled/client/gpu/check.py",
             "                code = code or 1\n", "", (CHECK,)),
    Mutation("gpu: gpu-check without a device exits 0", "pled/client/gpu/check.py",
             "        code = EX_NO_DEVICE\n", "", (CHECK,)),
]

if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
