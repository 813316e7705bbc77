"""pled's metrics, in the Prometheus text format, made from a Status reply (docs/operations.md, "Metrics").

``render(status)`` takes the dict that io.pled.Status returns (docs/protocol.md) and gives the text that node
exporter's textfile collector reads: the daemon writes it to its ``metrics_file`` from a snapshot of its own
Status, and ``pled status --format prometheus`` prints it from the reply it got, so both hold the same families.
prometheus_client formats it (a collector on a registry of its own, ``generate_latest``); it is imported on first
use, and its absence is a PledError naming the package. Nothing here imports pydantic or the daemon.

Names follow the OpenMetrics conventions: base units in the name (``_bytes``, ``_seconds``, ``_ratio``), counters
ending in ``_total``. A figure Status does not have (a table not staged yet has no residency; an adopted table no
staging rate or page size) is left out rather than written as 0.
"""
from __future__ import annotations

from collections.abc import Iterator

from pled.shared.errors import PledError

STATES = ("waiting", "staging", "ready", "failed")
SINCE_START = " Counted since pled started: it restarts at 0 with the process, and nothing keeps it across restarts."


class MetricsUnavailable(PledError):
    """prometheus_client is not installed where the metrics are asked for."""


def _core():
    try:
        from prometheus_client import core
    except ImportError as err:
        raise MetricsUnavailable(f"the metrics need the prometheus-client package ({err}): pip install 'pled[daemon]', "
                                 "or pip install prometheus-client") from err
    return core


def render(status: dict) -> bytes:
    """The Prometheus text exposition (format 0.0.4) of a Status reply."""
    _core()
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(status))
    return generate_latest(registry)


class _Collector:
    """A prometheus_client collector over one Status reply."""

    def __init__(self, status: dict) -> None:
        self.status = status

    def collect(self) -> Iterator:
        yield from daemon_families(self.status)
        yield from table_families(self.status.get("tables") or [])


def daemon_families(st: dict) -> Iterator:
    core = _core()
    gauge, counter = core.GaugeMetricFamily, core.CounterMetricFamily
    yield core.InfoMetricFamily("pled", "The pled daemon that wrote these metrics.",
                                value={"version": str(st.get("version", ""))})
    if st.get("uptime_seconds") is not None:
        yield gauge("pled_uptime_seconds", "Seconds since pled started.", value=st["uptime_seconds"])
    d = st.get("daemon")
    if not isinstance(d, dict):
        return  # a pled before the metrics: nothing more to say
    yield counter("pled_attaches_total", "Attaches served: Attach replies whose table fd the kernel took."
                  + SINCE_START, value=d["attaches"])
    refused = counter("pled_refused_total", "Clients refused, by reason (operations.md, Metrics)." + SINCE_START,
                      labels=["reason"])
    for reason, n in sorted(d["refused"].items()):
        refused.add_metric([reason], n)
    yield refused
    dropped = counter("pled_dropped_connections_total", "Connections pled closed itself, by reason (a client's own "
                      "close is not counted)." + SINCE_START, labels=["reason"])
    for reason, n in sorted(d["dropped"].items()):
        dropped.add_metric([reason], n)
    yield dropped
    reloads = counter("pled_reloads_total", "Reloads ended, by result (done, or failed: nothing changed)."
                      + SINCE_START, labels=["result"])
    for result, n in sorted(d["reloads"].items()):
        reloads.add_metric([result], n)
    yield reloads
    yield gauge("pled_reloading", "1 while a reload is under way, else 0.", value=int(st.get("reload") is not None))
    yield gauge("pled_connections", "Open client connections.", value=d["connections"])
    yield gauge("pled_clients", "Connections attached to at least one table.", value=d["clients"])
    if d.get("open_fds") is not None:
        yield gauge("pled_open_fds", "File descriptors pled holds.", value=d["open_fds"])
    yield gauge("pled_max_fds", "pled's open-file limit (the soft RLIMIT_NOFILE).", value=d["max_fds"])
    if "fds_in_flight" in d:  # (a pled from before they were reported)
        yield gauge("pled_fds_in_flight", "Table fds sent to clients and not yet received by them, closed "
                    "connections' included (the kernel counts them against pled's open-file limit).",
                    value=d["fds_in_flight"])
        yield gauge("pled_closed_connections_with_fds_unread", "Connections pled has closed whose peers have not "
                    "yet received every table fd sent to them; pled keeps its end until they have.",
                    value=d["closed_with_fds_unread"])
    store = d["fdstore"]
    yield gauge("pled_fdstore_entries", "Regions pled has handed to systemd's fd store.", value=store["entries"])
    yield gauge("pled_fdstore_max_entries", "How many regions systemd's fd store keeps for pled (0: no fd store, "
                "as without systemd).", value=store["max_entries"])
    yield gauge("pled_resident_memory_bytes", "pled's own resident memory (VmRSS), the tables' memfds not counted.",
                value=d["resident_memory_bytes"])


# (Status key, metric name, help) of the per-table gauges taken as they are
_TABLE_GAUGES = (
    ("generation", "pled_table_generation", "The generation served: 1 at first, one more with each reload that "
     "changes the table."),
    ("region_bytes", "pled_table_region_bytes", "Bytes of the table's region (sealed memfd): the sources at 2 MiB "
     "boundaries and the header."),
    ("bytes", "pled_table_source_bytes", "Bytes of the table's source files."),
    ("bytes_done", "pled_table_copied_bytes", "Bytes of the sources this pled has copied into the served generation "
     "(with pled_table_source_bytes, the staging's progress; 0 for a table adopted from systemd's fd store)."),
    ("clients", "pled_table_clients", "Connections attached to the table (any generation)."),
    ("resident_share", "pled_table_resident_ratio", "Share of the region in memory, measured by the kernel."),
    ("page_size_bytes", "pled_table_page_size_bytes", "Page size the region was staged with (2 MiB huge pages or "
     "4 KiB)."),
    ("modified", "pled_table_modified", "1 when the scheduled verify found a writable table's bytes changed since "
     "staging (gpu_access = \"writable\"; `pled verify --repair` restages it), else 0; only for writable tables."),
    ("staging_seconds", "pled_table_staging_seconds", "Seconds the last staging of the table took."),
    ("staging_bytes_per_second", "pled_table_staging_bytes_per_second", "Source bytes per second of the last "
     "staging of the table."),
)


def table_families(tables: list[dict]) -> Iterator:
    core = _core()
    gauge = core.GaugeMetricFamily
    info = core.InfoMetricFamily("pled_table", "What each table holds: its layout, where its region came from "
                                 "(staged, or adopted from systemd's fd store) and its fingerprint (of its layout and "
                                 "its files' headers, not their data: `pled status`'s CONTENT follows the data).",
                                 labels=["table"])
    state = gauge("pled_table_state", "1 for the state the table is in (waiting, staging, ready, failed), 0 for "
                  "the others.", labels=["table", "state"])
    for t in tables:
        info.add_metric([t["table"]], {"layout": str(t.get("layout", "")), "origin": str(t.get("origin", "")),
                                       "fingerprint": str(t.get("fingerprint", ""))})
        for s in STATES:
            state.add_metric([t["table"], s], int(t.get("state") == s))
    yield from (family for family in (info, state) if family.samples)
    for key, name, text in _TABLE_GAUGES:
        family = gauge(name, text, labels=["table"])
        for t in tables:
            if t.get(key) is not None:
                family.add_metric([t["table"]], t[key])
        if family.samples:  # none yet (nothing staged): left out, as its figures are
            yield family
    huge = gauge("pled_table_huge_page_ratio", "Share of the region backed by 2 MiB huge pages when it was staged.",
                 labels=["table"])
    for t in tables:
        if t.get("huge_page_bytes") is not None and t.get("region_bytes"):
            huge.add_metric([t["table"]], t["huge_page_bytes"] / t["region_bytes"])
    if huge.samples:
        yield huge
