"""Health: what pled says about itself: its log lines, the journal's fields, its counters and metrics.

journal.py (journald's native protocol, MESSAGE_IDs and PLED_* fields), logs.py (the log's set-up, escaping,
priorities), throttle.py (budgets of repeating lines), counters.py (attaches, refusals, drops, reloads),
metrics_file.py (the Prometheus textfile for node exporter).

The daemon's bottom with pled.daemon.config: every wing may import it; it imports nothing else of the daemon.
"""
