"""The ``pled`` command."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from . import __version__, config as config_mod, logs
from .errors import EX_CONFIG, PledError

log = logging.getLogger("pled")


def _inspect(args) -> int:
    from . import region
    from .sidecar import open_table
    from .sizes import gib

    sidecar = open_table(args.path)
    manifest = region.plan("inspect", sidecar)
    if args.json:
        print(json.dumps({**sidecar.describe(), "region_bytes": manifest.region_bytes}, indent=2))
        return 0
    shards = sidecar.shards
    print(sidecar.source)
    print(f"  layout     {sidecar.layout}")
    print(f"  shards     {len(shards)} ({shards[0].name} .. {shards[-1].name})")
    if sidecar.rows:
        per = sorted({s.rows for s in shards})
        print(f"  rows       {sidecar.rows} ({'/'.join(map(str, per))} per shard)")
        print(f"  row width  {sidecar.row_width}")
    print(f"  bytes      {sidecar.nbytes} ({gib(sidecar.nbytes)}); region {manifest.region_bytes} ({gib(manifest.region_bytes)}) with alignment")
    return 0


def _preflight(args) -> int:
    from .daemon import open_tables, run_preflight

    config = config_mod.load(args.config)
    verdict = run_preflight(config, open_tables(config))
    if args.json:
        print(json.dumps(verdict.as_dict(), indent=2))
    else:
        for problem in verdict.problems:
            print(f"warning: could not read {problem}", file=sys.stderr)
        print(verdict.message)
    return 0 if verdict.ok else EX_CONFIG


def _serve(args) -> int:
    from .daemon import Daemon

    return Daemon(config_mod.load(args.config)).run()


def _demo(args) -> int:
    from .demo import run

    return run(layout=args.layout, shards=args.shards, rows=args.rows, keep=args.keep)


def _make_sidecar(args) -> int:
    from .generator import make_sidecar

    try:
        paths = make_sidecar(args.dir, args.layout, shards=args.shards, rows=args.rows, width=args.width, seed=args.seed)
    except ValueError as err:
        print(f"pled make-sidecar: {err}", file=sys.stderr)
        return 64
    print(f"wrote {len(paths)} shards and META.json to {args.dir}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pled", description="Keep a large model's embedding tables resident in shared memory.")
    p.add_argument("--version", action="version", version=f"pled {__version__}")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = p.add_subparsers(dest="command", required=True)
    config_help = f"config file (default ${config_mod.ENV_VAR} or {config_mod.DEFAULT_PATH})"

    s = sub.add_parser("inspect", help="validate a sidecar directory or glob and describe it")
    s.add_argument("path")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_inspect)

    s = sub.add_parser("preflight", help="check that this host and cgroup can hold the configured tables")
    s.add_argument("-c", "--config", help=config_help)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_preflight)

    s = sub.add_parser("serve", help="run the daemon: preflight, stage, hold the tables until SIGTERM")
    s.add_argument("-c", "--config", help=config_help)
    s.set_defaults(func=_serve)

    s = sub.add_parser("demo", help="stage a small synthetic sidecar and read it back")
    s.add_argument("--layout", default="ples_int4", choices=["ples_fp8", "ples_int4", "ples_nvfp4"])
    s.add_argument("--shards", type=int, default=16)
    s.add_argument("--rows", type=int, default=50_000)
    s.add_argument("--keep", action="store_true", help="keep the temporary sidecar")
    s.set_defaults(func=_demo)

    s = sub.add_parser("make-sidecar", help="write a synthetic sidecar for tests and benchmarks")
    s.add_argument("dir")
    s.add_argument("--layout", default="ples_int4", choices=["ples_fp8", "ples_int4", "ples_nvfp4"])
    s.add_argument("--shards", type=int, default=4)
    s.add_argument("--rows", type=int, default=1024)
    s.add_argument("--width", type=int, default=160)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=_make_sidecar)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logs.setup(args.log_level)
    try:
        return args.func(args)
    except PledError as err:
        log.error("%s", err)
        return err.exit_status
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
