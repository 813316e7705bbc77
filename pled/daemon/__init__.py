"""The daemon (`pled serve`). Its folders follow the data: the sources of a table (sources/), what the host's memory
can give it (memory/), how it becomes a sealed memfd (regions/), serving it on the socket (serving/), systemd
(systemd/), and what pled says about itself (health/). The modules here tie them together: lifecycle.py (start,
signals, stop), startup.py, registry.py (the one owner of the tables, their generations and the config), tables.py
(a table's state), stager.py (the worker threads), events.py (what they tell the loop), reload.py, handlers.py (the
calls), and config.py (pled.toml, read by every wing). docs/ARCHITECTURE.md has the module map and the rules, which
are import-linter contracts in pyproject.toml. Never imports torch or the client side."""
