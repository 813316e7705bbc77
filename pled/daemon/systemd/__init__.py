"""systemd: what pled tells its service manager and what it keeps there.

notify.py (sd_notify: READY, STATUS, RELOADING, the watchdog, fds to the store), fdstore.py (the fd store: names,
adopting the regions systemd kept at a restart, removing the others).

May import: pled.shared, the memory wing (the page size a kept region is on), the health wing.
"""
