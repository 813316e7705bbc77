"""pled's GPU side, one home: the device probe, the routes by which a GPU reads pled's one copy, host registration
and its bookkeeping, and what the device check shares. The seams call ``device_view`` and ``guard_uva`` only.

Tests without a GPU install a faked runtime with ``use(fake)`` (or ``with use(fake):``) and say so.
"""
from pled.client.gpu.cuda import RegistrationError, Runtime, runtime, use
from pled.client.gpu.probe import Probe
from pled.client.gpu.registry import MAX_CHUNK, PAGE, page_range, registrations
from pled.client.gpu.routes import ROUTES, NoRoute
from pled.client.gpu.view import device_view, guard_uva

__all__ = ["MAX_CHUNK", "PAGE", "ROUTES", "NoRoute", "Probe", "RegistrationError", "Runtime", "device_view",
           "guard_uva", "page_range", "registrations", "runtime", "use"]
