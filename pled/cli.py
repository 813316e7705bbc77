"""The ``pled`` command."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from pled import __version__, makers
from pled.daemon.health import journal, logs
from pled.shared import config_file
from pled.shared.boundary import say
from pled.shared.errors import EX_CONFIG, EX_INTERRUPTED, EX_NOPERM, EX_NOT_RUNNING, EX_UNAVAILABLE, PledError
from pled.shared.layouts import LAYOUTS

log = logging.getLogger("pled")
CHECKPOINT_DTYPES = makers.CHECKPOINT_DTYPES


def _load_config(path: str | None):
    """The config, validated (pydantic: the daemon's dependencies). Only the commands that need the whole config
    import it: ``pled status`` and the other calls to a running pled read its socket with tomllib alone."""
    from pled.daemon import config as config_mod  # pled[client] alone lacks pydantic: main() says so, exit 69

    return config_mod.load(path)


def _inspect(args) -> int:
    from pled.describe import inspect

    return inspect(args.path, args.json, args.checkpoint)


def _preflight(args) -> int:
    config = _load_config(args.config)
    from pled.daemon.regions.planning import open_tables, plan_tables, run_preflight

    verdict = run_preflight(config, plan_tables(open_tables(config)))
    if args.json:
        print(json.dumps(verdict.as_dict(), indent=2))
    else:
        for problem in verdict.problems:
            say(f"warning: could not read {problem}", file=sys.stderr)
        say(verdict.message)
    return 0 if verdict.ok else EX_CONFIG


def _serve(args) -> int:
    config = _load_config(args.config)
    from pled.daemon.lifecycle import Daemon

    return Daemon(config).run()


def _call(args, method: str, command: str, **params) -> tuple[dict | None, int]:
    """One call to the daemon for a command: (reply, 0), or (None, exit status) with the error printed."""
    from pled import client

    try:
        return client.call(method, socket=_socket_for(args), timeout=args.timeout, **params), 0
    except client.ClientError as err:
        say(f"pled {command}: {err}", file=sys.stderr)
        return None, (EX_NOT_RUNNING if isinstance(err, client.DaemonUnavailable) else
                      EX_NOPERM if isinstance(err, client.PermissionDenied) else 1)


def _status(args) -> int:
    from pled.shared import protocol

    st, failed = _call(args, protocol.STATUS, "status")
    if st is None:
        return failed
    try:
        return _show_status(args, st)
    except UNREADABLE as err:  # a reply that is not pled's Status
        return _unreadable("status", "Status", args, err)


# What reading a reply of another shape than pled's raises: a command says so in one line, never a traceback.
UNREADABLE = (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError)


def _unreadable(command: str, what: str, args, err: BaseException) -> int:
    from pled.shared.boundary import clip

    say(f"pled {command}: the {what} reply from {_socket_for(args)} is not one this pled can read "
        f"({type(err).__name__}: {clip(err, 120)}); is a pled of this version serving there?", file=sys.stderr)
    return 1


def _show_status(args, st: dict) -> int:
    from pled.shared import protocol
    from pled.shared.sizes import gib

    healthy = all(t["state"] == "ready" and t.get("resident_share", 0) >= protocol.FULLY_RESIDENT
                  and not t.get("modified") for t in st["tables"])
    code = 0 if healthy or args.live else 1  # --live: it answered in time, staging or not
    if args.format == "prometheus":  # for a scraper: the figures say the health, so any answer is a success
        from pled.shared import metrics

        sys.stdout.buffer.write(metrics.render(st))
        return 0
    if args.json or args.format == "json":
        print(json.dumps({**st, "healthy": healthy}, indent=2))
        return code
    up = int(st["uptime_seconds"])
    say(f"pled {st['version']}, pid {st['pid']}, up {up // 3600}h {up % 3600 // 60}m {up % 60}s, socket {st['socket']}")
    # FILES: source files staged / in all (a sidecar's shards, a checkpoint's files); SOURCE: their bytes pled copies;
    # REGION: the sealed memfd's, with its header and 2 MiB alignment (what the preflight counts, what RESIDENT is a
    # share of); CONTENT: the digest of the bytes staged (follows the content; the JSON's "fingerprint" is of the
    # layout and the files' headers only).
    say(f"{'TABLE':<16} {'STATE':<8} {'FILES':>9} {'SOURCE':>10} {'REGION':>10} {'RESIDENT':>8} {'HUGE':>5} "
        f"{'PAGES':>7} {'GEN':>4}  CONTENT")
    notes = []
    for t in st["tables"]:
        resident = f"{t['resident_share']:.0%}" if "resident_share" in t else "-"
        huge = f"{t['huge_page_bytes'] / t['region_bytes']:.0%}" if t.get("huge_page_bytes") is not None else "-"
        pages = (t.get("page_size") or "-").replace(" ", "")  # "2 MiB" -> "2MiB": one word a column
        content = str(t.get("content_digest") or "-").partition(":")[2][:12] or "-"
        say(f"{t['table']:<16} {t['state']:<8} {t['shards_done']:>4}/{t['shards']:<4} {gib(t['bytes']):>10} "
              f"{gib(t['region_bytes']):>10} {resident:>8} {huge:>5} {pages:>7} {t['generation']:>4}  {content}")
        if t.get("huge_page_note"):
            notes.append(f"{t['table']}: {t['huge_page_note']}")
        numa = t.get("numa") or {}
        if numa.get("bytes_per_node"):
            per_node = sorted(numa["bytes_per_node"].items(), key=lambda item: int(item[0]))
            nodes = ", ".join(f"node {n} {gib(b)}" for n, b in per_node)
            notes.append(f"{t['table']}: NUMA {numa.get('policy') or 'policy unknown'}: {nodes}")
        if numa.get("not_placed"):
            notes.append(f"{t['table']}: NUMA not placed: {numa['not_placed']}")
        if t.get("arrays"):
            engram = sum(1 for a in t["arrays"] if isinstance(a, dict) and ".engram." in str(a.get("prefix")) + ".")
            path = {0: "PLE path", len(t["arrays"]): "Engram path"}.get(engram, "PLE and Engram paths")
            notes.append(f"{t['table']}: {len(t['arrays'])} arrays for vLLM 0.33's {path}, from "
                         f"{t['shards']} checkpoint file(s), a region of {gib(t['region_bytes'])} (each array on "
                         "its own 2 MiB boundary; `pled status --json` lists them)")
        if t.get("error"):
            notes.append(f"{t['table']}: {t['error']}")
        if t.get("sources") not in (None, "unchanged"):  # served as staged; the disk may no longer say the same
            notes.append(f"{t['table']}: served as staged, but its source files " + (
                f"could not be checked ({t['sources'][13:]})" if t["sources"].startswith("not checked: ") else
                f"are not as pled staged them ({t['sources']}): `pled verify {t['table']}` compares them, "
                "`pled reload` stages what is there now"))
        if t.get("gpu_access") == "writable":
            m = t.get("modification") or {}
            writers = ", ".join(f"pid {p}" for p in m.get("writers") or []) or "none"
            notes.append(f"{t['table']}: MODIFIED: bytes [{m.get('start')}, {m.get('end')}) ({m.get('what')}) differ "
                         f"from what pled staged, found {m.get('found_seconds_ago')} s ago; writers attached then: "
                         f"{writers}; `pled verify --repair` restages it for new attaches"
                         if t.get("modified") else
                         f"{t['table']}: writable by its writers (gpu_access = \"writable\"); "
                         f"{(t.get('verify') or {}).get('verifies', 0)} scheduled verify(s), no difference")
    if (st.get("daemon") or {}).get("metrics_file_error"):
        notes.append(f"the metrics file cannot be written: {st['daemon']['metrics_file_error']}")
    for note in notes:
        say(f"  note: {note}")
    if st["tables"]:
        say("SOURCE: the files' bytes pled copies; REGION: the memory each table holds, with its header and 2 MiB "
            "alignment; CONTENT: the digest of the bytes staged")
    clients = st["clients"]
    say(f"{len(clients)} client(s) attached" + (":" if clients else ""))
    for c in clients:
        say(f"  pid {c['pid']:<8} uid {c['uid']:<6} {', '.join(c['tables']):<16} {c['command'][:80]}")
    return code


def _socket_for(args) -> str:
    from pled import client
    from pled.shared import protocol

    path = args.socket or os.environ.get(client.ENV_SOCKET)
    if path is None:
        try:
            path = config_file.socket_of(args.config)
        except PledError:
            if args.config or os.environ.get(config_file.ENV_VAR):
                raise  # a config named on purpose that cannot be read is refused (78), not guessed around
            path = protocol.DEFAULT_SOCKET
    return path


def _reload(args) -> int:
    from pled.shared import protocol

    result, failed = _call(args, protocol.RELOAD, "reload")
    if result is None:
        return failed
    try:
        return _show_reload(result)
    except UNREADABLE as err:
        return _unreadable("reload", "Reload", args, err)


def _show_reload(result: dict) -> int:
    gens = result.get("generations", {})
    for key in ("changed", "added", "removed", "unchanged"):
        names = result.get(key) or []
        if names:
            say(f"{key}: " + ", ".join(f"{n} (generation {gens[n]})" if n in gens else n for n in names))
    if result.get("settings"):
        say("settings changed: " + ", ".join(result["settings"]))
    if not any(result.get(k) for k in ("changed", "added", "removed", "settings")):
        say("nothing changed")
    return 0


def _verify(args) -> int:
    import xxhash  # noqa: F401 (the regions' digests: where it is missing, main() says so before anything is read)

    from pled.shared import protocol
    from pled.verify import verify

    differ: list[str] = []
    code = verify(_socket_for(args), args.table, failed=differ)
    if not args.repair or code == EX_NOT_RUNNING:
        return code
    # --repair: a table that differs (its files, or a writable table a writer changed) is staged anew as a clean
    # generation for new attaches, by the daemon's own reload (which stages every table the scheduled verify found
    # modified, and every table whose files changed)
    args.timeout = 3600.0
    status, failed = _call(args, protocol.STATUS, "verify --repair")
    if status is None:
        return failed
    tables = status.get("tables")
    listed: list = tables if isinstance(tables, list) else []
    modified = [t.get("table") for t in listed if isinstance(t, dict) and t.get("modified") is True]
    # a writable table this verify found changed, which the scheduled verify may not have seen yet: staged anew too
    writable = {t.get("table") for t in listed if isinstance(t, dict) and t.get("gpu_access") == "writable"}
    restage = sorted(name for name in differ if name in writable)
    if code == 0 and not modified:
        say("pled verify --repair: nothing to repair")
        return 0
    result, status_code = _call(args, protocol.RELOAD, "verify --repair", **({"restage": restage} if restage else {}))
    if result is None:
        return status_code
    try:
        _show_reload(result)
    except UNREADABLE as err:
        return _unreadable("verify --repair", "Reload", args, err)
    say("pled verify --repair: new attaches get the generation(s) above; processes attached to the old one keep "
        "it until they attach again")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pled",
                                description="Keep a large model's embedding tables resident in shared memory.")
    p.add_argument("--version", action="version", version=f"pled {__version__}")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="the least severe log lines shown (default %(default)s)")
    sub = p.add_subparsers(dest="command", required=True)
    config_help = f"config file (default ${config_file.ENV_VAR} or {config_file.DEFAULT_PATH})"
    layouts = list(LAYOUTS)
    # The commands that talk to a running daemon find its socket the same way.
    daemon = argparse.ArgumentParser(add_help=False)
    daemon.add_argument("-c", "--config", help=config_help + "; read for its socket")
    daemon.add_argument("--socket", help="the daemon's socket (default $PLED_SOCKET, else the config's)")

    s = sub.add_parser("inspect", help="validate a sidecar directory or glob, or a model checkpoint's PLE tables, "
                                       "and describe it")
    s.add_argument("path", help="a sidecar directory, a .safetensors file, a glob of them, or a model checkpoint")
    s.add_argument("--json", action="store_true", help="the same description as JSON")
    s.add_argument("--checkpoint", action="store_true",
                   help="read PATH as a model checkpoint: the PLE tables a `checkpoint` table would stage (the default "
                        "where PATH has a model.safetensors.index.json or holds PLE tensors)")
    s.set_defaults(func=_inspect)

    s = sub.add_parser("preflight", help="check that this host and cgroup can hold the configured tables")
    s.add_argument("-c", "--config", help=config_help)
    s.add_argument("--json", action="store_true", help="each table's figures and the verdict as JSON")
    s.set_defaults(func=_preflight)

    s = sub.add_parser("serve", help="run the daemon: preflight, stage, hold the tables until SIGTERM")
    s.add_argument("-c", "--config", help=config_help)
    s.set_defaults(func=_serve)

    s = sub.add_parser("status", parents=[daemon], help="what the running daemon holds, and who is attached")
    s.add_argument("--json", action="store_true", help="the same as --format json")
    s.add_argument("--format", choices=["text", "json", "prometheus"], default="text",
                   help="text, json, or prometheus: the metrics pled writes to metrics_file, on stdout, exit 0 "
                        "whenever pled answers (default %(default)s)")
    s.add_argument("--timeout", type=float, default=5.0,
                   help="seconds to wait for pled's answer before exit 3 (default %(default)s)")
    s.add_argument("--live", action="store_true",
                   help="exit 0 whenever pled answers within --timeout, staging or not; 3 when it does not "
                        "(a liveness probe: staging is alive, a pled that stopped answering is not)")
    s.set_defaults(func=_status)

    s = sub.add_parser("reload", parents=[daemon],
                       help="re-read the config; stage new or changed tables as new generations, then switch")
    s.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the reload (default 3600)")
    s.set_defaults(func=_reload)

    s = sub.add_parser("verify", parents=[daemon],
                       help="compare each table in memory with its source files, byte for byte")
    s.add_argument("table", nargs="?", help="one table (default: all)")
    s.add_argument("--repair", action="store_true",
                   help="where a table differs, have pled stage a clean generation for new attaches (a reload; root "
                        "or pled's user); exit 0 once it is staged")
    s.set_defaults(func=_verify)

    s = sub.add_parser("gpu-check", parents=[daemon],
                       help="as the vLLM user on the GPU host: what each device supports, the route each table takes "
                            "and why (operations.md, \"What a GPU must support\"); exit 4 without a device")
    s.add_argument("--json", action="store_true", help="the probe, each table's route and why, as one JSON document "
                                                       "(default: lines of text)")
    s.set_defaults(func=lambda args: __import__("pled.client.gpu.check", fromlist=["run"]).run(_socket_for(args),
                                                                                             args.json))

    makers.add_commands(sub, layouts)
    return p


def missing_module(err: ImportError) -> str:
    """One line for a module this environment lacks: which, where, and what to install (issue 47, item 1)."""
    if not isinstance(err, ModuleNotFoundError) or not err.name:
        return str(err)  # a message of pled's own (blake3's)
    return (f"needs the Python module {err.name}, which this environment ({sys.prefix}) does not have: it comes with "
            "pled's daemon extra (pip install 'pled[daemon]'); where pled runs as a service, run /usr/bin/pled "
            "instead")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logs.setup(args.log_level)
    try:
        return args.func(args)
    except PledError as err:
        log.error("%s", err, extra=journal.refusal_fields(err))
        return err.exit_status
    except ImportError as err:  # pled[client] alone (vLLM's environment): a module of the daemon's extra is missing
        say(f"pled {args.command}: {missing_module(err)}", file=sys.stderr)
        return EX_UNAVAILABLE
    except KeyboardInterrupt:
        return EX_INTERRUPTED
    except BrokenPipeError:  # `pled status --json | head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)  # stdout's last flush at exit then goes nowhere, silently
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0


if __name__ == "__main__":
    sys.exit(main())
