"""The package's version, as docs/operations.md ("A higher version") says (issue 47, item 6): one source,
pled/__init__.py's __version__, which debian/changelog's top entry repeats (a build where they disagree is refused,
78); `make deb VERSION=V` hands V to tools/deb.sh, whose build carries a changelog entry for V above the checkout's
(`tools/deb.sh --changelog V` prints it, building nothing); a V that is not a Debian version, has a revision, or does
not sort above the changelog's is refused in one line, 64. The real tools (dpkg-parsechangelog, dpkg, make, bash)
on the real files; the whole build is tests/test_deb.py's (root, slow)."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import pled

ROOT = Path(__file__).resolve().parent.parent
DEB_SH = ROOT / "tools" / "deb.sh"
pytestmark = pytest.mark.skipif(not shutil.which("dpkg-parsechangelog"), reason="dpkg-dev not installed")


def parse(changelog: str, field: str = "Version") -> str:
    return subprocess.run(["dpkg-parsechangelog", "-l", "-", "-S", field], input=changelog, capture_output=True,
                          text=True, check=True).stdout.strip()


def deb_sh(*args: str, root: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(root / "tools" / "deb.sh"), *args], capture_output=True, text=True, timeout=60)


def checkout_version() -> str:
    return parse((ROOT / "debian" / "changelog").read_text())


def test_the_changelog_repeats_pled_version_and_a_plain_build_uses_it_as_it_is():
    assert checkout_version().split(":")[-1].rsplit("-", 1)[0] == pled.__version__
    r = deb_sh("--changelog")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (ROOT / "debian" / "changelog").read_text()


def test_the_docs_higher_version_is_what_a_version_build_carries():
    """The version docs/operations.md builds is above the checkout's, and what tools/deb.sh's changelog says."""
    doc = (ROOT / "docs" / "operations.md").read_text()
    shown = re.search(r"^make deb VERSION=(\S+)", doc, flags=re.M)
    assert shown, "docs/operations.md shows no `make deb VERSION=...`"
    version = shown[1]
    current = checkout_version()
    assert subprocess.run(["dpkg", "--compare-versions", version, "gt", current]).returncode == 0, (version, current)
    assert version == f"{current}+local1", "docs/operations.md's example follows the changelog's version"
    r = deb_sh("--changelog", version)
    assert r.returncode == 0, r.stderr
    assert parse(r.stdout) == version and parse(r.stdout, "Distribution") == "bookworm"
    assert f"Rebuilt as {version}." in parse(r.stdout, "Changes")
    # the checkout's entries follow, unchanged, and the checkout's file is left as it was
    assert r.stdout.endswith("\n\n" + (ROOT / "debian" / "changelog").read_text())
    assert checkout_version() == current


def test_make_deb_hands_its_version_to_tools_deb_sh():
    r = subprocess.run(["make", "-n", "-C", str(ROOT), "deb", "VERSION=9.9.9+local7", "V=1"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^V=1 tools/deb.sh build/deb 9\.9\.9\+local7$", r.stdout, flags=re.M), r.stdout


@pytest.mark.parametrize(("version", "says"), [
    ("0.0.1", "does not sort above debian/changelog's"),
    ("{current}", "does not sort above debian/changelog's"),
    ("{current}-1", "has a Debian revision"),
    ("{current} local", "is not a Debian version"),
    ("+local1", "is not a Debian version"),
])
def test_a_version_apt_would_not_take_as_an_upgrade_is_refused_in_one_line_with_64(version, says):
    version = version.format(current=checkout_version())
    r = deb_sh("--changelog", version)
    assert r.returncode == 64, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"tools/deb.sh: VERSION={version} {says}"), r.stderr


def test_a_changelog_that_disagrees_with_pled_version_is_refused_with_78(tmp_path):
    """A copy of what tools/deb.sh reads (itself, debian/changelog, pled/__init__.py) with __version__ moved on."""
    for name in ("tools/deb.sh", "debian/changelog", "pled/__init__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    init = tmp_path / "pled" / "__init__.py"
    init.write_text(init.read_text().replace(f'"{pled.__version__}"', '"9.0.0"'))
    r = deb_sh("--changelog", root=tmp_path)
    assert r.returncode == 78, (r.returncode, r.stderr)
    assert len(r.stderr.splitlines()) == 1 and f"version {checkout_version()} is not" in r.stderr \
        and "__version__ 9.0.0" in r.stderr and "dch -v 9.0.0" in r.stderr, r.stderr
