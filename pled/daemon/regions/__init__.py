"""Regions: how a table becomes one sealed memfd.

planning.py (a config into opened, distinct tables, their planned regions and the preflight's verdict; a reload's
plan), staging.py (the pieces of each source file copied into the memfd, hashed, sealed), pacer.py (the chunk and the
bandwidth staging keeps to), regionfd.py (the memfd itself, on the planned pages and NUMA nodes).

May import: pled.shared, the sources and memory wings, the health wing (journal), pled.daemon.config.
"""
