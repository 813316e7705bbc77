"""The daemon: config, sidecar reading, planning and preflight, staging, the registry of tables, the server,
systemd, the loop, reload (docs/ARCHITECTURE.md has the module map and the layers). Never imports torch or the
client side."""
