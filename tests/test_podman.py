"""deploy/'s Containerfiles built and run by a real container runtime (podman), both directions:

- pled in a container (deploy/Containerfile) serving a client on the host: attach, gather, `pled status` in the
  container, HEALTHCHECK, a restart with the client attached, and a refusal (exit 78) under a too-small `--memory`;
- pled on the host serving a client in a container built by deploy/vllm-with-pled.Containerfile, through a read-only
  socket mount: the start-up hook (pled-autoload.pth) serves `safetensors.safe_open` from pled in a process that
  loads no vLLM plugins.

No image registry is needed. The base is made here (tests/podmanlib.py): `debootstrap` (Debian's mirror, apt's
own client) of a minimal bookworm with python3 and pip, `podman import`ed, its tar cached in .cache/podman-base/. Only
the recipes' FROM lines change, in a copy: the Python base becomes that image, vLLM's image a stand-in (the base with
torch and safetensors, no vLLM: a process there loads no plugins). Inside a build no index is reached: the wheels are
fetched here with `pip download` and mounted at /wheelhouse, which the base's PIP_NO_INDEX/PIP_FIND_LINKS point to.

The test's own containers.conf (CONTAINERS_CONF, tests/podmanlib.py) carries what some machines need: runc and default
ulimits within the hard limits.
The build and start times are written to stderr when the module ends (shown with pytest -s, or on a failure). Needs
root, podman, runc and debootstrap; skips without them, naming what is missing.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch

from harness import SUMMARY, run_pled, unused_gid, write_config
from pled import client
from pled.generator import make_sidecar
from podmanlib import base_image, run as _run, workspace

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
TAG = f"pled-test-{os.getpid()}"  # this run's images and containers, removed at the end
PLED_IMAGE, VLLM_STANDIN, VLLM_IMAGE = f"localhost/{TAG}-pled", f"localhost/{TAG}-standin", f"localhost/{TAG}-vllm"
ROWS = [0, 1, 57, 99, 150, 199]
# the first test also pays for the module's builds (about 3.5 min from cold); each starts pled (in a container or here)
pytestmark = [pytest.mark.timeout(1500), pytest.mark.daemon, pytest.mark.root, pytest.mark.slow]
TIMES: dict[str, float] = {}


def _wheelhouse(d: Path) -> Path:
    """The wheels the images install, fetched here: the build backend, pled's dependencies with both extras, and
    torch and safetensors for the stand-in of vLLM's image (the base's python3 is this Debian's, as is ours)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = [*project["build-system"]["requires"], *project["project"]["dependencies"],
              *project["project"]["optional-dependencies"]["daemon"], "torch==" + torch.__version__.split("+")[0],
              "safetensors"]
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(d),
                        *wanted], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.skip(f"pip download could not fetch the images' wheels (is PyPI reachable?): {r.stderr[-600:]}")
    return d


def _recipe(name: str, dest: Path, python_base: str, vllm_base: str = "") -> Path:
    """The recipe with only its FROM lines changed."""
    text = (DEPLOY / name).read_text()
    text = re.sub(r"^FROM (docker\.io/library/)?python:\S+", f"FROM {python_base}", text, flags=re.M)
    text = re.sub(r"^FROM (docker\.io/)?vllm/vllm-openai:\S+", f"FROM {vllm_base}", text, flags=re.M)
    assert all(line.split()[1].startswith("localhost/") for line in text.splitlines() if line.startswith("FROM ")), text
    (dest / name).write_text(text)
    return dest / name


def _build(env: dict, containerfile: Path, tag: str, wheels: Path, context: Path = ROOT) -> None:
    t0 = time.monotonic()
    _run(["podman", "build", "--format", "docker", "--network", "none", "--layers=false",
          "--volume", f"{wheels}:/wheelhouse:ro",
          "-f", str(containerfile), "-t", tag, str(context)], env, timeout=900)
    TIMES[f"build {tag.rsplit('-', 1)[1]}"] = time.monotonic() - t0


@pytest.fixture(scope="module")
def podman():
    """env for podman; the two images built from deploy/'s recipes. Removes this run's containers and images."""
    with workspace("pled-podman-") as (work, env):
        try:
            t0 = time.monotonic()
            base = base_image(env, TIMES)
            TIMES["base image"] = time.monotonic() - t0
            wheels = _wheelhouse(work / "wheels")
            _build(env, _recipe("Containerfile", work, base), PLED_IMAGE, wheels)
            standin = work / "standin"
            standin.mkdir()
            (standin / "Containerfile").write_text(f"FROM {base}\nRUN pip install --no-cache-dir "
                                                   f"torch=={torch.__version__.split('+')[0]} safetensors\n")
            _build(env, standin / "Containerfile", VLLM_STANDIN, wheels, context=standin)
            _build(env, _recipe("vllm-with-pled.Containerfile", work, base, VLLM_STANDIN), VLLM_IMAGE, wheels)
            yield env
        finally:
            ps = _run(["podman", "ps", "-aq", "--filter", f"name=^{TAG}"], env, check=False).stdout.split()
            if ps:
                _run(["podman", "rm", "-f", "-t", "0", *ps], env, check=False)
            _run(["podman", "rmi", "-f", VLLM_IMAGE, VLLM_STANDIN, PLED_IMAGE], env, check=False)
            SUMMARY.append("podman test times: " + ", ".join(f"{k} {v:.1f} s" for k, v in TIMES.items()))


@pytest.fixture
def shared_dir(open_dir):
    """The open_dir fixture as a Path: a directory under /tmp that containers and any uid may reach."""
    return Path(open_dir)


def _digest(table) -> str:
    return hashlib.sha256(table.gather(torch.tensor(ROWS)).float().numpy().tobytes()).hexdigest()


def _wait_ready(env: dict, name: str, sock: Path, t0: float, timeout: float = 60) -> float:
    """Seconds from t0 until `pled status` in the container exits 0 (every table ready and resident)."""
    deadline = t0 + timeout
    while True:
        r = _run(["podman", "exec", name, "pled", "status", "-c", "/etc/pled/pled.toml"], env, check=False)
        if r.returncode == 0 and sock.exists():
            return time.monotonic() - t0
        state = _run(["podman", "container", "inspect", "--format", "{{.State.Status}}", name], env, check=False)
        if time.monotonic() > deadline or state.stdout.strip() not in ("created", "running", "configured"):
            logs = _run(["podman", "logs", name], env, check=False)
            raise AssertionError(f"pled in {name} not ready ({state.stdout.strip()}, {time.monotonic() - t0:.1f} s): "
                                 f"{r.stdout}{r.stderr}\n"
                                 f"{logs.stdout}{logs.stderr}")
        time.sleep(0.1)


def test_pled_in_a_container_serves_a_host_client(podman, shared_dir):
    env = podman
    make_sidecar(str(shared_dir / "ples_int4"), "ples_int4", shards=2, rows=100)
    (shared_dir / "etc").mkdir()
    run = shared_dir / "run"
    run.mkdir(mode=0o755)
    write_config(shared_dir / "etc" / "pled.toml", {"t": shared_dir / "ples_int4"}, socket="/run/pled/pled.sock",
                 headroom_margin=0)
    group = unused_gid()
    name = f"{TAG}-pled"
    models = shared_dir / "ples_int4"  # mounted at the same path: pled's config names it
    mounts = ["-v", f"{shared_dir / 'etc'}:/etc/pled:ro", "-v", f"{models}:{models}:ro"]
    # As docs/operations.md runs it: no capabilities, a read-only root, --user 0:<gid> makes <gid> the socket's group.
    t0 = time.monotonic()
    _run(["podman", "run", "-d", "--name", name, "--network", "none", "--memory", "512m", "--memory-swap", "512m",
          "--cap-drop", "all", "--read-only", "--user", f"0:{group}", *mounts, "-v", f"{run}:/run/pled", PLED_IMAGE],
         env)
    TIMES["pled container ready"] = _wait_ready(env, name, run / "pled.sock", t0)
    sock = str(run / "pled.sock")
    assert os.stat(sock).st_gid == group and os.stat(sock).st_mode & 0o777 == 0o660
    # The image's HEALTHCHECK survived (podman keeps it only with --format docker) and passes.
    inspect = json.loads(_run(["podman", "image", "inspect", PLED_IMAGE], env).stdout)[0]
    assert inspect["Healthcheck"]["Test"][1:3] == ["pled", "status"], inspect
    assert _run(["podman", "healthcheck", "run", name], env, check=False).returncode == 0

    with client.attach("t", socket=sock) as held:
        expected = _digest(held)
        with client.attach("t", socket=sock) as again:  # what the host reads matches the sidecar on disk
            assert _digest(again) == expected
        # pled in its own PID namespace: the host client is counted, shown as pid 0 with no command (docs/operations.md)
        st = json.loads(_run(["podman", "exec", name, "pled", "status", "--json", "-c", "/etc/pled/pled.toml"],
                             env).stdout)
        assert [(c["pid"], c["command"], c["tables"]) for c in st["clients"]] == [(0, "?", ["t"])], st
        assert st["pid"] == 1, st  # pled is the container's PID 1
        # A restart with the client attached: the client keeps reading its mapping; a new pled stages again.
        t1 = time.monotonic()
        _run(["podman", "restart", "-t", "30", name], env)
        TIMES["pled container restart"] = _wait_ready(env, name, run / "pled.sock", t1)
        assert _digest(held) == expected
        with client.attach("t", socket=sock) as after:
            assert _digest(after) == expected and after.generation >= 1
    logs = _run(["podman", "logs", name], env)
    text = logs.stdout + logs.stderr
    assert "SIGTERM: stopping" in text and text.count("ready:") == 2, text
    assert "to pid 0 uid 0" in text, text  # the log, too, cannot name a host client's pid

    # In the host's PID namespace (--pid=host; hostPID in Kubernetes), pled lists the host client by its pid.
    hostpid = run.parent / "run-hostpid"
    hostpid.mkdir()
    t2 = time.monotonic()
    _run(["podman", "run", "-d", "--name", f"{TAG}-hostpid", "--pid", "host", "--network", "none", "--memory", "512m",
          "--cap-drop", "all", "--read-only", "--user", f"0:{group}", *mounts, "-v", f"{hostpid}:/run/pled",
          PLED_IMAGE], env)
    _wait_ready(env, f"{TAG}-hostpid", hostpid / "pled.sock", t2)
    with client.attach("t", socket=str(hostpid / "pled.sock")) as seen:
        assert _digest(seen) == expected
        st = json.loads(_run(["podman", "exec", f"{TAG}-hostpid", "pled", "status", "--json", "-c",
                              "/etc/pled/pled.toml"], env).stdout)
        assert [c["pid"] for c in st["clients"]] == [os.getpid()], st
    _run(["podman", "rm", "-f", "-t", "10", f"{TAG}-hostpid"], env)

    # Too small a memory limit for the table and its margin: the preflight refuses with 78 (EX_CONFIG), naming the
    # container's cgroup limit.
    (shared_dir / "etc-small").mkdir()
    write_config(shared_dir / "etc-small" / "pled.toml", {"t": shared_dir / "ples_int4"}, socket="/run/pled/pled.sock",
                 headroom_margin=256 * 1024**2)
    small = run.parent / "run-small"
    small.mkdir()
    r = _run(["podman", "run", "--name", f"{TAG}-small", "--network", "none", "--memory", "128m",
              "--memory-swap", "128m", "--cap-drop", "all", "--read-only", "--user", f"0:{group}",
              "-v", f"{shared_dir / 'etc-small'}:/etc/pled:ro", *mounts[2:], "-v", f"{small}:/run/pled", PLED_IMAGE],
             env, check=False, timeout=120)
    assert r.returncode == 78, r.stdout + r.stderr
    assert "134217728" in (r.stdout + r.stderr) or "128.0 MiB" in (r.stdout + r.stderr), r.stdout + r.stderr


HOOKED = r"""
import hashlib, json, os, sys
hooked = getattr(sys, "_pled_autoload_tried", False), "pled.autoload" in sys.modules
from safetensors import safe_open
import torch
with safe_open(sys.argv[1], framework="pt") as f:
    t = f.get_tensor("weight_i4")
    print(json.dumps({"hooked": hooked, "served_by": type(f).__module__, "vllm": "vllm" in sys.modules,
                      "sha": hashlib.sha256(t.numpy().tobytes()).hexdigest(), "pid": os.getpid()}), flush=True)
    sys.stdin.readline()  # attached until the test has looked at `pled status`
"""


def test_pled_on_the_host_serves_a_client_in_the_vllm_image(podman, daemon, shared_dir):
    env = podman
    make_sidecar(str(shared_dir / "ples_int4"), "ples_int4", shards=2, rows=100)
    shard = shared_dir / "ples_int4" / "shard_1.safetensors"
    group = unused_gid()
    run = shared_dir / "run"
    run.mkdir(mode=0o750)
    os.chown(run, -1, group)  # as pled.service's RuntimeDirectory: 0750 in the socket's group
    pled = daemon({"t": shared_dir / "ples_int4"}, socket=str(run / "pled.sock"), allow_groups=[group])
    os.chown(pled.socket, -1, group)  # the socket 0660 in that group (pled.service: Group=pled)
    with client.attach("t", socket=pled.socket) as t:
        expected = hashlib.sha256(t.tensors["shard_1/weight_i4"].numpy().tobytes()).hexdigest()

    # The run line in docs/operations.md: the socket directory read-only, PLED_SOCKET, the group by number, the
    # models at the same path; a non-root user, admitted through the group.
    proc = subprocess.Popen(
        ["podman", "run", "--rm", "-i", "--name", f"{TAG}-vllm", "--network", "none", "--user", "4321:4321",
         "--group-add", str(group), "-v", f"{run}:/run/pled:ro", "-e", "PLED_SOCKET=/run/pled/pled.sock",
         "-v", f"{shared_dir / 'ples_int4'}:{shared_dir / 'ples_int4'}:ro", VLLM_IMAGE, "python3", "-c", HOOKED,
         str(shard)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        if not line:
            proc.wait(timeout=60)
            raise AssertionError(f"the container ended ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        got = json.loads(line)
        # The start-up hook ran at the interpreter's start, and safe_open was served by pled, not read from disk.
        assert got["hooked"] == [True, True] and not got["vllm"], got
        assert got["served_by"] == "pled.client.safe_open_seam" and got["sha"] == expected, got
        # pled, on the host, lists the container's process by its host pid and host uid.
        st = run_pled("status", "--json", "--socket", pled.socket)
        assert st.returncode == 0, st.stdout + st.stderr
        (listed,) = [c for c in json.loads(st.stdout)["clients"] if c["uid"] == 4321]
        nspid = next(line for line in Path(f"/proc/{listed['pid']}/status").read_text().splitlines()
                     if line.startswith("NSpid:"))
        assert nspid.split()[-1] == str(got["pid"]) and listed["pid"] != got["pid"], (nspid, got)
        proc.stdin.write("done\n")
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
