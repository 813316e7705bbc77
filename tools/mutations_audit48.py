"""Breakages that issue 48's tests of classes 4 and 6 must catch (tools/mutations.py's format and runner).

Class 4, one table's shards agree (tests/test_shards_agree.py): ``odd_one_out`` naming the shard after the first
again (the majority named as the fault), or the last of a tie; the checkpoint's check of dtype or of width dropped;
the PLE sidecar's width or layout check dropped, or its refusal naming the other shard; the generic sidecar's
per-tensor dtype dropped; a dtype the format does not name (another byte order) let through.

Class 6, JSON's booleans are not integers (tests/test_booleans_are_not_integers.py): each parser's exact-type check
relaxed to ``isinstance(x, int)`` (which takes ``true`` for 1): a record's fields and int lists (the manifest), a
shape's extents, a header's data_offsets, META.json's counts, the Attach reply's generation; the config's StrictInt
fields turned into lax ints, the boolean refusal of sizes and of seconds dropped, and the before-validators of
``allow_groups`` and ``numa`` relaxed (pydantic's StrictInt behind them still refuses ``true``, but in one complaint
per member of the union, which the test refuses). Not here, because equivalent: those two fields' StrictInt turned
into int, as their before-validators refuse a boolean first with the same message.

    python tools/mutations_audit48.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_audit48.py --list

tools/mutations.py runs these with its own (``every_mutation()``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation, main  # noqa: E402

S = "tests/test_shards_agree.py::"
ODD = S + "test_odd_one_out_names_the_one_that_disagrees_with_most"
CK = S + "test_a_checkpoint_shard_that_disagrees_is_refused_naming_it"
CK_UNKNOWN = S + "test_a_checkpoint_shard_of_an_unknown_dtype_is_refused_naming_its_file"
GENERIC = S + "test_a_generic_sidecar_shard_that_disagrees_is_refused_naming_it"
PLE_WIDTH = S + "test_a_ple_sidecar_shard_of_another_width_is_refused_naming_it"
PLE_DTYPE = S + "test_a_ple_sidecar_shard_of_another_dtype_is_refused_naming_it"

B = "tests/test_booleans_are_not_integers.py::"
HEADER = B + "test_a_boolean_in_a_headers_shape_or_offsets_is_refused"
META = B + "test_a_boolean_count_in_meta_json_is_refused"
META_PATH = B + "test_a_sidecar_whose_meta_json_says_shards_true_is_refused_naming_it"
MANIFEST = B + "test_a_boolean_anywhere_a_manifest_holds_an_integer_is_refused"
ATTACH = B + "test_a_boolean_generation_in_an_attach_reply_is_refused_by_the_client"
CONFIG = B + "test_a_boolean_for_a_number_in_the_config_is_refused_naming_the_key"

MUTATIONS = [
    # -- class 4 ------------------------------------------------------------------------------------------------
    Mutation("odd_one_out takes the first shard for the table's (a first shard that disagrees names the second)",
             "pled/daemon/sources/naming.py",
             "    common = max(counts, key=counts.__getitem__)  #", "    common = values[0]  #",
             (ODD, CK, GENERIC, PLE_WIDTH, PLE_DTYPE)),
    Mutation("odd_one_out breaks a tie for the value seen last", "pled/daemon/sources/naming.py",
             "    common = max(counts, key=counts.__getitem__)  #",
             "    common = max(reversed(list(counts)), key=counts.__getitem__)  #",
             (ODD,)),
    Mutation("a checkpoint's shards compared by width only (one of another dtype accepted)",
             "pled/daemon/sources/checkpoint.py",
             "disagree = odd_one_out([(t.dtype, t.shape[1]) for _, t in tensors])",
             "disagree = odd_one_out([t.shape[1] for _, t in tensors])",
             (CK,)),
    Mutation("a checkpoint's shards compared by dtype only (one of another width accepted)",
             "pled/daemon/sources/checkpoint.py",
             "disagree = odd_one_out([(t.dtype, t.shape[1]) for _, t in tensors])",
             "disagree = odd_one_out([t.dtype for _, t in tensors])",
             (CK,)),
    Mutation("a checkpoint's refusal names the shard the others agree with", "pled/daemon/sources/checkpoint.py",
             "(path, t), (_, agreed) = slots[numbers[disagree[0]]], slots[numbers[disagree[1]]]",
             "(path, t), (_, agreed) = slots[numbers[disagree[1]]], slots[numbers[disagree[0]]]",
             (CK,)),
    Mutation("a PLE sidecar's shards' widths not compared", "pled/daemon/sources/sidecar.py",
             "        disagree = odd_one_out(widths)\n", "        disagree = None\n",
             (PLE_WIDTH,)),
    Mutation("a PLE sidecar's width refusal names the shard the others agree with", "pled/daemon/sources/sidecar.py",
             'raise SidecarError(headers[odd].path, f"row width', 'raise SidecarError(headers[other].path, f"row width',
             (PLE_WIDTH,)),
    Mutation("a PLE sidecar's shards' layouts not compared (the first shard's taken for all)",
             "pled/daemon/sources/sidecar.py",
             "    disagree = odd_one_out(names)\n", "    disagree = None\n",
             (PLE_DTYPE,)),
    Mutation("a generic sidecar's tensors compared by width only (one of another dtype accepted)",
             "pled/daemon/sources/sidecar.py",
             "        disagree = odd_one_out([s[name] for s in sigs])\n",
             "        disagree = odd_one_out([s[name][1] for s in sigs])\n",
             (GENERIC,)),
    Mutation("a dtype the format does not name (another byte order) taken as the one its name resembles",
             "pled/daemon/sources/safetensors_file.py",
             "    if dtype not in DTYPE_BITS:\n",
             "    dtype = dtype if dtype in DTYPE_BITS else \"U8\"\n    if dtype not in DTYPE_BITS:\n",
             (CK_UNKNOWN,)),
    # -- class 6 ------------------------------------------------------------------------------------------------
    Mutation("a record's int field checked with isinstance (true taken for 1 in a manifest)", "pled/shared/records.py",
             "            ok = type(value) is (int if kind == \"int\" else str)",
             "            ok = isinstance(value, int if kind == \"int\" else str)",
             (MANIFEST,)),
    Mutation("a record's int lists checked with isinstance (a shape or range of booleans)", "pled/shared/records.py",
             "        if not all(type(v) is kind for v in values[at:at + 65536]):",
             "        if not all(isinstance(v, kind) for v in values[at:at + 65536]):",
             (MANIFEST,)),
    Mutation("a shape's extents checked with isinstance (shape [true, 2])", "pled/shared/tensors.py",
             "        if type(extent) is not int:", "        if not isinstance(extent, int):",
             (HEADER,)),
    Mutation("a header's data_offsets checked with isinstance alone", "pled/daemon/sources/safetensors_file.py",
             "all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)",
             "all(isinstance(o, int) for o in offsets)",
             (HEADER,)),
    Mutation("META.json's counts checked with isinstance alone (\"shards\": true == 1)",
             "pled/daemon/sources/sidecar_meta.py",
             "        if isinstance(value, bool) or not isinstance(value, int):",
             "        if not isinstance(value, int):",
             (META, META_PATH)),
    Mutation("the Attach reply's generation checked with isinstance (true taken for generation 1)",
             "pled/client/library.py",
             "            if type(generation) is not int or generation < 0:",
             "            if not isinstance(generation, int) or generation < 0:",
             (ATTACH,)),
    Mutation("fdstore_max a lax int (fdstore_max = true)", "pled/daemon/config.py",
             "    fdstore_max: StrictInt = Field(", "    fdstore_max: int = Field(",
             (CONFIG + "[fdstore_max]",)),
    Mutation("allow_uids lax ints (allow_uids = [true] is uid 1)", "pled/daemon/config.py",
             "    allow_uids: tuple[StrictInt, ...] = ()", "    allow_uids: tuple[int, ...] = ()",
             (CONFIG + "[allow_uids]",)),
    Mutation("a size's boolean not refused (headroom_margin = true is 1 byte)", "pled/shared/sizes.py",
             "    if isinstance(value, bool):\n        raise ValueError(\"expected a size",
             "    if False:\n        raise ValueError(\"expected a size",
             (CONFIG + "[headroom_margin]", CONFIG + "[staging_bandwidth]")),
    Mutation("metrics_interval's boolean not refused", "pled/daemon/config.py",
             "    def _seconds(cls, value: object) -> object:\n        if isinstance(value, bool) or not",
             "    def _seconds(cls, value: object) -> object:\n        if not",
             (CONFIG + "[metrics_interval]",)),
    Mutation("allow_groups' before-validator takes a boolean for a gid (pydantic's union answers, twice)",
             "pled/daemon/config.py",
             "                if type(g) is not int and not isinstance(g, str):",
             "                if not isinstance(g, (int, str)):",
             (CONFIG + "[allow_groups]",)),
    Mutation("numa's before-validator takes a boolean for a node (pydantic's union answers, twice)",
             "pled/daemon/config_values.py",
             "not all(type(n) is int for n in value)", "not all(isinstance(n, int) for n in value)",
             (CONFIG + "[numa]", CONFIG + "[table numa]")),
]

if __name__ == "__main__":
    sys.exit(main(MUTATIONS))
