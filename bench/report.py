"""docs/BENCHMARKS.md from one run's results (docs/benchmarks.json): every figure in it comes from ``res``.

The report holds measurements and the targets they are held against, nothing else: no figure from an
earlier run, and no generated explanation of a miss (a person writes that, after looking at the run).

A new benchmark adds its own section and verdicts from its own module, without touching this one:

    from bench import report

    @report.section
    def my_section(res: dict) -> list[str] | None:   # None (or []) where the run has no such results
        ...

    @report.verdict
    def my_verdicts(res: dict) -> list[tuple[bool, str]] | None:
        ...

Sections come out in the order of the numbers in their headings (``## 8. ...``), whatever order their modules
were imported in; ``render`` is pure, ``write`` puts the text in a file.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

GiB = 1024**3
MiB = 1024**2

# What the results are held against (pled's performance targets): the only fixed figures in a report.
TARGETS = {
    "staging_vs_dd": 0.9,  # pled's cold staging against `dd iflag=direct`
    "first_gather": 0.95,  # pled's first gather request against its asymptote
    "attach_p99_ms": 1.0,
    "adopt_s": 1.0,
    "daemon_mib": 64,  # the daemon's memory besides the table
    "page_cache_shards": 1.5,  # page cache while staging, in largest shards
    "hashing": 0.9,  # staging with digests against staging without
}

PLED_PREFAULTED = "(c) pled, fresh process, pre-faulted (4 KiB pages)"
PLED_NOT_PREFAULTED = "(c) pled, fresh process, not pre-faulted (4 KiB pages)"
MMAP_COLD = "(a) files mmapped, cold page cache"
MMAP_WARM = "(b) files mmapped, warm page cache"
PLED_HUGE = "(c) pled, fresh process, pre-faulted (huge pages)"

Section = Callable[[dict], "list[str] | None"]
Verdict = Callable[[dict], "list[tuple[bool, str]] | None"]
SECTIONS: list[Section] = []
VERDICTS: list[Verdict] = []


def section(fn: Section) -> Section:
    """Register a report section: ``fn(res)`` returns its lines (heading included), or None to leave it out."""
    SECTIONS.append(fn)
    return fn


def verdict(fn: Verdict) -> Verdict:
    """Register verdicts: ``fn(res)`` returns (met, text) pairs, or None where the run has no such results."""
    VERDICTS.append(fn)
    return fn


def fmt(s: dict, unit: str = "", scale: float = 1.0, digits: int = 2) -> str:
    """A summary as 'median (min-max)'."""
    return f"{s['median'] * scale:.{digits}f}{unit} ({s['min'] * scale:.{digits}f}-{s['max'] * scale:.{digits}f})"


def verdict_lines(res: dict) -> list[str]:
    out = []
    for fn in VERDICTS:
        for ok, text in fn(res) or ():
            out.append(f"- {'met' if ok else 'NOT met'}: {text}")
    return out


def render(res: dict) -> str:
    m = res["machine"]
    lines = [
        "# Benchmarks", "",
        f"Produced by `{res.get('command', 'make bench')}` on {m['date']}. Medians over the repeats, with (min-max).",
        "These are measurements, not tests: the test suite has no timing thresholds.", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB RAM, kernel {m['kernel']}, "
        f"Python {m['python']}, "
        f"shmem_enabled `{m['shmem_enabled']}`.",
    ]
    if "table" in res and "staging" in res:
        t = res["table"]
        width = f" of width {t['row_width']}" if t.get("row_width") else ""
        lines.append(f"Table: {t['layout']}, {t['shards']} shards, {res['staging']['bytes'] / GiB:.2f} GiB "
                     f"({t['rows']:,} rows{width}).")
    for body in sorted(filter(None, (fn(res) for fn in SECTIONS)), key=_number):
        lines += [""] + body
    verdicts = verdict_lines(res)
    if verdicts:
        lines += ["", "## Against the targets", ""] + verdicts
    return "\n".join(lines) + "\n"


def _number(body: list[str]) -> float:
    """A section's place: the N of its heading ("## N. ..."), whatever order the modules were imported in."""
    heading = next((line for line in body if line.startswith("## ")), "")
    number = heading[3:].split(".", 1)[0]
    return int(number) if number.isdigit() else float("inf")


def write(res: dict, path: Path) -> None:
    Path(path).write_text(render(res))


# -- pled's own sections -------------------------------------------------------------------------

STAGING_METHODS = ("pled", "pled without digests", "dd iflag=direct", "cp to /dev/shm")


@section
def staging(res: dict) -> list[str] | None:
    st, m = res.get("staging"), res["machine"]
    if not st:
        return None
    lines = [
        "## 1. Staging throughput", "",
        "Cold: every shard's page cache dropped first (POSIX_FADV_DONTNEED on each shard, which leaves the rest of the",
        "host's page cache alone). `dd iflag=direct` is the disk's own limit; `cp` to /dev/shm is what an operator",
        "would do by hand; \"pled without digests\" is pled's staging without the digest of each shard, to show what",
        "hashing (on the other core, while the next shard is copied) costs. \"Cold\" is cold in this machine's page",
        "cache; on a virtual disk the host's cache may still hold the data.", "",
        "| method | cold GB/s | warm GB/s | pled / this, cold | pled / this, warm |", "|---|---|---|---|---|",
    ]
    pc, pw = st["pled cold"]["gb_s"]["median"], st["pled warm"]["gb_s"]["median"]
    for name in STAGING_METHODS:
        cold, warm = st.get(f"{name} cold"), st.get(f"{name} warm")
        if cold is None:
            continue
        lines.append(f"| {name} | {fmt(cold['gb_s'])} | {fmt(warm['gb_s']) if warm else 'same as cold (O_DIRECT)'} | "
                     f"{pc / cold['gb_s']['median']:.2f} | "
                     f"{pw / (warm or cold)['gb_s']['median']:.2f} |")
    peak = st["pled cold"]["peak_page_cache"]
    lines += [
        "",
        "- Peak page cache of the sidecar during pled's cold staging (sampled every 5 ms): "
        f"{fmt(peak, ' MiB', 1 / MiB, 1)}; "
        f"the largest shard is {st['largest_shard'] / MiB:.1f} MiB (ratio {peak['median'] / st['largest_shard']:.2f}).",
        f"- Huge-page share of the staged table: {fmt(st['pled cold']['huge_share'], '', 100, 0)} % "
        f"(shmem_enabled `{m['shmem_enabled']}`)."
        + (" With `advise`, set for the huge-page runs and restored after: "
           f"`{res['huge_share'].split(' INFO ', 1)[-1]}`"
           if res.get("huge_share") else ""),
    ]
    d = res.get("daemon")
    if d:
        lines.append(
            "- pled's own memory, the daemon serving this table and a 128-shard one: "
            f"VmRSS {d['VmRSS'] / MiB:.1f} MiB, "
            f"of which mapped table pages (RssShmem) {d.get('RssShmem', 0) / MiB:.1f} MiB, so "
            f"{(d['VmRSS'] - d.get('RssShmem', 0)) / MiB:.1f} MiB besides the table; "
            f"peak VmHWM {d['VmHWM'] / MiB:.1f} MiB.")
    return lines


@section
def attach(res: dict) -> list[str] | None:
    at = res.get("attach")
    if not at:
        return None
    tables = [name for name, a in at.items() if isinstance(a, dict) and "median_ms" in a]
    lines = ["## 2. Attach latency", "",
             "Connect, receive the fd, map, build the tensor views; no pre-faulting. Over "
             f"{at[tables[0]]['n']} attaches in one client process.", "",
             "| table | shards | median | p99 | max |", "|---|---|---|---|---|"]
    for name in tables:
        a = at[name]
        lines.append(f"| {name} | {a['shards']} | {a['median_ms']:.3f} ms | {a['p99_ms']:.3f} ms | "
                     f"{a['max_ms']:.3f} ms |")
    huge = res.get("attach_huge")
    lines += ["", "Pre-faulting (`MADV_POPULATE_READ`, then one read per page) per GiB, fresh process each time: "
                  "4 KiB pages "
                  f"{fmt(at['populate_s_per_gib'], ' ms', 1e3, 1)}"
              + (f"; huge pages {fmt(huge['populate_s_per_gib'], ' ms', 1e3, 1)}." if huge else
                 "; huge pages not measured (shmem_enabled could not be set).")]
    return lines


@section
def gathers(res: dict) -> list[str] | None:
    ga = res.get("gathers")
    if not ga:
        return None
    ids = res["gather_ids"]
    lines = ["## 3. Cold-start gathers", "",
             f"A dequant worker's first requests: {ids} random row ids per request (16 ids per token, "
             f"{ids // 16} tokens), gathered and dequantized with numpy, each run in a fresh process, "
             f"{res['gather_requests']} requests per run. The files are mapped with mmap(MAP_SHARED), which is what "
             "safetensors' own loader does. Asymptote: the median of the last third of the requests.", "",
             "| case | first request, rows/s | first 10 | asymptote | first / asymptote | requests to within 5% |",
             "|---|---|---|---|---|---|"]
    for name, g in ga.items():
        lines.append(f"| {name} | {fmt(g['first'], '', 1, 0)} | {fmt(g['first10'], '', 1, 0)} | "
                     f"{fmt(g['asymptote'], '', 1, 0)} | "
                     f"{fmt(g['first_over_asymptote'])} | {g['requests_to_5pct']['median']:.0f} |")
    if all(k in ga for k in (MMAP_COLD, MMAP_WARM, PLED_PREFAULTED)):
        warm = ga[MMAP_WARM]["asymptote"]["median"]
        cold_first = ga[MMAP_COLD]["first"]["median"]
        pled_first = ga[PLED_PREFAULTED]["first"]["median"]
        lines += ["", f"pled's first request against the cold mmap's first request: {pled_first / cold_first:.1f}x; "
                      f"against the warm mmap asymptote: {pled_first / warm:.2f}."]
    return lines


@section
def restart(res: dict) -> list[str] | None:
    rs = res.get("restart")
    if not rs:
        return None
    lines = ["## 4. Restart cost", "",
             "From `pled serve` starting to `ready:` (Python start-up included), page cache of the sidecar dropped "
             "before each start. Bytes read is the process's rchar, every byte it read through a system call: its "
             "Python imports in both; a fresh staging reads the sidecar once and its own region once more, to hash it.",
             "",
             "| start | time to ready | bytes read |", "|---|---|---|"]
    for name, r in rs.items():
        lines.append(f"| {name} | {fmt(r['seconds'], ' s')} | {r['rchar']['median'] / MiB:.1f} MiB |")
    fresh, adopt = rs["fresh staging"]["seconds"]["median"], rs["adopted from the fd store"]["seconds"]["median"]
    lines += ["", f"Adoption takes {adopt / fresh:.2f} of a fresh staging's time."]
    return lines


@verdict
def pled_targets(res: dict) -> list[tuple[bool, str]] | None:
    needed = ("staging", "attach", "gathers", "restart", "daemon")
    if not all(k in res for k in needed):
        return None
    st, at, ga, rs = res["staging"], res["attach"], res["gathers"], res["restart"]
    out = []
    ratio_dd = st["pled cold"]["gb_s"]["median"] / st["dd iflag=direct cold"]["gb_s"]["median"]
    out.append((ratio_dd >= TARGETS["staging_vs_dd"],
                f"staging cold at {ratio_dd:.2f} of `dd iflag=direct` (target {TARGETS['staging_vs_dd']})"))
    if PLED_PREFAULTED in ga:
        g = ga[PLED_PREFAULTED]
        first = g["first_over_asymptote"]["median"]
        others = [(PLED_HUGE, "with huge pages"), (PLED_NOT_PREFAULTED, "a fresh mapping without pre-faulting"),
                  (MMAP_COLD, "the cold files")]
        compared = "; ".join(f"{what} {ga[key]['first_over_asymptote']['median']:.2f}"
                             for key, what in others if key in ga)
        out.append((first >= TARGETS["first_gather"],
                    f"pled's first gather request at {first:.2f} of its asymptote (target {TARGETS['first_gather']}); "
                    f"per run {', '.join(f'{r:.2f}' for r in g['runs_first_over_asymptote'])}"
                    + (f"; {compared}" if compared else "")))
    p99 = max(a["p99_ms"] for a in at.values() if isinstance(a, dict) and "p99_ms" in a)
    out.append((p99 < TARGETS["attach_p99_ms"],
                f"attach p99 {p99:.3f} ms without pre-faulting (target under {TARGETS['attach_p99_ms']} ms)"))
    adopt = rs["adopted from the fd store"]["seconds"]["median"]
    out.append((adopt < TARGETS["adopt_s"],
                f"adoption from the fd store ready in {adopt:.2f} s (target under {TARGETS['adopt_s']} s)"))
    own = (res["daemon"]["VmRSS"] - res["daemon"].get("RssShmem", 0)) / MiB
    out.append((own < TARGETS["daemon_mib"],
                f"daemon memory besides the table {own:.1f} MiB (target under {TARGETS['daemon_mib']} MiB)"))
    cache = st["pled cold"]["peak_page_cache"]["median"] / st["largest_shard"]
    out.append((cache <= TARGETS["page_cache_shards"],
                f"page cache during staging at most {cache:.2f} of the largest shard "
                f"(target {TARGETS['page_cache_shards']})"))
    if "pled without digests cold" in st:
        hashing = st["pled cold"]["gb_s"]["median"] / st["pled without digests cold"]["gb_s"]["median"]
        out.append((hashing >= TARGETS["hashing"],
                    f"staging with content digests at {hashing:.2f} of staging without them "
                    f"(target {TARGETS['hashing']})"))
    return out
