"""The benchmark report holds the figures of the run that wrote it, and no others (bench/report.py)."""
import copy
import json
import random
import re
from pathlib import Path

import bench.__main__  # noqa: F401  registers sections 5-8, as python -m bench does
from bench import report

SAMPLE = Path(__file__).parent / "data" / "benchmarks-sample.json"
NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")


def sample() -> dict:
    return json.loads(SAMPLE.read_text())


# What the run was asked to do (sizes, counts), not what it measured.
CONFIGURED = {"gather_ids", "gather_requests", "n", "shards", "rows", "row_width", "cores", "idle_s"}


def perturbed(res: dict, seed: int) -> dict:
    """Every measured figure multiplied by its own random factor: ratios between them change too."""
    rng = random.Random(seed)

    def walk(x, key=None):
        if isinstance(x, dict):
            return {k: walk(v, k) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v, key) for v in x]
        if isinstance(x, bool) or key in CONFIGURED:
            return x
        if isinstance(x, float):
            return x * rng.uniform(0.3, 3.0)
        if isinstance(x, int):
            return int((x + rng.randint(1, 10**8)) * rng.uniform(0.3, 3.0))
        return x

    out = walk(copy.deepcopy(res))
    out["machine"] = {"cpu": "Test CPU", "cores": 2, "memory_gib": rng.uniform(1, 99), "kernel": "test",
                      "python": "test", "shmem_enabled": "[advise]", "date": "today"}
    out["huge_share"] = f"x INFO table staged: huge pages {rng.randint(0, 100)}%"  # the run's own log line
    return out


def test_the_figures_of_the_result_are_in_the_report():
    res = sample()
    res["staging"]["pled cold"]["gb_s"]["median"] = 3.21
    res["staging"]["dd iflag=direct cold"]["gb_s"]["median"] = 1.07
    res["gathers"][report.PLED_NOT_PREFAULTED]["first_over_asymptote"]["median"] = 0.37
    res["gathers"][report.MMAP_COLD]["first_over_asymptote"]["median"] = 0.04
    res["attach"]["ples128"]["p99_ms"] = 2.468
    text = report.render(res)
    assert "| pled | 3.21 (" in text
    assert "staging cold at 3.00 of `dd iflag=direct`" in text  # 3.21 / 1.07
    assert "a fresh mapping without pre-faulting 0.37; the cold files 0.04" in text
    assert "- NOT met: attach p99 2.468 ms" in text
    # What earlier reports carried whatever was measured: fixed figures and ready-made explanations of a miss.
    for fixed in ("against 0.10", "0.00 for the cold files", "noise", "preempted", "2 shared cores", "virtio"):
        assert fixed not in text, fixed


def test_no_figure_in_the_report_survives_a_change_of_every_measurement():
    """Render the same result twice with every measured float changed: a number that stays put at the same
    place in the text is a fixed figure, unless it is a target, a count the run was configured with, or a
    section number."""
    res = sample()
    renders = [report.render(perturbed(res, seed)).splitlines() for seed in (1, 2, 3, 4, 5)]
    assert len({len(r) for r in renders}) == 1
    ints = {res["gather_ids"], res["gather_requests"], res["table"]["shards"], res["table"]["rows"], 2}
    ints |= {a["n"] for a in res["attach"].values() if "n" in a}
    ints |= {a["shards"] for a in res["attach"].values() if "shards" in a}
    allowed = {str(v) for v in report.TARGETS.values()} | {f"{v:,}" for v in ints} | {str(v) for v in ints}
    allowed |= {str(v // 16) for v in ints}  # tokens per request, from the ids per request
    allowed |= {"1.00"}  # pled against itself in the staging table
    allowed |= {str(block["idle_s"]) for block in res["table_gather"].values()}  # the gather section's pause
    # sections, "every 5 ms", "first 10", "16 ids per token", "p99", a name
    allowed |= {"1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "16", "99", "128"}
    fixed = []
    for lines in zip(*renders, strict=True):  # a figure that comes out the same five times is fixed (a small ratio
        # rounded to two digits can agree two or three times by chance)
        numbers = [NUMBER.findall(line) for line in lines]
        if len({len(n) for n in numbers}) != 1:
            continue
        fixed += [(same[0], lines[0]) for same in zip(*numbers, strict=True)
                  if len(set(same)) == 1 and same[0] not in allowed]
    assert not fixed, fixed


def test_the_report_renders_from_a_stored_result_on_the_command_line(tmp_path):
    import subprocess
    import sys

    res = sample()
    res["restart"]["adopted from the fd store"]["seconds"]["median"] = 0.123
    stored = tmp_path / "result.json"
    stored.write_text(json.dumps(res))
    out = tmp_path / "BENCHMARKS.md"
    r = subprocess.run([sys.executable, "-m", "bench", "--render", str(stored), "--out", str(out),
                        "--json", str(tmp_path / "j")], capture_output=True, text=True,
                       cwd=Path(__file__).parent.parent, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "adoption from the fd store ready in 0.12 s" in out.read_text()
    assert out.read_text() == report.render(res)


def test_a_section_registered_by_another_benchmark_is_rendered_and_one_without_results_left_out():
    @report.section
    def extra(res):
        return ["## 5. Extra", "", f"measured {res['extra']['x']:.2f} units"] if "extra" in res else None

    try:
        res = sample()
        assert "## 5. Extra" not in report.render(res)
        res["extra"] = {"x": 6.54}
        assert "measured 6.54 units" in report.render(res)
    finally:
        report.SECTIONS.remove(extra)


def test_the_soak_reports_breaches_and_byte_mismatches_and_fails_on_them():
    """bench/soak.py's stuck-reply attacker and byte checks; a result stored before them still renders."""
    res = sample()
    assert "Stuck replies over a reload" not in report.render(res)  # the sample predates them
    res["soak"]["good"]["mismatches"] = 3
    res["soak"]["stuck"] = {"replies_that_fit": 278, "tuned_to": 279, "attach_replies_stuck": 17, "fds_checked": 21,
                            "breaches": 13, "breach_examples": ["socket:[44884]: mode 140777, seals 0x0"]}
    text = report.render(res)
    assert "278 Ping replies fit in pled's socket buffer (tuned to 279); 17 Attach replies" in text
    assert "13 of the 21 fds received were not its sealed memfd (socket:[44884]: mode 140777, seals 0x0)" in text
    assert "- NOT met: soak: 13 of 21 fds sent over stuck Attach replies not the table's sealed memfd" in text
    assert "refused, 3 byte mismatches with the source files (target 0)" in text
    res["soak"]["good"]["mismatches"] = res["soak"]["stuck"]["breaches"] = 0
    assert "NOT met: soak" not in report.render(res)


def test_sections_come_out_in_the_order_of_their_numbers_whatever_the_import_order():
    res = sample()
    v = {"median": 51.0, "min": 40.0, "max": 60.0, "n": 30}
    res["status_cli"] = {"python -c pass": v, "pled status --socket": v, "pled status -c": v}
    numbers = [int(line[3:].split(".")[0]) for line in report.render(res).splitlines()
               if line.startswith("## ") and line[3].isdigit()]
    assert numbers == sorted(numbers) and 8 in numbers, numbers
    # ruff's import sorting put soak (7) before table_gather (6): registration order must not decide
    report.SECTIONS.reverse()
    try:
        again = [line for line in report.render(res).splitlines() if line.startswith("## ")]
    finally:
        report.SECTIONS.reverse()
    assert again == [line for line in report.render(res).splitlines() if line.startswith("## ")]
