"""Issue 32: every parser of untrusted bytes (tests/parsers.py lists them) ends, on any input up to its limit,
accepted or refused with its documented error, in time linear in its size: time(2n) <= 2.5 x time(n) on its worst
inputs (or, where the input is well-formed JSON, at most 1.25 times json.loads's own doubling of the same bytes,
where memory makes that more than 2), and, on well-formed JSON, at most JSON_BUDGET times what json.loads takes for
the same bytes. Times are ratios of medians measured side by side, never absolute figures, and CPU times of the parsing
thread (time.thread_time), which another process on the same core does not lengthen as it does wall time.

The short fuzz run is Hypothesis's, from the seeds in tests/fuzz_corpus/ (small forms of the worst shapes, written by
`python tests/parsers.py`) and arbitrary bytes; `make fuzz` runs the long, coverage-guided one (tools/fuzz.py).
"""
from __future__ import annotations

import gc
import json
import re
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from parsers import CORPUS, JSON_WORST, PARSERS, corpus
from pled.daemon.sources import naming
from pled.shared import boundary, protocol

DOUBLING_BUDGET = 2.5  # time(2n) / time(n) on a worst input: 2 is linear, 4 quadratic
JSON_BUDGET = 10.0  # a parser's time / json.loads's, same bytes: at most 7.0 idle (an index of PLE names; 9.1, and
# 10.0 on a loaded host, while each name's file name took two calls to check)
REPEATS = 7
T = TypeVar("T")
ATTEMPTS = 5  # measurements of a ratio over its budget before it counts (_measured)
JSON_DOUBLING_SLACK = 1.25  # a parser's doubling over json.loads's on the same JSON (_doubling_beside_json)


def _once(parse, raw: bytes) -> float:
    """The CPU time this thread spends parsing, not the wall time: the other processes of a busy machine take the
    core away for a while (wall time, which failed these ratios with both cores busy), not this thread's CPU time."""
    start = time.thread_time()
    try:
        parse(raw)
    except Exception:  # noqa: BLE001  what is refused is timed as well
        pass
    return time.thread_time() - start


def _medians(*runs: tuple[Callable[[bytes], object], bytes]) -> list[float]:
    """Medians of REPEATS runs of each (parse, raw), interleaved so that the machine's noise falls on all alike."""
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(REPEATS):
        for t, (parse, raw) in zip(times, runs, strict=True):
            t.append(_once(parse, raw))
    return [statistics.median(t) for t in times]


def _measured(measure: Callable[[], T], within: Callable[[T], bool], worse: Callable[[T], float]) -> T:
    """``measure()`` again (at most ATTEMPTS times in all) while not ``within`` its bound: noise only adds time,
    so the best try (least ``worse``) is the honest figure; an input quadratic in its size is over every time.
    Thread CPU time still grows when another process shares the core's caches: three tries were all over for a
    checkpoint index of brackets (2.1 idle) while cosmic-ray and the whole suite ran beside it.
    The objects the test session made so far are frozen out of the garbage collector meanwhile (gc.freeze): its
    passes over them would be charged to whichever side allocates more, as they are in no fresh process."""
    best: T | None = None
    gc.collect()
    gc.freeze()
    try:
        for _ in range(ATTEMPTS):
            got = measure()
            if best is None or worse(got) < worse(best):
                best = got
            if within(got):
                return got
    finally:
        gc.unfreeze()
    assert best is not None
    return best


def _ratio(parse_a, a: bytes, parse_b, b: bytes, budget: float) -> float:
    """time(parse_b(b)) / time(parse_a(a)), a ratio of medians, measured until within ``budget`` (_measured)."""
    def measure() -> float:
        ta, tb = _medians((parse_a, a), (parse_b, b))
        return tb / ta

    return _measured(measure, lambda r: r <= budget, lambda r: r)


def _size(limit: int) -> int:
    """A worst input's size n (and 2n, within the limit): 128 KiB, where what it builds stays in this machine's
    caches (at 1 MiB, json.loads alone took 2.2 to 2.5 times as long for twice the lists: memory, not work; a
    checkpoint index of brackets 2.4 at 256 KiB, 2.1 at 128 KiB), and each run is repeated until it is timed above
    the noise (_calibrated)."""
    return min(limit // 3, 128 * 1024)


def _loops(parse, raw: bytes, at_least: float = 0.02) -> int:
    """How often ``parse`` must run on ``raw`` to take ``at_least`` seconds (once, where one run takes that long
    already), so that inputs parsed in microseconds are timed above the clock's noise."""
    return max(1, int(at_least / max(_once(parse, raw), 1e-7)))


def _repeated(parse, loops: int):
    return lambda b: [parse(b) for _ in range(loops)]


def _calibrated(parse, raw: bytes):
    return _repeated(parse, _loops(parse, raw))


def _doubling(parse, make, n: int) -> float:
    """time(make(2n)) / time(make(n)), medians, each run repeated as often as the small one needs (_loops)."""
    small, large = make(n), make(2 * n)
    timed = _calibrated(parse, small)
    return _ratio(timed, small, timed, large, DOUBLING_BUDGET)


def _doubling_beside_json(parse, make, n: int) -> tuple[float, float]:
    """(the parser's doubling, json.loads's doubling of the same bytes), their runs interleaved, measured until the
    parser's is within _json_doubling_bound (_measured). json.loads's own doubling is not 2 where what it builds
    outgrows the caches: on a checkpoint index of brackets (`[[],[],...]`) it is 2.1 idle and 3.0 to 3.9 with both
    cores busy (stress-ng --cpu 2); no parser built on it can do better, and the parser's own work stays within a
    fraction of it."""
    small, large = make(n), make(2 * n)
    mine, theirs = _calibrated(parse, small), _calibrated(json.loads, small)

    def measure() -> tuple[float, float]:
        a, b, c, d = _medians((mine, small), (mine, large), (theirs, small), (theirs, large))
        return b / a, d / c

    return _measured(measure, lambda r: r[0] <= _json_doubling_bound(r[1]), lambda r: r[0] / max(r[1], 1e-9))


def _json_doubling_bound(baseline: float) -> float:
    """A parser's doubling on JSON: DOUBLING_BUDGET, or JSON_DOUBLING_SLACK times json.loads's (``baseline``)."""
    return max(DOUBLING_BUDGET, JSON_DOUBLING_SLACK * baseline)


WORST = [(name, shape) for name, p in PARSERS.items() for shape in p.worst]
VALID = [(name, shape) for name, p in PARSERS.items() for shape in p.worst if shape in p.valid]


def test_the_corpus_holds_every_worst_shape_of_every_parser():
    for name, p in PARSERS.items():
        seeds = {s.name for s in (CORPUS / name).iterdir()}
        assert {"worst-" + shape.replace(" ", "-").replace("'", "") for shape in p.worst} <= seeds, name
        assert any(s.startswith("ordinary") for s in seeds), name


@pytest.mark.slow
@pytest.mark.parametrize("name, shape", WORST, ids=[f"{n}-{s}" for n, s in WORST])
def test_a_worst_input_twice_as_long_takes_at_most_two_and_a_half_times_as_long(name, shape):
    """At most 2.5 times as long; where the input is JSON, or at most JSON_DOUBLING_SLACK times json.loads's own
    doubling of the same bytes, measured beside it (memory, not the parser's work, makes that more than 2)."""
    p = PARSERS[name]
    n = _size(p.limit)
    assert len(p.worst[shape](2 * n)) <= p.limit
    small, large = len(p.worst[shape](n)), len(p.worst[shape](2 * n))
    if shape not in p.valid:
        ratio = _doubling(p.parse, p.worst[shape], n)
        assert ratio <= DOUBLING_BUDGET, f"{name}, {shape}: {small} -> {large} bytes took {ratio:.2f}x as long"
        return
    ratio, baseline = _doubling_beside_json(p.parse, p.worst[shape], n)
    assert ratio <= _json_doubling_bound(baseline), \
        f"{name}, {shape}: {small} -> {large} bytes took {ratio:.2f}x as long (json.loads: {baseline:.2f}x)"


@pytest.mark.slow
@pytest.mark.parametrize("name, shape", VALID, ids=[f"{n}-{s}" for n, s in VALID])
def test_a_worst_json_input_costs_at_most_ten_json_loads_of_it(name, shape):
    p = PARSERS[name]
    raw = p.worst[shape](min(p.limit, 1 << 20))
    json.loads(raw)  # well-formed: json.loads reads all of it
    loops = _loops(json.loads, raw)  # the same number of runs of each, enough to be timed above the noise
    ratio = _ratio(_repeated(json.loads, loops), raw, _repeated(p.parse, loops), raw, JSON_BUDGET)
    assert ratio <= JSON_BUDGET, f"{name}, {shape}: {ratio:.1f}x json.loads of the same {len(raw)} bytes"


def test_a_call_of_escaped_quotes_is_refused_in_time_linear_in_its_size():
    """Finding 1: a 65,534-byte call made of escaped quotes held the loop 16.7 s (boundary.depth's regex: 16 KiB
    1.3 s, 32 KiB 5.2 s). Here 16 and 32 KiB of it, refused as it must be, in linear time."""
    p = PARSERS["call"]
    with pytest.raises(ValueError, match="not JSON"):
        p.parse(p.worst["escaped quotes outside strings"](protocol.MAX_CALL - 2))
    ratio = _doubling(p.parse, p.worst["escaped quotes outside strings"], 16 * 1024)
    assert ratio <= DOUBLING_BUDGET, f"32 KiB took {ratio:.1f}x as long as 16 KiB"


@pytest.mark.parametrize("name", ["header", "meta", "reply", "manifest", "index"])
def test_every_json_file_and_reply_of_escaped_quotes_is_refused_in_linear_time(name):
    """Findings 2 and 3: the same text as a shard header hung `pled inspect` (192 KiB: still running after 20 s),
    froze a reload's loop 12-14 s, and as a reply or a manifest overran a client's timeout."""
    p = PARSERS[name]
    ratio = _doubling(p.parse, p.worst["escaped quotes outside strings"], 16 * 1024)
    assert ratio <= DOUBLING_BUDGET, f"{name}: 32 KiB took {ratio:.1f}x as long as 16 KiB"


def test_a_shape_of_60000_extents_is_refused_at_the_cost_of_a_few_json_loads():
    """Finding 4: a 1.3 MB header with a shape of 60,000 extents of 10**19 and a 0 took 12.1 s to refuse (the
    product first); its rank is refused now before any product, at a few times json.loads of the same bytes."""
    p = PARSERS["header"]
    raw = p.worst["shape of many extents"](1_260_000)
    with pytest.raises(p.errors, match="has 60001 dimensions; at most 64"):
        p.parse(raw)
    loops = _loops(json.loads, raw)  # the same number of runs of each
    baseline, parser = _repeated(json.loads, loops), _repeated(p.parse, loops)
    base, first = _once(baseline, raw), _once(parser, raw)
    ratio = first / base if first > 10 * JSON_BUDGET * base else _ratio(baseline, raw, parser, raw, JSON_BUDGET)
    assert ratio <= JSON_BUDGET, f"{ratio:.1f}x json.loads"


def test_a_config_of_long_dotted_keys_is_refused_in_linear_time():
    """tomllib's time for a dotted key grows with the square of its parts (16 KiB: 2 s): a line holds at most
    config_file.MAX_DOTS dots, counted before tomllib reads anything."""
    p = PARSERS["config"]
    with pytest.raises(p.errors, match="line 1 holds 4096 dots; at most 64"):
        p.parse(p.worst["dotted key"](8192))
    for shape in ("dotted key", "dotted table"):
        ratio = _doubling(p.parse, p.worst[shape], 8 * 1024)
        assert ratio <= DOUBLING_BUDGET, f"{shape}: 16 KiB took {ratio:.1f}x as long as 8 KiB"


def test_a_message_trickled_a_byte_at_a_time_is_searched_once():
    """The framers look for a message's NUL once per byte, however the stream is cut: a reply trickled in one byte
    at a time (the client's framing of up to 8 MiB, the daemon's of up to 64 KiB) costs twice as much for twice
    the bytes, not four times."""
    def trickle(raw: bytes) -> None:
        framer = protocol.Framer(protocol.MAX_REPLY)
        for i in range(len(raw)):
            framer.feed(raw[i:i + 1])

    ratio = _doubling(trickle, lambda n: b"x" * n, 128 * 1024)
    assert ratio <= DOUBLING_BUDGET, f"256 KiB trickled took {ratio:.1f}x as long as 128 KiB"


def test_numbers_are_checked_wherever_one_could_be_too_long_or_infinite():
    for text, words in ((b"[123456789012345678901]", "21 digits"), (b'{"a":[1E+0400]}', "out of range"),
                        (b"[1e400]", "out of range"), (b"[-" + b"9" * 5000 + b"]", "5000 digits")):
        with pytest.raises(boundary.BoundaryError, match=words):
            boundary.load_json(text, max_bytes=1 << 20)
    assert boundary.load_json(b"[18446744073709551615, 1.5e308, -1e-400]", max_bytes=100) == [2**64 - 1, 1.5e308,
                                                                                               -0.0]


_NUMBERED = re.compile(r"^(?P<prefix>.*?)(?P<n>\d+)\.safetensors$")  # what sidecar.py matched names with once
_OF = re.compile(r"^(?P<prefix>.*?)-(?P<n>\d+)-of-(?P<total>\d+)\.safetensors$")


@settings(max_examples=1000, deadline=None)
@given(st.text(alphabet="01239-ofx_.\u0663", max_size=24).map(lambda s: s + ".safetensors") | st.text(max_size=30))
@example("model-00001-of-00004.safetensors")
@example("a-1-of-2-of-3.safetensors")
def test_shard_names_are_read_as_the_patterns_read_them(name):
    m, o = _NUMBERED.match(name), _OF.match(name)
    assert naming.numbered(name) == (m and (m["prefix"], int(m["n"])))
    assert naming.numbered_of(name) == (o and (o["prefix"], int(o["n"]), int(o["total"])))


def test_a_directory_of_long_numbered_names_is_read_in_linear_time(tmp_path):
    """A shard's name is read from its end with str methods: the lazy pattern took 1.7 ms for one name of 240
    digits (any number of which a directory may hold), growing with the square of its digits."""
    def names(n: int) -> list[str]:
        return ["1" * n + "x.safetensors"] * 200

    ratio = _doubling(lambda ns: [naming.numbered(x) for x in ns], names, 100)
    assert ratio <= DOUBLING_BUDGET, f"names of 200 digits took {ratio:.1f}x as long as of 100"


# -- the short fuzz run ---------------------------------------------------------------------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=40)
_jsonish = st.text(alphabet='[]{}"\\:,0123456789.eE+-aun ', max_size=300).map(str.encode)


def _nesting(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_nesting, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_nesting, value), default=0)
    return 0


@settings(max_examples=400, deadline=None)
@given(_json_values)
def test_the_depth_of_any_json_document_is_counted_exactly(value):
    raw = json.dumps(value).encode()
    assert boundary.depth(raw) == _nesting(value)
    assert boundary.depth(json.dumps(value, indent=1, ensure_ascii=False).encode()) == _nesting(value)


@settings(max_examples=600, deadline=None)
@given(st.one_of(_jsonish, st.binary(max_size=300)))
@example(b'"\\\\"[[["')
@example(b'["\\\\\\"[["]')
def test_the_depth_counted_is_never_less_than_json_reaches(raw):
    """Text json.loads accepts nests as deep as counted; text it refuses may be counted any way, but never less
    deep than the part json.loads read before refusing (so a depth check before parsing always holds)."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return
    assert boundary.depth(raw) == _nesting(value)


def _fuzz(name: str):
    p = PARSERS[name]
    seeds = corpus(name)

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.one_of(st.sampled_from(seeds), st.binary(max_size=2048), _jsonish,
                     _json_values.map(lambda v: json.dumps(v).encode()),
                     st.tuples(st.sampled_from(seeds), st.binary(max_size=16), st.integers(0, 4096)).map(
                         lambda t: t[0][:t[2]] + t[1] + t[0][t[2]:])))
    def check(raw):
        try:
            p.parse(raw)
        except p.errors:
            pass

    return check


@pytest.mark.parametrize("name", list(PARSERS))
def test_any_input_is_accepted_or_refused_with_the_parsers_documented_error(name):
    """The short fuzz run: the corpus's seeds, seeds with bytes put in, arbitrary bytes and JSON; anything but the
    parser's documented error fails (Hypothesis shrinks it to the smallest such input)."""
    _fuzz(name)()


def test_the_worst_shapes_are_json_where_the_table_says_so():
    for p in PARSERS.values():
        for shape in p.valid:
            json.loads(p.worst[shape](4096))
    assert set(JSON_WORST) - {"escaped quotes outside strings"} <= PARSERS["reply"].valid
