"""Serving: the socket, its connections and the one loop that watches them.

listener.py (the socket bound, its directory checked), admission.py (accepting: who gets a connection, under the
caps; the listener paused while no fd is free), server.py (reading calls, handling them one a turn, writing replies
with their fds), session.py (one connection: its queued replies and the fds in flight, `Lingering`), access.py (who may
attach: SO_PEERCRED and SO_PEERGROUPS against the policy), fdlimit.py (the open-file limit, the connection caps and
the fd budget), loop.py (the selector, the only thread that touches the daemon's state).

May import: pled.shared, the health wing (counters, throttle, journal); never the sources, memory or regions wings
(import-linter checks it, indirect imports too).
"""
