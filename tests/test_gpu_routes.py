"""The GPU side's route choice and registration bookkeeping (issue 45 items 1-2, issue 48 class 1), in process, over
real staged regions (a synthetic checkpoint staged into a sealed memfd, or a writable one) mapped by the client's
real Table.

FAKED, because this machine has no GPU: the CUDA runtime (tests/fakecuda.py: the device's attributes, the
registration results, calls recorded) and ``Tensor.is_pinned`` for the ranges registered with it. Everything else is
pled's own: the probe, the routes in the table's order, the registrations, the mapping, the mprotect.
"""
import gc
import logging
import os

import pytest

from fakecuda import INVALID_VALUE, NOT_SUPPORTED, RO_OK, FakeCuda
from pled.client import gpu
from pled.client.gpu import registry
from pled.client.mapped_table import Table
from pled.daemon.regions import staging
from pled.daemon.sources.checkpoint import open_checkpoint
from pled.generator import make_checkpoint

torch = pytest.importorskip("torch")

ATS = {99: 1, 113: 0, 88: 1, 100: 1, 91: 1}  # Grace / GB10: pageable access through the host's page tables
HMM = {99: 1, 113: 0, 88: 1, 100: 0, 91: 1}  # x86 with the open modules
BARE = {99: 1, 113: 0, 88: 0, 100: 0, 91: 1}  # a B300 / RTX PRO 6000 without HMM: registration, not read-only
NONE = {99: 0, 113: 0, 88: 0, 100: 0, 91: 0}  # host registration unsupported entirely


@pytest.fixture(scope="module")
def regions(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    make_checkpoint(str(d), "fp8", {0: 3000, 1: 2000}, width=64, parts=4, files=1)
    ro = staging.stage("t", open_checkpoint(str(d)))
    rw = staging.stage("t", open_checkpoint(str(d)), writable=True)
    yield ro, rw
    ro.close()
    rw.close()


@pytest.fixture
def fake(monkeypatch):
    """Installs a FakeCuda (attributes set by the test), and Tensor.is_pinned for what it registered."""
    f = FakeCuda()
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, device=None: f.pinned(self.untyped_storage()
                                                                                       .data_ptr()))
    monkeypatch.delenv("PLED_PAGEABLE_HMM", raising=False)
    with gpu.use(f):
        yield f
    gc.collect()
    assert not registry.registrations.held, registry.registrations.held  # every view released its registration


def table(regions, kind="read-only", writer=False, routes=("read-only", "pageable", "writable")):
    ro, rw = regions
    r = rw if kind == "writable" else ro
    return Table(os.dup(r.fd), 1, populate=False, gpu_access=kind, gpu_routes=tuple(routes), writer=writer)


def view(t, layer=0, lo=0, hi=None):
    a = [a for a in t.manifest.arrays if f"layers.{layer}." in a.prefix][0]
    hi = a.shape[0] if hi is None else hi
    return gpu.device_view(t, a, lo, hi, what=f"{a.prefix} rows {lo}..{hi}"), a


def route_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if ": rank " in r.getMessage()]


def mapping_perms(t) -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            lo = int(line.split("-")[0], 16)
            if lo == t.address:
                return line.split()[1]
    return ""


CASES = {
    # name: (attributes, registration failures by flags, table kind, writer, env, expected route or refusal words)
    "read-only works": (RO_OK, {}, "read-only", False, {}, "read-only"),
    "read-only supported but 801, pageable (ATS)": ({**ATS, 113: 1}, {0x0A: NOT_SUPPORTED}, "read-only", False, {},
                                                    "pageable"),
    "read-only supported but invalid argument, nothing else": (RO_OK, {0x0A: INVALID_VALUE}, "read-only", False, {},
                                                               "invalid argument"),
    "no read-only registration, pageable (ATS)": (ATS, {}, "read-only", False, {}, "pageable"),
    "no read-only registration, HMM not opted in": (HMM, {}, "read-only", False, {}, "PLED_PAGEABLE_HMM=1"),
    "no read-only registration, HMM opted in": (HMM, {}, "read-only", False, {"PLED_PAGEABLE_HMM": "1"},
                                                "pageable"),
    "no pageable, writable allowed for this uid": (BARE, {}, "writable", True, {}, "writable"),
    "no pageable, writable table but not a writer": (BARE, {}, "writable", False, {},
                                                     "is not one of the table's writers"),
    "no pageable, table not writable": (BARE, {}, "read-only", False, {}, "gpu_access = \"writable\" with writers"),
    "registration unsupported entirely": (NONE, {}, "writable", True, {}, "host registration unsupported"),
    "registration unsupported, pageable (ATS)": ({**NONE, 88: 1, 100: 1}, {}, "read-only", False, {}, "pageable"),
}


@pytest.mark.parametrize("case", CASES)
def test_each_table_takes_the_first_route_that_works_and_each_rank_logs_one_line(regions, fake, caplog, monkeypatch,
                                                                               case):
    attrs, fail, kind, writer, env, expected = CASES[case]
    fake.attrs, fake.fail = attrs, fail
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    caplog.set_level(logging.INFO, logger="vllm.pled")
    t = table(regions, kind, writer)
    try:
        if expected not in gpu.ROUTES:
            with pytest.raises(gpu.NoRoute) as err:
                view(t)
            line = str(err.value)
            assert "\n" not in line and "device 0 (FakeGPU) cannot read" in line and expected in line, line
            assert "PLED_FALLBACK=disk" in line and "pled gpu-check" in line, line
            assert route_lines(caplog) == []
            return
        tensor, a = view(t)
        (line,) = route_lines(caplog)  # one line for this rank's slice, naming the route, the device, the figures
        name = gpu.routes.NAMES[expected]
        assert f": {name} on device 0 (FakeGPU), " in line and f"({a.nbytes} bytes) in " in line, line
        assert tensor.data_ptr() == t.address + a.offset  # pled's mapping itself, no copy
        if expected == "read-only":
            assert [(c[2]) for c in fake.calls if c[2] == 0x0A][-1:] == [0x0A] and tensor.is_pinned()
            assert fake.calls[-1][0] <= tensor.data_ptr() and fake.calls[-1][1] < a.nbytes + 2 * gpu.PAGE
        elif expected == "pageable":  # nothing registered at all
            assert not fake.ranges and not tensor.is_pinned()
        else:  # writable: the whole mapping registered Mapped (no ReadOnly), then read-only in this process
            assert fake.calls == [(t.address, len(t.buffer), 0x02)] and tensor.is_pinned()
            assert t.protected and mapping_perms(t) == "r--s"
            assert "writable by its writers" in line
        failed = [r.getMessage() for r in caplog.records if "trying the next route" in r.getMessage()]
        assert len(failed) == (1 if fail else 0), failed  # a registration that failed is said, then the next route
        del tensor
    finally:
        gc.collect()
        t.close()


def test_the_table_s_route_order_is_followed_and_kept_for_its_other_slices(regions, fake, caplog):
    fake.attrs = RO_OK  # read-only registration would work, but this table asks for writable first
    t = table(regions, "writable", True, routes=("writable", "read-only"))
    try:
        first, _ = view(t, 0)
        second, _ = view(t, 1)  # inside the registered mapping: no new registration
        assert fake.calls == [(t.address, len(t.buffer), 0x02)] and second.is_pinned()
        assert all(": writable registration on device 0" in x for x in route_lines(caplog))
        del first, second
    finally:
        gc.collect()
        t.close()
    fake.attrs, fake.fail = ATS | {113: 1}, {0x0A: NOT_SUPPORTED}
    gpu.use(fake)  # installed anew: the device is asked again
    t = table(regions)
    try:
        a, _ = view(t, 0)
        b, _ = view(t, 1)  # the table took pageable: its next slice is not registered again to fail again
        assert [c[2] for c in fake.calls[1:]] == [0x0A] and not fake.ranges
        del a, b
    finally:
        gc.collect()
        t.close()


def test_two_slices_of_one_table_are_registered_each_and_a_covered_one_not_again(regions, fake):
    t = table(regions)
    try:
        first, a = view(t, 0)
        second, b = view(t, 1)  # another array of the same table, further on: its own pages, its own registration
        assert [c[2] for c in fake.calls] == [0x0A, 0x0A] and fake.calls[0][0] < fake.calls[1][0]
        assert first.is_pinned() and second.is_pinned() and len(registry.registrations.held) == 2
        inner, _ = view(t, 0, 10, 20)  # rows inside the first slice: its pages are registered already
        assert len(fake.calls) == 2 and inner.is_pinned()
        del first, second, inner
    finally:
        gc.collect()
        t.close()


def test_without_cuda_the_view_is_plain_and_said_once(regions, caplog, monkeypatch):
    monkeypatch.setattr(gpu.view, "_said_no_cuda", False)
    caplog.set_level(logging.INFO, logger="vllm.pled")
    with gpu.use(None):
        assert gpu.runtime() is None  # the CPU build of torch: no CUDA in this process
        t = table(regions)
        try:
            first, a = view(t, 0)
            second, _ = view(t, 1)
            assert first.data_ptr() == t.address + a.offset and not registry.registrations.held
            said = [r.getMessage() for r in caplog.records if "no CUDA in this process" in r.getMessage()]
            assert len(said) == 1 and "plain CPU views, nothing registered" in said[0], said
        finally:
            del first, second
            t.close()


# -- registration bookkeeping (issue 48, class 1) ------------------------------------------------------------------

class Owner:
    """What a tensor's storage keeps alive: the numpy array over the mapping."""


def test_a_registration_failing_part_way_releases_every_chunk_registered_before():
    fake = FakeCuda(fail_call=3)  # a 130 GiB range: three chunks, the third refused
    start = 1 << 42
    with pytest.raises(gpu.RegistrationError, match="invalid argument") as err:
        registry.register(fake, Owner(), None, start, 130 << 30, "a slice")
    assert err.value.code == INVALID_VALUE
    assert [p for p, _, _ in fake.calls] == [start, start + (64 << 30), start + (128 << 30)]
    assert sorted(fake.unregistered) == [start, start + (64 << 30)] and not fake.ranges  # both chunks undone
    assert not registry.registrations.held  # nothing held for a range that failed
    keep = Owner()  # the same range again: registered anew, all three chunks
    registry.register(fake, keep, None, start, 130 << 30, "a slice")
    assert len(fake.calls) == 6 and len(fake.ranges) == 3
    del keep
    gc.collect()
    assert not fake.ranges and not registry.registrations.held


def test_a_range_released_by_its_last_owner_leaves_the_table_and_registers_again_for_real(regions, fake):
    t = table(regions)
    try:
        first, _ = view(t, 0)
        again, _ = view(t, 0)  # a second tensor over the same pages: one registration, two owners
        assert len(fake.calls) == 1
        del first
        gc.collect()
        assert fake.unregistered == [] and again.is_pinned()  # still held by the other owner
        del again
        gc.collect()
        assert len(fake.unregistered) == 1 and not registry.registrations.held and not fake.ranges
        third, _ = view(t, 0)  # a reload, a second model: the same pages, really registered again
        assert len(fake.calls) == 2 and fake.calls[1] == fake.calls[0] and third.is_pinned()
        del third
    finally:
        gc.collect()
        t.close()


def test_a_writer_whose_writable_registration_fails_is_left_read_only(regions, fake):
    """The writable route registered nothing (the device refused Mapped too): the writer's mapping is made read-only
    all the same, and the refusal names the CUDA error."""
    fake.attrs, fake.fail = BARE, {0x02: INVALID_VALUE}
    t = table(regions, "writable", True, routes=("writable",))
    try:
        with pytest.raises(gpu.NoRoute, match=r"writable registration: cudaHostRegister\(Mapped\) of table t"):
            view(t)
        assert t.protected and mapping_perms(t) == "r--s" and not fake.ranges
    finally:
        gc.collect()
        t.close()


def test_the_probe_reads_the_attributes_versions_and_kernel_module(tmp_path):
    from pled.client.gpu import probe

    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  610.43.02  Release Build\n")
    assert probe.open_kernel_module(str(version)) is True
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024\n")
    assert probe.open_kernel_module(str(version)) is False
    assert probe.open_kernel_module(str(tmp_path / "absent")) is None

    class OldDriver(FakeCuda):  # FAKED: a driver that does not know attribute 113
        def attribute(self, device, attr):
            if attr == 113:
                raise gpu.RegistrationError("cudaDeviceGetAttribute(113) failed on device 0: invalid value (1)", 1)
            return super().attribute(device, attr)

    probe.forget()
    p = probe.probe(OldDriver(HMM), 0)
    assert (p.register_supported, p.read_only_supported, p.pageable, p.ats, p.hmm) == (True, False, True, False, True)
    assert p.unknown == ("read_only_supported (113): cudaDeviceGetAttribute(113) failed on device 0: invalid value "
                         "(1)",) and (p.driver, p.runtime) == (13000, 12080)
    assert probe.versions_text(p) == "driver 13.0, runtime 12.8"
    probe.forget()
