"""The device check (``python -m bench.device.check``, ``make device-check``): what pled's GPU side (pled.client.gpu)
does on a machine with an NVIDIA GPU, measured; without CUDA it says so and exits 0. One module per concern: check.py
(the run, its sections, the device tool's call), sections.py (per page kind, fp8), routes.py (per GPU route),
cuda.py (CUDA through pled's seam), pages.py (staging on each page kind), lookup.py (references), child.py (the
second process), procfs.py (/proc figures)."""
