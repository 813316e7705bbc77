"""Memory cgroups (v1, as on this project's CI host) for the tests that run pled or a client in one: where this
process's memory cgroup lies, and what the kernel counted there. tests/conftest.py's ``memcg`` makes them."""
from pathlib import Path


def own_v1_memory_cgroup() -> Path | None:
    """This process's v1 memory cgroup directory (its mount point where that directory is not visible), or None."""
    path = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, p = line.split(":", 2)
        if "memory" in controllers.split(","):
            path = p
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        if fields[sep + 1] == "cgroup" and "memory" in fields[sep + 3].split(",") and path is not None:
            mount_root, mountpoint = fields[3], Path(fields[4])
            rel = path[len(mount_root):] if path.startswith(mount_root) else path
            candidate = mountpoint / rel.lstrip("/")
            return candidate if candidate.is_dir() else mountpoint
    return None


def oom_kills(cg: Path) -> int:
    for line in (cg / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


def join_and_exec(cg: Path) -> list[str]:
    """A prefix for an argv: the shell joins ``cg``, then becomes the command, so every byte it charges lands there."""
    return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cg)]

