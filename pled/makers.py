"""``pled demo``, ``pled make-sidecar`` and ``pled make-checkpoint``: the commands that make synthetic tables (for
tests, benchmarks and a first try), apart from the commands that run or ask a pled."""
from __future__ import annotations

import os
import sys

from pled.shared.boundary import say
from pled.shared.errors import EX_USAGE

# pled.generator's (which imports numpy: not at every command's start); tests/test_operator_cli.py checks they agree
CHECKPOINT_DTYPES = ("bf16", "fp8", "nvfp4")


def add_commands(sub, layouts) -> None:
    """The three commands' parsers, on ``pled``'s subparsers."""
    s = sub.add_parser("demo", help="stage a small synthetic sidecar and read it back")
    s.add_argument("--layout", default="ples_int4", choices=layouts, help="the quantized layout (default %(default)s)")
    s.add_argument("--shards", type=int, default=16, help="how many shard files (default %(default)s)")
    s.add_argument("--rows", type=int, default=50_000, help="rows per shard (default %(default)s)")
    s.add_argument("--keep", action="store_true", help="keep the temporary sidecar")
    s.set_defaults(func=demo)

    s = sub.add_parser("make-sidecar", help="write a synthetic sidecar for tests and benchmarks",
                       description="Write a synthetic sidecar (shard_N.safetensors and META.json in the published "
                                   "form) into DIR; the same options and seed give the same bytes.")
    s.add_argument("dir", help="the directory to write (made if missing)")
    s.add_argument("--layout", default="ples_int4", choices=layouts, help="the quantized layout (default %(default)s)")
    s.add_argument("--shards", type=int, default=4, help="how many shard files (default %(default)s)")
    s.add_argument("--rows", type=int, help="rows per shard (default 1024)")
    s.add_argument("--width", type=int, help="row width in columns (default 160)")
    s.add_argument("--published-shape", action="store_true",
                   help="the published sidecars' shape: 2,500,012 rows per shard, width 160 (an int4 shard is ~250 MB; "
                        "default off)")
    s.add_argument("--seed", type=int, default=0, help="the random generator's seed (default %(default)s)")
    s.set_defaults(func=make_sidecar)

    s = sub.add_parser("make-checkpoint", help="write a synthetic model checkpoint with PLE tables, for a "
                                               "`checkpoint` table's tests",
                       description="Write a synthetic model checkpoint into DIR: model-0000K-of-0000N.safetensors "
                                   "files holding each layer's PLE table, split into shard tensors as vLLM 0.33 "
                                   "reads them, beside a norm per layer, and model.safetensors.index.json. The same "
                                   "options and seed give the same bytes (pled.generator.make_checkpoint).")
    s.add_argument("dir", help="the directory to write (made if missing)")
    s.add_argument("--dtype", default="nvfp4", choices=CHECKPOINT_DTYPES, help="the PLE tables' dtype "
                                                                               "(default %(default)s)")
    s.add_argument("--rows", default="1000,1234",
                   help="each layer's padded rows, comma-separated: one layer per number, layers 0, 1, ... "
                        "(default %(default)s)")
    s.add_argument("--width", type=int, default=64, help="row width in columns (default %(default)s)")
    s.add_argument("--parts", type=int, default=7, help="shard tensors per layer's table, vLLM's split_ngram_parts "
                                                        "(default %(default)s)")
    s.add_argument("--files", type=int, default=3, help="how many .safetensors files (default %(default)s)")
    s.add_argument("--seed", type=int, default=0, help="the random generator's seed (default %(default)s)")
    s.add_argument("--no-index", action="store_true", help="write no model.safetensors.index.json (default: write it)")
    s.add_argument("--kind", default="ple", choices=("ple", "engram"),
                   help="ple: Qwen4Exp PLE tables, shaped by the dtype, rows, width and parts options; engram: "
                        "DeepSeek V4.1 Engram tables, layers 1 and 3, 4 hash heads each of prime sizes above the "
                        "engram vocabulary below, 256 F8_E4M3 values and 8 F8_E8M0 scales a row, beside other "
                        "tensors, with config.json (default %(default)s)")
    s.add_argument("--engram-vocab", type=int, default=50,
                   help="for the engram kind: engram_vocab_size, each hash head's base size (default %(default)s)")
    s.set_defaults(func=make_checkpoint)


def demo(args) -> int:
    from pled.demo import run

    return run(layout=args.layout, shards=args.shards, rows=args.rows, keep=args.keep)


def make_sidecar(args) -> int:
    from pled import generator
    from pled.daemon.sources.sidecar_meta import META_LAYOUT, PUBLISHED_LAYOUT
    from pled.shared.layouts import PUBLISHED_ROWS_PER_SHARD, PUBLISHED_WIDTH

    rows, width = args.rows, args.width
    if args.published_shape:
        if rows not in (None, PUBLISHED_ROWS_PER_SHARD) or width not in (None, PUBLISHED_WIDTH):
            say(f"pled make-sidecar: --published-shape writes {PUBLISHED_ROWS_PER_SHARD:,} rows per shard of width "
                f"{PUBLISHED_WIDTH}; drop --rows and --width, or drop --published-shape", file=sys.stderr)
            return EX_USAGE
        rows, width = PUBLISHED_ROWS_PER_SHARD, PUBLISHED_WIDTH
    rows = 1024 if rows is None else rows
    width = PUBLISHED_WIDTH if width is None else width
    try:
        paths = generator.make_sidecar(args.dir, args.layout, shards=args.shards, rows=rows, width=width,
                                       seed=args.seed)
    except ValueError as err:
        say(f"pled make-sidecar: {err}", file=sys.stderr)
        return EX_USAGE
    shape = "published" if (rows, width) == (PUBLISHED_ROWS_PER_SHARD, PUBLISHED_WIDTH) else "synthetic"
    whose = "" if args.layout in PUBLISHED_LAYOUT else " (pled's own: the published fp8 string is not known)"
    say(f"{shape} shape: {len(paths)} shards x {rows:,} rows, width {width}, layout string "
        f"'{META_LAYOUT[args.layout]}'{whose}")
    say(f"wrote {len(paths)} shards and META.json to {args.dir}")
    return 0


MAX_PARTS = 65536  # shard tensors a table: vLLM's split_ngram_parts is 512 by default


def _room_for(directory: str, nbytes: int, what: str) -> bool:
    """Whether the file system that will hold ``directory`` has ``nbytes`` free; else one line that says so."""
    from pled.shared.sizes import gib

    at = os.path.abspath(directory)
    while not os.path.exists(at) and at != os.path.dirname(at):
        at = os.path.dirname(at)
    try:
        st = os.statvfs(at)
    except OSError:
        return True  # not known: the writes say it
    free = st.f_bavail * st.f_frsize
    if nbytes <= free:
        return True
    say(f"pled make-checkpoint: {what} is about {gib(nbytes)}, and {at} has {gib(free)} free; ask for fewer rows",
        file=sys.stderr)
    return False


def make_checkpoint(args) -> int:
    from pled import generator

    if args.kind == "engram":
        return _make_engram_checkpoint(args)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        say(f"pled make-checkpoint: --rows {args.rows!r}: whole numbers separated by commas, one per layer",
            file=sys.stderr)
        return EX_USAGE
    step = 16 if args.dtype == "nvfp4" else 1  # nvfp4: one scale per 16 columns
    width_ok = args.width >= step and args.width % step == 0
    bad = [f"{name} {value}" for name, value, ok in (("--rows", min(rows), min(rows) >= 1),
                                                     ("--width", args.width, width_ok),
                                                     ("--parts", args.parts, 1 <= args.parts <= MAX_PARTS),
                                                     ("--files", args.files, args.files >= 1)) if not ok]
    if bad:
        say(f"pled make-checkpoint: {bad[0]}: rows, parts and files are at least 1 (parts at most {MAX_PARTS}), and "
            "a width is at least 1 (nvfp4: a multiple of 16)", file=sys.stderr)
        return EX_USAGE
    # at most 2 bytes a value (bf16) and a 4-byte scale a row: refused before anything is drawn or written
    if not _room_for(args.dir, sum(rows) * (2 * args.width + 4), f"--rows {args.rows} x --width {args.width}"):
        return EX_USAGE
    try:
        paths = generator.make_checkpoint(args.dir, args.dtype, rows=dict(enumerate(rows)), width=args.width,
                                parts=args.parts, files=args.files, seed=args.seed, index=not args.no_index)
    except ValueError as err:
        say(f"pled make-checkpoint: {err}", file=sys.stderr)
        return EX_USAGE
    say(f"wrote {len(paths)} checkpoint file(s){'' if args.no_index else ' and model.safetensors.index.json'} to "
        f"{args.dir}: {len(rows)} layer(s) of {args.dtype} PLE tables ({', '.join(f'{r:,}' for r in rows)} rows, "
        f"width {args.width}, {args.parts} shard tensors each); `pled inspect --checkpoint {args.dir}` describes them")
    return 0


def _make_engram_checkpoint(args) -> int:
    from pled.generator import ENGRAM, make_engram_checkpoint

    if args.engram_vocab < 2 or args.files < 1:
        say(f"pled make-checkpoint: --engram-vocab {args.engram_vocab} or --files {args.files}: a head's vocabulary "
            "is at least 2 and files at least 1", file=sys.stderr)
        return EX_USAGE
    from pled.generator import engram_config

    config = {**ENGRAM, "engram_vocab_size": args.engram_vocab}
    dim = config["engram_head_dim"]
    rows = sum(engram_config(config)["engram_num_embeddings"])  # its heads' prime sizes: found quickly, not drawn
    if not _room_for(args.dir, rows * (dim + dim // 32), f"--engram-vocab {args.engram_vocab}"):
        return EX_USAGE
    paths, c = make_engram_checkpoint(args.dir, config, files=args.files, seed=args.seed, index=not args.no_index)
    rows = c["engram_num_embeddings"]
    say(f"wrote {len(paths)} checkpoint file(s){'' if args.no_index else ' and model.safetensors.index.json'} and "
        f"config.json to {args.dir}: DeepSeek V4.1 Engram tables of layers {c['engram_layer_ids']} "
        f"({', '.join(f'{r:,}' for r in rows)} rows of {c['engram_head_dim']} F8_E4M3 values and "
        f"{c['engram_head_dim'] // 32} F8_E8M0 scales); `pled inspect --checkpoint {args.dir}` describes them")
    return 0
