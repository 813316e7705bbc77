"""pled's safe_open stand-in against safetensors' own safe_open (0.8.0, the installed one), call for call.

A real `pled serve` holds a generic table of files written by safetensors itself (torch and numpy) and by pled's
writer, which does not align tensors (a U8 tensor of odd length first puts the rest at odd offsets). The same calls
go to the real safe_open and to the wrapped one on the same file; results must be equal (tensor values bit for bit,
dtype, shape, type, strides, contiguity, storage offset, writability) and so must the exception types and messages.
The calls include writes into what get_tensor and get_slice return (safetensors hands out writable tensors: a
private mapping of the file per handle for "pt" with "mmap", copies otherwise): they must succeed or fail alike, and
show in the same later results. pled's side must come from the region (its shared mapping, or a copy-on-write
mapping of it), and no write may reach the region: after each call sequence it still holds the file's bytes.
"""
import gc
import importlib
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st
from safetensors import SafetensorError
from safetensors._safetensors_rust import safe_open as REAL

import harness
from pled.client import held_files, private_views, safe_open_seam, tensor_views
from pled.daemon.sources.safetensors_file import read_header, write
from pled.shared.region import DTYPE_BITS

pytestmark = [pytest.mark.daemon,  # one `pled serve` for the module (pled_files)
              pytest.mark.filterwarnings("ignore:Using a non-tuple sequence:UserWarning")]  # torch's, on both sides

TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
                "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu, "U8": torch.uint8, "I8": torch.int8,
                "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "U16": torch.uint16, "U32": torch.uint32,
                "U64": torch.uint64, "F64": torch.float64, "BOOL": torch.bool, "C64": torch.complex64}
NUMPY_DTYPES = ["float32", "float16", "float64", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32",
                "uint64", "bool", "complex64"]


def random_bytes(rng, dtype: str, shape) -> bytes:
    n = int(np.prod(shape)) * DTYPE_BITS[dtype] // 8
    return bytes(rng.integers(0, 2, n, dtype=np.uint8)) if dtype == "BOOL" else rng.bytes(n)


# pled's writer puts tensors one after another, unpadded: after 3 (or 5) bytes of U8, every other one is unaligned
UNALIGNED = [("odd", "U8", (3,))] + [(f"u.{c.lower()}", c, (2, 3)) for c in TORCH_DTYPES] + [
    ("u.f4", "F4", (3, 4)), ("u.scalar", "I16", ()), ("u.empty", "F32", (0, 2)), ("u.cube", "F32", (2, 3, 4)),
    ("u.tail", "F64", (5,))]
PLAIN = [("odd5", "U8", (5,)), ("b.bf16", "BF16", (4, 2)), ("b.i32", "I32", (7,)), ("b.e4m3", "F8_E4M3", (3, 3))]
NAMES_IN = {"torch": [f"t.{c.lower()}" for c in TORCH_DTYPES] + ["cube", "scalar", "empty"],
            "numpy": [f"a.{n}" for n in NUMPY_DTYPES] + ["a.scalar", "a.empty"],
            "unaligned": [n for n, _, _ in UNALIGNED], "plain": [n for n, _, _ in PLAIN]}


def make_files(d) -> dict[str, str]:
    """Files covering every dtype, aligned (safetensors' writers) and not (pled's), with and without metadata."""
    d.mkdir()
    rng = np.random.default_rng(11)
    tensors = {f"t.{code.lower()}": torch.frombuffer(bytearray(random_bytes(rng, code, (3, 5))), dtype=dt).reshape(3, 5)
               for code, dt in TORCH_DTYPES.items()}
    tensors |= {"cube": torch.randn(2, 3, 4), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}
    safetensors.torch.save_file(tensors, str(d / "torch.safetensors"), metadata={"format": "pt", "k": "v"})
    arrays = {f"a.{name}": np.frombuffer(rng.bytes(8 * np.dtype(name).itemsize), dtype=name).reshape(2, 4)
              for name in NUMPY_DTYPES if name != "bool"}
    arrays |= {"a.bool": rng.integers(0, 2, (3,)).astype(bool), "a.scalar": np.array(7, dtype=np.int16),
               "a.empty": np.zeros((4, 0), dtype=np.float32)}
    safetensors.numpy.save_file(arrays, str(d / "numpy.safetensors"))  # no metadata: metadata() is None
    write(str(d / "unaligned.safetensors"), [(n, c, s, random_bytes(rng, c, s)) for n, c, s in UNALIGNED],
          metadata={"writer": "pled"})
    write(str(d / "plain.safetensors"), [(n, c, s, random_bytes(rng, c, s)) for n, c, s in PLAIN])
    files = {p.stem: str(p) for p in sorted(d.glob("*.safetensors"))}
    assert {stem: sorted(REAL(p, "pt").keys()) for stem, p in files.items()} == {k: sorted(v) for k, v in
                                                                                 NAMES_IN.items()}
    return files


@pytest.fixture(scope="module")
def pled_files(tmp_path_factory):
    """The files, and a real `pled serve` holding them all as table "fid" (one daemon for the module)."""
    d = tmp_path_factory.mktemp("fidelity")
    files = make_files(d / "held")
    pled = harness.start(d, {"fid": d / "held" / "*.safetensors"})
    try:
        yield SimpleNamespace(socket=pled.socket, files=files, dir=d)
    finally:
        pled.stop()


@pytest.fixture
def wrapped(pled_files, monkeypatch):
    """safetensors.safe_open wrapped by pled's seam in this process (as the plugin or start-up hook wraps it),
    attached afresh; the modules' safe_open and pled's per-process state are put back afterwards."""
    monkeypatch.setenv("PLED_SOCKET", pled_files.socket)
    for name in ("PLED_TABLES", "PLED_FALLBACK", "VLLM_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(held_files, "_state", None)
    monkeypatch.setattr(held_files.atexit, "register", lambda *a: None)
    monkeypatch.setattr(safe_open_seam, "_fell_through", set())
    modules = [importlib.import_module(name) for name in safe_open_seam.MODULES]
    for module in modules:
        monkeypatch.setattr(module, "safe_open", module.safe_open)
    safe_open_seam.install()  # wraps them now (imported already), once per process: again by hand after the first
    for module in modules:
        safe_open_seam.patch(module)
    assert safetensors.safe_open.__pled__ and safetensors.safe_open.__wrapped__ is REAL
    yield safetensors.safe_open
    state = held_files._state
    for table in (state.tables.values() if state is not None else ()):
        table.close()


def in_region(value) -> bool:
    """Whether ``value`` lies in pled's region: its shared mapping, or a copy-on-write mapping of it."""
    table = held_files._state.tables["fid"]
    start, end = table.address, table.address + table.manifest.region_bytes
    ptr = value.data_ptr() if isinstance(value, torch.Tensor) else value.ctypes.data
    found = private_views.origin(ptr)
    return start <= ptr < end or (found is not None and found[0] is table)


def layout(value) -> tuple:
    """What a caller can see of a result besides its values: strides, contiguity, storage offset, writability."""
    if isinstance(value, torch.Tensor):
        return (value.stride(), value.is_contiguous(), value.storage_offset(),
                value.untyped_storage().nbytes() - value.storage_offset() * value.element_size() >= value.nbytes)
    return (value.strides, value.flags.c_contiguous, value.flags.f_contiguous, value.flags.writeable)


def same(mine, theirs) -> None:
    assert type(mine) is type(theirs), (type(mine), type(theirs))
    if isinstance(theirs, torch.Tensor):
        assert (mine.dtype, mine.shape) == (theirs.dtype, theirs.shape)
        assert layout(mine) == layout(theirs), (layout(mine), layout(theirs))
        as_bytes = [torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1)).view(torch.uint8) for t in (mine,
                                                                                                         theirs)]
        assert torch.equal(*as_bytes)
    elif isinstance(theirs, np.ndarray):
        assert (mine.dtype, mine.shape) == (theirs.dtype, theirs.shape) and mine.tobytes() == theirs.tobytes()
        assert layout(mine) == layout(theirs), (layout(mine), layout(theirs))
    elif isinstance(theirs, dict) and all(isinstance(v, str) for v in theirs.values()):
        assert mine == theirs  # metadata: safetensors' order is its hash map's, which varies
    elif isinstance(theirs, dict):
        assert list(mine) == list(theirs)  # get_tensors: in offset order
        for key in theirs:
            same(mine[key], theirs[key])
    else:
        assert mine == theirs


def outcome(call):
    try:
        return "ok", call()
    except BaseException as err:  # safetensors panics on some reversed slices: a PanicException is a BaseException
        if isinstance(err, (KeyboardInterrupt, AssertionError)):
            raise
        return "raised", err


BOUND = st.none() | st.integers(-6, 6)
ITEM = (st.integers(-6, 6) | st.sampled_from([2**31 - 1, 2**31, -2**31 - 1, 1 << 40])
        | st.builds(slice, BOUND, BOUND, st.none() | st.sampled_from([-1, 0, 1, 2, 3]))
        | st.sampled_from([Ellipsis, None, True, 1.5]))
INDEX = ITEM | st.lists(ITEM, max_size=4).map(tuple) | st.sampled_from([[], [0], [slice(None)]])


def calls_on(file: str):
    """Calls on one file: mostly of its own tensors, some of names it does not have ("T.F32": names are exact)."""
    name = st.sampled_from(NAMES_IN[file] + ["zz", "", "T.F32", 0])  # 0: not a name at all
    call = st.one_of(
        st.sampled_from([("keys",), ("offset_keys",), ("metadata",), ("get_tensors",), ("prefetch",), ("exit",)]),
        st.tuples(st.just("get_tensor"), name), st.tuples(st.just("get_slice"), name, INDEX),
        st.tuples(st.sampled_from(["write", "write_slice"]), name, st.integers(0, 40)))
    return st.tuples(st.just(file), st.lists(call, min_size=1, max_size=8))


CASES = st.sampled_from(sorted(NAMES_IN)).flatmap(calls_on)


def poke(value, at: int) -> None:
    """Flip the low bit of one byte of ``value`` (a tensor or array that get_tensor or get_slice returned)."""
    if isinstance(value, np.ndarray):
        flat = value.reshape(-1).view(np.uint8)
    else:
        flat = value.reshape(-1).view(torch.uint8)
    if flat.shape[0]:
        flat[at % flat.shape[0]] ^= 1


def run(handle, call, real_handle=None):
    """One call on a handle; get_slice is followed by its shape, dtype and one index. A write: get_tensor (or
    get_slice(name)[...]) and one byte of the result changed; the result is returned for comparing."""
    what, *args = call
    if what == "exit":
        return handle.__exit__(None, None, None)
    if what in ("write", "write_slice"):
        value = handle.get_tensor(args[0]) if what == "write" else handle.get_slice(args[0])[...]
        poke(value, args[1])
        return value
    if what == "prefetch" and real_handle is not None and not hasattr(real_handle, "prefetch"):
        real_handle.metadata()  # a safetensors without prefetch(plan): what it would do, "File is closed" or None
        return None
    if what == "get_slice":
        sliced = handle.get_slice(args[0])
        return sliced.get_shape(), sliced.get_dtype(), outcome(lambda: sliced[args[1]])
    return getattr(handle, what)(*args)


def reversed_slice(index) -> bool:
    """Whether ``index`` has a slice whose start is past its stop: safetensors' own slicer (numpy, pread) then fails
    in whatever way the sizes it computes from it lead to (SystemError, ValueError, TypeError, a Rust panic)."""
    items = index if isinstance(index, (tuple, list)) else [index]
    return any(isinstance(i, slice) and None not in (i.start, i.stop) and 0 <= i.stop < i.start for i in items)


def compare(mine, theirs, call, framework: str, backend: str, sliced: bool = False) -> bool:
    """Whether both sides returned (asserting equal results) or both raised (asserting the same exception)."""
    if mine[0] == "raised" or theirs[0] == "raised":
        assert mine[0] == theirs[0] == "raised", (call, mine, theirs)
        a, b = mine[1], theirs[1]
        slicer = framework in ("np", "numpy") or backend == "pread"
        if (type(a), str(a)) == (type(b), str(b)):
            return False  # the same error (a reversed slice that fails on a negative bound first, too)
        if sliced and slicer and type(b) is not SafetensorError and reversed_slice(call[2]):
            assert type(a) is SystemError, (call, a, b)  # a start past its stop: safetensors' slicer fails as it may
        elif sliced and type(b) is RuntimeError and call[1] == "u.f4":
            assert type(a) is RuntimeError  # F4 cannot take the file's shape in torch: the message says which shape
        else:
            assert (type(a), str(a)) == (type(b), str(b)), (call, a, b)
        return False
    if call[0] == "get_slice" and not sliced:
        assert mine[1][:2] == theirs[1][:2], call  # get_shape(), get_dtype()
        return compare(mine[1][2], theirs[1][2], call, framework, backend, sliced=True)
    same(mine[1], theirs[1])
    return True


def slicing(file: str, name: str, index, framework: str = "np", **opening):
    return dict(case=(file, [("get_slice", name, index)]), framework=framework, opening=opening, use_with=False)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# what a random draw seldom reaches: a start past its stop, F4's half bytes, a zero-size dimension, a closed file
@example(**slicing("unaligned", "u.cube", (slice(1, 0), slice(0, 0))))  # safetensors panics
@example(**slicing("unaligned", "u.cube", (slice(None), slice(2, 1, 3)), "pt", backend="pread"))
@example(**slicing("unaligned", "u.f4", (slice(None), slice(0, 4, 2))))
@example(**slicing("unaligned", "u.f4", (slice(0, 3), slice(0, 2)), "pt", backend="pread"))
@example(**slicing("unaligned", "u.f4", (0, slice(0, 0)), "pt", backend="pread"))
@example(**slicing("unaligned", "u.f4", (9, 1)))
@example(**slicing("numpy", "a.empty", Ellipsis))
@example(**slicing("torch", "t.f32", (2, 9)))
@example(**slicing("torch", "cube", (Ellipsis, -5), "pt"))
@example(case=("unaligned", [("get_tensor", "u.f4"), ("get_tensors",), ("exit",), ("get_tensor", "u.f4"),
                             ("prefetch",)]), framework="pt", opening={"backend": "pread"}, use_with=True)
@example(case=("torch", [("metadata",), ("offset_keys",), ("get_tensors",)]), framework="numpy", opening={},
         use_with=False)
# writes: into get_tensor's and get_slice's results, then what the same handle gives after them (shared by the handle
# for "pt" with "mmap", each result its own otherwise), an F4 tensor's halved bytes included
@example(case=("torch", [("write", "cube", 5), ("get_tensor", "cube"), ("get_slice", "cube", (0, slice(1, 3)))]),
         framework="pt", opening={}, use_with=False)
@example(case=("torch", [("write_slice", "t.bf16", 3), ("get_tensor", "t.bf16"), ("write", "t.bf16", 3)]),
         framework="pt", opening={"backend": "mmap"}, use_with=True)
@example(case=("unaligned", [("write", "u.f4", 1), ("get_tensor", "u.f4"), ("get_slice", "u.f4", Ellipsis)]),
         framework="pt", opening={}, use_with=False)
@example(case=("unaligned", [("write", "u.f64", 7), ("get_tensor", "u.f64")]), framework="pt",
         opening={"backend": "pread"}, use_with=False)
@example(case=("numpy", [("write", "a.int32", 2), ("get_tensor", "a.int32"), ("write", "a.scalar", 0)]),
         framework="np", opening={}, use_with=False)
@given(case=CASES, framework=st.sampled_from(["pt", "np", "torch", "numpy"]), use_with=st.booleans(),
       opening=st.sampled_from([{}, {"device": "cpu"}, {"device": None}, {"backend": "mmap"}, {"backend": "pread"}]))
def test_pled_safe_open_matches_safetensors_call_for_call(pled_files, wrapped, case, framework, opening, use_with):
    file, calls = case
    path = pled_files.files[file]
    if any(c[0] in ("write", "write_slice") for c in calls):
        calls = calls + [("get_tensors",)]  # what the writes left in the handle's later results
    theirs, mine = REAL(path, framework, **opening), wrapped(path, framework, **opening)
    assert type(mine).__name__ == "PledSafeOpen"  # served by pled, not passed to the file
    if use_with:
        assert theirs.__enter__() is theirs and mine.__enter__() is mine
    for call in calls:
        a, b = outcome(lambda call=call: run(mine, call)), outcome(lambda call=call: run(theirs, call, theirs))
        if compare(a, b, call, framework, opening.get("backend", "mmap")) and call[0] in ("get_tensor", "get_tensors"):
            values = a[1].values() if isinstance(a[1], dict) else [a[1]]
            for v in values:  # zero copy: pled's tensors and arrays are the region's bytes
                assert v.nbytes == 0 or in_region(v), call
    table, data = held_files._state.tables["fid"], Path(path).read_bytes()
    begins = {t.name: t.begin for t in read_header(path).tensors}
    for name, index in table.shard_entries(held_files._state.lookup(path).shard.index).items():
        e = table.manifest.tensors[index]  # no write reached pled's pages: the region still holds the file's bytes
        assert table.buffer[e.offset:e.offset + e.nbytes] == data[begins[name]:begins[name] + e.nbytes], name


def test_unaligned_tensors_are_read_where_they_lie(pled_files, wrapped):
    path = pled_files.files["unaligned"]
    h = read_header(path)
    odd = [t for t in h.tensors if t.nbytes and (h.data_offset + t.begin) % max(DTYPE_BITS[t.dtype] // 8, 1)]
    assert {t.dtype for t in odd} >= {"F32", "F16", "BF16", "I64", "C64", "F64"}  # the format does not align them
    mine, theirs = wrapped(path, "pt"), REAL(path, "pt")
    for t in odd:
        a, b = mine.get_tensor(t.name), theirs.get_tensor(t.name)
        assert in_region(a) and a.data_ptr() % a.element_size() and b.data_ptr() % b.element_size()
        same(a, b)


def test_tensors_outlive_the_handle(pled_files, wrapped):
    """The offload worker keeps safe_open(path, framework="pt") without `with`, and its tensors, for its life."""
    path = pled_files.files["torch"]
    f = wrapped(path, framework="pt")
    kept = {name: f.get_tensor(name) for name in f.keys()}
    assert f.get_tensor("cube") is not kept["cube"] and f.get_tensor("cube").data_ptr() == kept["cube"].data_ptr()
    del f
    gc.collect()
    with REAL(path, "pt") as disk:
        for name, t in kept.items():
            same(t, disk.get_tensor(name))
    with wrapped(path, "pt") as f:
        t = f.get_tensor("cube")
    with pytest.raises(SafetensorError, match="File is closed"):
        f.keys()
    assert torch.equal(t, kept["cube"])


def test_backend_is_taken_as_the_installed_safe_open_takes_it(pled_files, wrapped, tmp_path):
    held = pled_files.files["plain"]
    other = str(tmp_path / "other.safetensors")
    safetensors.torch.save_file({"x": torch.ones(2)}, other)
    for backend in ("mmap", "pread"):
        assert type(wrapped(held, "pt", backend=backend)).__name__ == "PledSafeOpen"
        assert type(wrapped(other, "pt", backend=backend)) is REAL
    for kwargs in ({"backend": "bogus"}, {"backend": "mmap", "foo": 1}, {"foo": 1}):
        for path in (held, other):
            with pytest.raises(Exception) as mine:
                wrapped(path, "pt", **kwargs)
            with pytest.raises(Exception) as theirs:
                REAL(path, "pt", **kwargs)
            assert (type(mine.value), str(mine.value)) == (type(theirs.value), str(theirs.value))

    def older(filename, framework, device="cpu"):  # a safe_open from before backend= (safetensors < 0.8)
        return REAL(filename, framework, device)

    for path in (held, other):
        with pytest.raises(TypeError, match="unexpected keyword argument 'backend'"):
            safe_open_seam.wrap(older)(path, "pt", backend="mmap")
        opened = safe_open_seam.wrap(older)(path, "pt")
        assert type(opened).__name__ == ("PledSafeOpen" if path == held else "safe_open")


def test_a_dtype_this_torch_cannot_view_sends_the_file_to_disk_with_one_warning(pled_files, wrapped, monkeypatch,
                                                                                   caplog):
    """Dropping F8_E8M0 from pled's dtypes stands in for an older torch, one without float8_e8m0fnu."""
    monkeypatch.delitem(tensor_views._TORCH_DTYPES, "F8_E8M0")
    path = pled_files.files["torch"]
    with caplog.at_level(logging.WARNING, logger="vllm.pled"):
        for _ in range(2):
            f = wrapped(path, "pt")
            assert type(f) is REAL  # the real file, not an error
            same(f.get_tensor("t.f8_e8m0"), REAL(path, "pt").get_tensor("t.f8_e8m0"))
        assert held_files._state.lookup(path) is None  # vLLM's iterator seam passes it on too
        assert type(wrapped(pled_files.files["plain"], "pt")).__name__ == "PledSafeOpen"  # no E8M0: still served
    lines = [r.getMessage() for r in caplog.records if path in r.getMessage()]
    assert len(lines) == 1 and "F8_E8M0" in lines[0] and "reading it from disk" in lines[0], lines


def test_an_attribute_pled_does_not_define_comes_from_a_real_safe_open(pled_files, wrapped, monkeypatch, caplog):
    path = pled_files.files["torch"]
    f = wrapped(path, "pt")
    with pytest.raises(AttributeError) as err:
        _ = f.some_future_method
    assert type(err.value.obj) is REAL and "'builtins.safe_open' object has no attribute" in str(err.value)

    # safetensors' class as a later release might have it: one method more
    monkeypatch.setattr(REAL, "some_future_method", lambda self, x: ("future", x, self.keys()[0]), raising=False)
    with caplog.at_level(logging.WARNING, logger="vllm.pled"):
        g = wrapped(path, "pt")
        assert type(g).__name__ == "PledSafeOpen" and g._real is None
        assert g.some_future_method(1) == ("future", 1, "cube")
        real = g._real
        assert type(real) is REAL and g.some_future_method(2) == ("future", 2, "cube") and g._real is real  # once
        h = wrapped(pled_files.files["plain"], "pt")
        assert h.some_future_method(3) == ("future", 3, "b.bf16")
        with h:
            pass
        with pytest.raises(SafetensorError, match="File is closed"):
            h.some_future_method(4)  # closed with the stand-in
    lines = [r.getMessage() for r in caplog.records if "some_future_method" in r.getMessage()]
    assert len(lines) == 1 and "read from disk" in lines[0], lines
