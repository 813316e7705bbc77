"""Where untrusted bytes enter pled: socket messages, safetensors headers, META.json, digest lists, the config.

Everything a peer or a file hands pled passes through here first, with stated bounds:

- ``open_regular`` opens a path as the regular file it must be: ``stat`` first (so a FIFO, socket or
  device is never even opened), then ``O_NONBLOCK`` and ``fstat`` again (so a file swapped for a FIFO in
  between cannot block), and /proc or /sys files are refused outright. A symlink loop, a missing file or a
  permission problem becomes one ``OSError``-free refusal naming the file.
- ``read_bounded`` reads at most a stated number of bytes, and refuses a file that is larger.
- ``load_json`` parses UTF-8 JSON no deeper than ``max_depth``, with integers of at most ``MAX_INT_DIGITS``
  digits, no NaN or Infinity, and no key twice in one object. Python's ``json`` has no depth limit of its
  own (it recurses until RecursionError) and turns any digit string into an int, so the depth is measured
  before parsing, and integers are checked by the hook that would build them.

Every parser here runs in time linear in its input, whatever the input (tests/test_parsers_linear.py holds each
to it, against ``json.loads`` of the same bytes): no backtracking regular expression meets untrusted text, no
number is converted before its digits are counted, nothing recurses on what a peer or a file nests.
- ``deadline`` bounds a parse by a caller's time (a client's ``timeout``): the parsers check ``in_time()`` every
  few thousand objects or entries and raise ``OutOfTime`` once the deadline has passed.
- ``printable`` escapes every character a terminal or a log viewer would act on; ``clip`` also shortens
  what a peer or file said before it goes into a log line or an error. The log formatter
  (pled.daemon.health.logs), systemd's STATUS= and ``pled status`` pass everything through ``printable``.

Every refusal is a ``BoundaryError`` (a ``ValueError``), which the caller turns into its own error type
naming the object: ``SidecarError`` for a shard, ``ConfigError`` for the config, an InvalidMessage reply for
a peer.
"""
from __future__ import annotations

import json
import time
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from itertools import accumulate, count

from pled.shared.boundary_error import BoundaryError
from pled.shared.regular_files import (  # noqa: F401 (boundary is where callers find them)
    check_regular,
    describe_os_error,
    open_regular,
    read_bounded,
)

MAX_INT_DIGITS = 20  # 2**64 - 1 has 20 digits: no size, offset or shape pled accepts needs more
MAX_DEPTH = 16  # a call nests 2 levels, a header 3, META.json a few
MAX_CLIP = 200  # characters of a peer's or file's text quoted back in a log line or an error

_NOT_MARKS = bytes(set(range(256)) - set(b'"[]{},'))  # all but quotes, brackets and commas: nesting and counts
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # an opening bracket one level down, a closing one up (-1)
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
_DEPTH_CHUNK = 1 << 16  # brackets counted at a time, so that text past the limit is never counted
# Where no run of 21 digits and no exponent of 3 digits is anywhere in the text, no integer has more than 20 digits
# and no number overflows to infinity: json.loads then builds numbers itself, a third of the time of the hooks that
# check each one. Found by bytes methods (digits -> 0, e and E -> e, + kept, all else -> .): linear.
_NUMBER_SHAPES = bytes(0x30 if 0x30 <= c <= 0x39 else 0x65 if c in b"eE" else 0x2b if c == 0x2b else 0x2e
                       for c in range(256))


def _numbers_to_check(data: bytes) -> bool:
    shapes = data.translate(_NUMBER_SHAPES)
    return b"0" * (MAX_INT_DIGITS + 1) in shapes or b"e000" in shapes or b"e+000" in shapes


class OutOfTime(Exception):
    """A parse ran past the deadline its caller set (``deadline``); not a fault of the input as such."""


_DEADLINE: ContextVar[float | None] = ContextVar("pled_parse_deadline", default=None)
_TICKS = count()  # calls of a hook, to look at the clock only every _EVERY of them
_EVERY = 1024


@contextmanager
def deadline(when: float | None) -> Iterator[None]:
    """Within this block, parsers (load_json's objects, records.fields_of, a manifest's checks) raise OutOfTime
    once ``time.monotonic()`` is past ``when`` (None: no deadline). Per thread and task (a ContextVar)."""
    token = _DEADLINE.set(when)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def in_time(every: int = 1) -> None:
    """Raise OutOfTime if the deadline set by ``deadline`` has passed; with ``every`` > 1, looks at the clock on
    one call of that many only (a hook called per object)."""
    if every > 1 and next(_TICKS) % every:
        return
    when = _DEADLINE.get()
    if when is not None and time.monotonic() > when:
        raise OutOfTime(f"ran {time.monotonic() - when:.3g} s past its deadline")


def printable(text: object) -> str:
    """``text`` safe for a terminal and a log line: every character that is not printable (Unicode's
    categories C and Z other than the space: ESC, BEL, the C1 control U+009B, bidirectional overrides,
    U+2028 and U+2029, which log viewers break lines on) written as an escape, as repr() would."""
    s = str(text)
    if s.isprintable():
        return s
    # one translate table of the characters it holds (a set and a translate run at C speed: a character at a time
    # in Python took 280 microseconds a KiB, and a peer's 64 KiB of DEL held the loop 18 ms a call)
    table = {ord(c): _ESCAPES.get(c) or _escape(c) for c in set(s) if not c.isprintable()}
    return s.translate(table)


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def say(text: object, file=None) -> None:
    """One line of the pled command's output for a person: ``print`` of ``printable(text)``."""
    print(printable(text), file=file)


def clip(text: object, limit: int = MAX_CLIP) -> str:
    """``text`` as it may go into one log line: printable (see ``printable``), at most ``limit`` characters. Only
    what is shown is escaped: the cost is the limit's, whatever the text's length."""
    raw = str(text)
    s = printable(raw[:limit + 1])
    return s if len(raw) <= limit and len(s) <= limit else f"{s[:limit]}... ({len(raw)} characters)"


# -- JSON ----------------------------------------------------------------------------------------

def outside_strings(raw: bytes) -> bytes:
    """The brackets and commas of UTF-8 JSON text ``raw`` that lie outside its strings, in order.

    Linear in ``raw``, as a few passes of ``bytes`` methods: escaped backslashes and escaped quotes go first (a run
    of backslashes pairs up from its start, as JSON reads it), so every quote left opens or closes a string; of the
    quotes, brackets and commas, a quote next to a quote goes in pairs (which keeps every other quote's parity), and
    what lies between an odd quote and the next is a string's. (A regular expression for strings,
    ``"[^"\\\\]*(?:\\\\.[^"\\\\]*)*"``, did this in time that grew with the square of the input on text of escaped
    quotes: each quote began a match that ran to the end and failed.) Text that is not JSON may be read any way:
    json.loads refuses it at or before the first place where this reading and JSON's part."""
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = text.translate(None, _NOT_MARKS).replace(b'""', b"")
    if b'"' not in marks:
        return marks
    kept, inside = [], 0  # a chunk at a time: the pieces between quotes stay few at once (and in the caches)
    for start in range(0, len(marks), _DEPTH_CHUNK):
        pieces = marks[start:start + _DEPTH_CHUNK].split(b'"')
        kept.append(b"".join(pieces[inside::2]))
        inside ^= (len(pieces) - 1) & 1
    return b"".join(kept)


def depth(raw: bytes, limit: int | None = None, *, marks: bytes | None = None) -> int:
    """How deep arrays and objects nest in UTF-8 JSON text ``raw`` (brackets inside strings do not count), without
    recursing; past ``limit`` it stops counting and returns a figure above ``limit``. Linear: ``outside_strings``
    (or ``marks``, what it gave for ``raw``), then the brackets counted a chunk at a time."""
    steps = array("b", (outside_strings(raw) if marks is None else marks).translate(_STEPS, b","))
    deepest = level = 0
    for start in range(0, len(steps), _DEPTH_CHUNK):
        chunk = steps[start:start + _DEPTH_CHUNK]
        deepest = max(deepest, max(accumulate(chunk, initial=level)))
        if limit is not None and deepest > limit:
            break
        level += sum(chunk)
    return deepest


def ascii_count(text: str, max_digits: int = MAX_INT_DIGITS) -> int | None:
    """The non-negative integer ``text`` writes in ASCII decimal digits (leading zeros allowed), of at most
    ``max_digits`` significant digits; None for anything else (a sign, a space, '²' or '١', which str.isdigit
    takes and int() refuses or reads). Total and linear: no int() of text that was not checked first."""
    if not text or not text.isascii() or not text.isdigit():
        return None
    digits = text.lstrip("0")
    return int(digits or "0") if len(digits) <= max_digits else None


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise BoundaryError(f"holds an integer of {len(text.lstrip('-'))} digits; "
                            f"at most {MAX_INT_DIGITS} are accepted")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise BoundaryError(f"holds a number out of range ({clip(text, 40)})")
    return value


def _constant(text: str):
    raise BoundaryError(f"holds {text}, which is not JSON")


def _pairs(pairs: list) -> dict:
    if not next(_TICKS) % _EVERY:
        in_time()
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        for key, _ in pairs:
            if key in seen:
                raise BoundaryError(f"names key {clip(key, 80)!r} twice in one object")
            seen.add(key)
    return out


def load_json(raw: bytes | str, *, max_bytes: int, max_depth: int = MAX_DEPTH, max_values: int | None = None):
    """Parse JSON text within bounds: size, UTF-8, nesting depth, integer digits, no NaN, no repeated keys, and
    (``max_values``) at most that many values (commas and brackets outside strings: what json.loads builds). Time
    linear in ``raw``; memory a small multiple of it, and of ``max_values``."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    if len(data) > max_bytes:
        raise BoundaryError(f"is {len(data)} bytes of JSON; at most {max_bytes} are accepted")
    try:
        text = data.decode("utf-8")  # first: the depth is counted on UTF-8, where a byte '"' or '[' is that character
    except UnicodeDecodeError as err:
        raise BoundaryError(f"is not UTF-8 text ({err.reason} at byte {err.start})") from None
    marks = outside_strings(data)
    if max_values is not None:  # lists and strings cost json.loads time and memory, and call no hook that could
        values = marks.count(b",") + marks.count(b"[") + marks.count(b"{")  # look at a deadline: bounded here
        if values > max_values:  # (first: counted in C, where the depth is counted a chunk at a time)
            raise BoundaryError(f"holds more than {max_values} values (about {values}); at most {max_values} are "
                                "accepted")
    if depth(data, max_depth, marks=marks) > max_depth:
        raise BoundaryError(f"nests more than {max_depth} levels deep")
    check = _numbers_to_check(data)  # else json.loads builds numbers itself (None: its own int and float)
    try:
        return json.loads(text, parse_constant=_constant, object_pairs_hook=_pairs,
                          parse_int=_int if check else None, parse_float=_float if check else None)
    except BoundaryError:
        raise
    except json.JSONDecodeError as err:
        raise BoundaryError(f"is not JSON ({clip(err, 120)})") from err
    except (RecursionError, ValueError, OverflowError, MemoryError) as err:  # belt and braces: the checks above
        raise BoundaryError(f"cannot be parsed within bounds ({type(err).__name__})") from err


def check_json_depth_text(text: str, max_depth: int = MAX_DEPTH) -> None:
    """For TOML and other bracketed text: refuse nesting deeper than ``max_depth`` (strings not skipped). Linear."""
    steps = array("b", text.encode("utf-8", "surrogatepass").translate(None, _NOT_BRACKETS).translate(_STEPS))
    level = deepest = 0
    for start in range(0, len(steps), _DEPTH_CHUNK):
        chunk = steps[start:start + _DEPTH_CHUNK]
        deepest = max(deepest, max(accumulate(chunk, initial=level)))
        if deepest > max_depth:
            raise BoundaryError(f"nests more than {max_depth} levels deep")
        level += sum(chunk)


def nesting(value: object, max_depth: int = MAX_DEPTH) -> None:
    """Refuse a parsed value (TOML's: dotted keys nest without brackets) whose lists and dicts nest deeper than
    ``max_depth``; walked without recursing, and only as far as ``max_depth`` levels."""
    level, deep = [value], 0
    while True:
        containers = [v for v in level if isinstance(v, (dict, list))]
        if not containers:
            return
        deep += 1
        if deep > max_depth:
            raise BoundaryError(f"nests more than {max_depth} levels deep")
        level = [x for c in containers for x in (c.values() if isinstance(c, dict) else c)]
