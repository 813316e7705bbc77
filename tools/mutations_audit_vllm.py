"""Breakages of the vLLM seams against what changes under them that tests/test_vllm_seams_under_change.py must catch:
a held file rewritten in place at the same size served from the stale region (its identity checked by size alone,
or the disk fallback serving the region all the same), and pled's weight iterator yielding expert weights that
vLLM's own skips for other ranks (whole files, a checkpoint file's tensors, local_expert_ids passed positionally)
(tools/mutations.py's format and runner).

    python tools/mutations_audit_vllm.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_audit_vllm.py --list     # and its other options (-k, --timeout)

tools/mutations.py runs these with its own (``every_mutation()``). They need .venv-vllm (`make vllm-env`).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

T = "tests/test_vllm_seams_under_change.py::"
REWRITTEN = T + "test_a_held_file_rewritten_in_place_at_the_same_size_is_refused_or_read_anew_never_served_stale"
EXPERTS = T + "test_the_iterator_through_pled_skips_exactly_the_expert_weights_vllm_skips_for_each_rank[0.32]"

MUTATIONS = [
    # A held file rewritten at the same size: refused, or read anew from disk; never the bytes pled staged.
    Mutation("a held file's identity checked by its size alone (a same-size rewrite served from the stale region)",
             "pled/client/held_files.py",
             "        if (st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino) != (shard.size, shard.mtime_ns, shard.dev, "
             "shard.ino):\n",
             "        if st.st_size != shard.size:\n",
             (REWRITTEN,)),
    Mutation('with "fallback": "disk", a changed held file warned about and served from the stale region all the same',
             "pled/client/held_files.py",
             "            return None\n        problem = held.table.unviewable(held.shard.index)\n",
             "            return held\n        problem = held.table.unviewable(held.shard.index)\n",
             (REWRITTEN,)),
    # Expert parallelism: pled's iterator skips exactly the expert weights vLLM's skips.
    Mutation("whole files served from pled's region yield every rank's expert weights", "pled/client/vllm_plugin.py",
             "            for name, index in entries.items():\n"
             "                if not module.should_skip_weight(name, experts):\n"
             "                    yield name, mapping.tensor(tensors[index])\n",
             "            for name, index in entries.items():\n"
             "                yield name, mapping.tensor(tensors[index])\n",
             (EXPERTS,)),
    Mutation("a checkpoint file pled holds the PLE tensors of yields every rank's expert weights",
             "pled/client/vllm_plugin.py",
             "                        if not module.should_skip_weight(name, experts):\n",
             "                        if not module.should_skip_weight(name, None):\n",
             (EXPERTS,)),
    Mutation("local_expert_ids taken from keywords only (vLLM's iterator also takes it as its fourth argument)",
             "pled/client/vllm_plugin.py",
             '        experts = bound.arguments.get("local_expert_ids")\n',
             '        experts = kwargs.get("local_expert_ids")\n',
             (EXPERTS,)),
]


if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
