"""pled's benchmarks: `make bench` or `python -m bench --help`. Measurements, not tests."""
