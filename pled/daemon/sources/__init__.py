"""A table's sources: what a table is staged from, read and checked before anything is copied.

naming.py (which .safetensors files a table path names, their order and numbering), sidecar.py (a sidecar
directory or a glob of .safetensors files, staged whole), sidecar_meta.py (the published
META.json), checkpoint.py (a model checkpoint's PLE tables, staged as arrays for vLLM 0.33), safetensors_file.py (a
safetensors header, parsed by hand within bounds). Only headers and small text files are read here.

May import: pled.shared, and nothing else of the daemon (import-linter: "a table's sources import nothing of the
daemon").
"""
