"""The long fuzz run (make fuzz): every parser of untrusted bytes (tests/parsers.py), coverage-guided by atheris
(libFuzzer over pled's own bytecode), from the seeds in tests/fuzz_corpus/<parser>/.

    python tools/fuzz.py                    # each parser FUZZ_SECONDS (default 120) seconds
    python tools/fuzz.py --seconds 600 --only header,config

For each parser, a child process runs libFuzzer for the time given; an input that raises anything but the parser's
documented error is a crash (the input is kept under .cache/fuzz/<parser>/ and the run fails), as is one libFuzzer
sees run past --input-timeout seconds. What libFuzzer kept (.cache/fuzz/<parser>/corpus) and the seeds are then timed
again outside the fuzzer (whose tracing slows pled's Python code, not json's C): each against json.loads of the same
bytes where they are JSON, else against json.loads of a well-formed document of as many bytes (tests/parsers.py's
``objects``); the slowest such ratio is reported with the inputs tried and the coverage libFuzzer counted.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
OUT = ROOT / ".cache" / "fuzz"
MAX_LEN = 65536  # bytes of one input libFuzzer makes: up to the call limit, past what any corpus seed holds
MIN_TIMED = 512  # inputs shorter than this are not timed: microseconds, all noise


def child(name: str, libfuzzer_args: list[str]) -> None:
    """In the fuzzing process: pled's modules instrumented, the parser under libFuzzer."""
    import atheris

    with atheris.instrument_imports(include=["pled"]):
        import parsers
    p = parsers.PARSERS[name]

    def one(data: bytes) -> None:
        try:
            p.parse(data)
        except p.errors:
            pass

    atheris.Setup([sys.argv[0], *libfuzzer_args], one)
    atheris.Fuzz()


def _time(parse, raw: bytes) -> float:
    def once() -> float:
        start = time.perf_counter()
        try:
            parse(raw)
        except Exception:  # noqa: BLE001  refusals are timed too
            pass
        return time.perf_counter() - start

    loops = max(1, int(0.005 / max(once(), 1e-7)))
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(loops):
            try:
                parse(raw)
            except Exception:  # noqa: BLE001
                pass
        samples.append((time.perf_counter() - start) / loops)
    return statistics.median(samples)


def slowest(name: str, dirs: list[Path]) -> tuple[float, str, int, int]:
    """(ratio, input's file, its size, inputs timed) of the input slowest against json.loads (see the top)."""
    import parsers

    p = parsers.PARSERS[name]
    worst = (0.0, "", 0)
    timed = 0
    for d in dirs:
        for f in sorted(d.iterdir()) if d.is_dir() else []:
            raw = f.read_bytes()
            if len(raw) < MIN_TIMED or not f.is_file():
                continue
            try:
                json.loads(raw)
                reference = raw
            except (ValueError, RecursionError):
                reference = parsers._objects(len(raw))
            ratio = _time(p.parse, raw) / _time(json.loads, reference)
            timed += 1
            if ratio > worst[0]:
                worst = (ratio, str(f.relative_to(ROOT)), len(raw))
    return (*worst, timed)


def run(name: str, seconds: int, input_timeout: int) -> dict:
    work = OUT / name
    corpus = work / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    seeds = ROOT / "tests" / "fuzz_corpus" / name
    args = [f"-max_total_time={seconds}", f"-max_len={MAX_LEN}", f"-timeout={input_timeout}", "-print_final_stats=1",
            f"-artifact_prefix={work}/", "-rss_limit_mb=4096", str(corpus), str(seeds)]
    r = subprocess.run([sys.executable, __file__, "--child", name, "--", *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=seconds + 600)
    out = r.stdout + r.stderr
    runs = re.findall(r"Done (\d+) runs in (\d+) second", out)
    cov = re.findall(r"cov: (\d+) ft: (\d+)", out)
    ratio, where, size, timed = slowest(name, [corpus, seeds])
    return {"parser": name, "exit": r.returncode, "runs": int(runs[-1][0]) if runs else None,
            "seconds": int(runs[-1][1]) if runs else None, "cov": int(cov[-1][0]) if cov else None,
            "ft": int(cov[-1][1]) if cov else None, "corpus": len(list(corpus.iterdir())), "timed": timed,
            "slowest_ratio": round(ratio, 2), "slowest_input": where, "slowest_bytes": size,
            "tail": "" if r.returncode == 0 else out[-3000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=int(os.environ.get("FUZZ_SECONDS", "120")),
                    help="libFuzzer's time for each parser (default $FUZZ_SECONDS or 120)")
    ap.add_argument("--only", help="parsers, comma-separated (default: all of tests/parsers.py)")
    ap.add_argument("--input-timeout", type=int, default=10, help="seconds one input may take (libFuzzer -timeout)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.rest)
        return 0
    import parsers

    names = args.only.split(",") if args.only else list(parsers.PARSERS)
    failed = 0
    for name in names:
        result = run(name, args.seconds, args.input_timeout)
        print(json.dumps({k: v for k, v in result.items() if k != "tail"}), flush=True)
        if result["exit"] != 0:
            failed += 1
            print(result["tail"], file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
