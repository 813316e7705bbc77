"""The daemon: config, sidecar reading, preflight, staging, the server, systemd, the loop, reload.
Never imports torch or the client side."""
