"""Mutation testing of the modules named, by cosmic-ray, against the fast lane plus the tests named.

    make mutants MODULES="pled/daemon/health/throttle.py" TESTS="tests/test_attack_clients.py::test_a_budget..."
    python tools/mutants.py --modules pled/x.py [pled/y.py ...] [--tests TEST ...] [--since REF] [--timeout S]
    make mutants MODULES="..." TESTS="..." SINCE=99998da   # only the lines changed since that commit

cosmic-ray (8.7.0, pyproject.toml's ``mutants`` extra) writes each mutant into the module's file on disk and puts
the file back after its tests, so everything the tests start (`pled serve`, vLLM's processes) runs the mutant too.
The session holds the named modules only. For each mutant the named tests run first (``-x``: the first failure
kills it), then, only where they all pass, the fast lane without them (``-m "not daemon and not root and not vllm
and not slow"``, ``-x``). A mutant is killed when a test fails and survives when every one passes; one whose tests
overstay the timeout (by default four times the unbroken run, at least a minute) is killed by cosmic-ray's rule,
and counted apart here as a timeout: a busy machine can make one. A line with ``# pragma: no mutate`` is left
alone (cosmic-ray's cr-filter-pragma). With ``--since REF`` only the mutants on lines changed since REF (``git diff
REF``, cosmic-ray's cr-filter-git) run: the lines an issue changed, in the modules it changed.

Printed: a line per mutant as it ends, then the mutants, killed, timeouts, survived and those that could not run,
and each survivor's place (file:line:column), operator and its line as the mutant has it: a survivor is a change
no test noticed, either one a user would see (a test is missing) or an equivalent one (nothing can see it).

Every module is restored afterwards, whatever happens (an interrupt, a crash of cosmic-ray): its bytes from before
the run are written back where they differ, and ``git status`` of the modules is checked against what it was.
Run it in a checkout nobody is editing. Exit status 0 when every mutant was killed, 1 when some survived, 2 when
the tests fail unbroken or a module could not be restored.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAST_LANE = "not daemon and not root and not vllm and not slow"
BIN = Path(sys.executable).parent


def run_tests(tests: list[str]) -> int:
    """The test command of every mutant: the named tests, then (where they pass) the fast lane without them. Its
    process group is written where the driver finds it, so an interrupt ends every process a test started."""
    pgid_file = Path(os.environ.get("PLED_MUTANTS_PGID", "/nonexistent/pgid"))
    if pgid_file.parent.is_dir():
        pgid_file.write_text(str(os.getpgid(0)))  # cosmic-ray starts each run in a session (and group) of its own
    pytest = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--no-header"]
    try:
        if tests:
            rc = subprocess.call([*pytest, *tests], cwd=ROOT)
            if rc != 0:
                return rc
        left_out = [f"--deselect={t}" if "::" in t else f"--ignore={t}" for t in tests]
        rc = subprocess.call([*pytest, "-m", FAST_LANE, *left_out], cwd=ROOT)
        return 0 if rc == 5 else rc  # 5: every fast test was among the named ones
    finally:
        pgid_file.unlink(missing_ok=True)


def _git_status(modules: list[str]) -> str:
    return subprocess.run(["git", "status", "--porcelain", "--", *modules], cwd=ROOT, capture_output=True,
                          text=True).stdout


def _restore(originals: dict[Path, bytes]) -> list[Path]:
    """Write back every module whose bytes differ from before the run: the ones restored."""
    restored = []
    for path, data in originals.items():
        if path.read_bytes() != data:
            path.write_bytes(data)
            restored.append(path)
    return restored


def _kill_group(pgid_file: Path) -> None:
    """End the test run under way, if any: its process group (pytest and whatever it started), led by this
    script's --run-tests, never this process's own group."""
    try:
        pgid = int(pgid_file.read_text())
        leader = Path(f"/proc/{pgid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return  # none under way, or it ended meanwhile
    if pgid != os.getpgid(0) and b"--run-tests" in leader:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _where(item) -> str:
    m = item.mutations[0]
    path = Path(m.module_path)
    shown = path.relative_to(ROOT) if path.is_absolute() and path.is_relative_to(ROOT) else path
    return f"{shown}:{m.start_pos[0]}:{m.start_pos[1]}"


def _mutated_line(diff: str | None) -> str:
    lines = [line[1:].strip() for line in (diff or "").splitlines()
             if line.startswith("+") and not line.startswith("+++")]
    return lines[0] if lines else "?"


def _outcome(result) -> str:
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    if result.worker_outcome == WorkerOutcome.SKIPPED:
        return "skipped"
    if result.worker_outcome != WorkerOutcome.NORMAL:
        return "incompetent"
    if result.test_outcome == TestOutcome.KILLED:
        return "timeout" if result.output == "timeout" else "killed"
    return "survived" if result.test_outcome == TestOutcome.SURVIVED else "incompetent"


def _results(session: Path) -> list:
    """The mutants done so far: (work item, result)."""
    from cosmic_ray.work_db import WorkDB, use_db

    with use_db(str(session), WorkDB.Mode.open) as db:
        return list(db.completed_work_items)


def _pending(session: Path) -> int:
    from cosmic_ray.work_db import WorkDB, use_db

    with use_db(str(session), WorkDB.Mode.open) as db:
        return sum(1 for _ in db.pending_work_items)


def _report(done: list, total: int, seconds: float) -> int:
    counts = {k: 0 for k in ("killed", "timeout", "survived", "incompetent", "skipped")}
    survivors = []
    for item, result in done:
        kind = _outcome(result)
        counts[kind] += 1
        if kind == "survived":
            survivors.append(f"  {_where(item)}  {item.mutations[0].operator_name}  ->  {_mutated_line(result.diff)}")
    ran = total - counts["skipped"]
    print(f"\n{ran} mutants ({counts['skipped']} left out: pragma, or lines not changed), {counts['killed']} killed, "
          f"{counts['timeout']} "
          f"timeouts, {counts['survived']} survived, {counts['incompetent']} could not run, "
          f"{total - len(done)} not run; {seconds / 60:.1f} min")
    if survivors:
        print("survivors (place, operator, the line as the mutant has it):")
        print("\n".join(survivors))
    return 1 if survivors or counts["incompetent"] else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modules", nargs="*", default=[], help="the .py files to mutate")
    p.add_argument("--tests", nargs="*", default=[], help="test files or node ids, run before the fast lane")
    p.add_argument("--timeout", type=float, help="seconds for one mutant's tests (default: 4 x the unbroken run)")
    p.add_argument("--session", help="keep cosmic-ray's session (sqlite) here, for cr-report or cr-html")
    p.add_argument("--since", help="only the lines changed since this git commit (git diff REF)")
    p.add_argument("--run-tests", action="store_true", help=argparse.SUPPRESS)  # the test command of each mutant
    a = p.parse_args()
    if a.run_tests:
        return run_tests(a.tests)
    modules = [str(Path(m)) for m in a.modules]
    missing = [m for m in modules if not (ROOT / m).is_file() or not m.endswith(".py")]
    if not modules or missing:
        print(f"name the modules to mutate: Python files of this checkout (not: {', '.join(missing) or 'none given'})")
        return 2
    originals = {ROOT / m: (ROOT / m).read_bytes() for m in modules}
    status_before = _git_status(modules)

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        return _run(modules, a.tests, a.timeout, a.session, originals, status_before, a.since)
    except KeyboardInterrupt:
        print("interrupted")
        return 130


def _run(modules: list[str], tests: list[str], timeout: float | None, keep: str | None, originals: dict[Path, bytes],
         status_before: str, since: str | None = None) -> int:
    with tempfile.TemporaryDirectory(prefix="pled-mutants-") as tmp:
        pgid_file = Path(tmp) / "pgid"
        os.environ["PLED_MUTANTS_PGID"] = str(pgid_file)
        command = shlex.join([sys.executable, str(Path(__file__).resolve()), "--run-tests", "--tests", *tests])
        config, session = Path(tmp) / "cosmic-ray.toml", Path(keep or Path(tmp) / "session.sqlite")
        log = Path(tmp) / "cosmic-ray.log"
        proc = None
        try:
            started = time.monotonic()
            rc = subprocess.call(shlex.split(command), cwd=ROOT, stdout=subprocess.DEVNULL, start_new_session=True)
            baseline = time.monotonic() - started
            if rc != 0:
                print(f"the tests fail without any mutant (exit {rc}, {baseline:.0f} s); fix them first: {command}")
                return 2
            timeout = timeout or max(60.0, 4 * baseline)
            print(f"unbroken: the named tests and the fast lane pass in {baseline:.0f} s; {timeout:.0f} s a mutant")
            config.write_text(_config(modules, command, timeout, since))
            started = time.monotonic()
            subprocess.run([str(BIN / "cosmic-ray"), "init", "--force", str(config), str(session)], cwd=ROOT,
                           check=True)
            subprocess.run([str(BIN / "cr-filter-pragma"), str(session)], cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL)
            if since:
                subprocess.run([str(BIN / "cr-filter-git"), "--config", str(config), str(session)], cwd=ROOT,
                               check=True, stdout=subprocess.DEVNULL)
            total = len(_results(session)) + _pending(session)
            print(f"{total} mutants in {', '.join(modules)}")
            with open(log, "w") as out:
                proc = subprocess.Popen([str(BIN / "cosmic-ray"), "exec", str(config), str(session)], cwd=ROOT,
                                        stdout=out, stderr=subprocess.STDOUT)
            shown = {item.job_id for item, result in _results(session)}
            while True:
                ended = proc.poll() is not None
                try:
                    done = _results(session)
                except sqlite3.OperationalError:  # cosmic-ray writing a result just then
                    done = []
                for item, result in done:
                    if item.job_id not in shown:
                        shown.add(item.job_id)
                        print(f"{len(shown)}/{total} {_outcome(result):9} {_where(item)} "
                              f"{item.mutations[0].operator_name}", flush=True)
                if ended:
                    break
                time.sleep(2)
            done = _results(session)
            if proc.returncode != 0:
                print(f"cosmic-ray exec ended with {proc.returncode}:\n{log.read_text()[-3000:]}")
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            _kill_group(pgid_file)
            for path in _restore(originals):
                print(f"restored {path.relative_to(ROOT)}, which cosmic-ray had left mutated")
            status_after = _git_status(modules)
            if status_after != status_before:
                print(f"git status of the modules differs from before the run:\n{status_before}\nnow:\n{status_after}")
        if status_after != status_before:
            return 2
        print(f"every module as it was (git status of {len(modules)} module(s) unchanged)")
        return _report(done, total, time.monotonic() - started)


def _config(modules: list[str], command: str, timeout: float, since: str | None = None) -> str:
    """cosmic-ray's config: TOML, whose strings and lists are written here as JSON writes them (valid TOML for
    these values: strings with \\" and \\\\ escapes, lists of strings, a float)."""
    return "\n".join([
        "[cosmic-ray]",
        # relative to the checkout (cosmic-ray runs there): cr-filter-git matches them against `git diff --relative`
        f"module-path = {json.dumps(modules)}",
        f"timeout = {timeout:.1f}",
        "excluded-modules = []",
        f"test-command = {json.dumps(command)}",
        "",
        "[cosmic-ray.distributor]",
        'name = "local"',
        "",
        *(["[cosmic-ray.filters.git-filter]", f"branch = {json.dumps(since)}", ""] if since else []),
    ])


if __name__ == "__main__":
    sys.exit(main())
