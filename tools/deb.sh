#!/usr/bin/env bash
# Build the Debian 12 package of pled's host side (debian/; `make deb`), then check it with lintian.
#
#     tools/deb.sh [OUT [VERSION]]
#     tools/deb.sh --changelog [VERSION]     print the debian/changelog that build would use, build nothing
#
# OUT: where the .deb, .changes and .buildinfo go (default build/deb). VERSION: build as this Debian version instead
# of debian/changelog's (a local patch, an upgrade test), with a changelog entry saying so; it must sort above
# debian/changelog's version (dpkg --compare-versions), else apt would not take it as an upgrade. The version's one
# source is pled/__init__.py's __version__ (the wheel's and `pled --version`'s); debian/changelog's top entry must
# carry the same upstream version, and a build where they disagree is refused. The build runs in a copy of the
# checkout's files (tracked, and untracked ones git does not ignore: dpkg-buildpackage writes beside its source
# directory) with a PATH of the system's directories only, so no other Python (a pyenv one under /root) takes part.
set -euo pipefail
cd "$(dirname "$0")/.."
changelog_only=
if [ "${1:-}" = --changelog ]; then changelog_only=1; shift; set -- "" "${1:-}"; fi
out=$(realpath -m "${1:-build/deb}")
version=${2:-}

# The version: pled.__version__ and debian/changelog agree; VERSION, where given, is a Debian version above them.
python_version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' pled/__init__.py)
debian_version=$(dpkg-parsechangelog -l debian/changelog -S Version)
upstream=${debian_version#*:}
upstream=${upstream%-*}
if [ "$upstream" != "$python_version" ]; then
  echo "tools/deb.sh: debian/changelog's version $debian_version is not pled/__init__.py's __version__" \
       "$python_version: add a changelog entry for it (dch -v $python_version), or set __version__" >&2
  exit 78
fi
if [ -n "$version" ]; then
  if ! why=$(dpkg --validate-version -- "$version" 2>&1); then
    echo "tools/deb.sh: VERSION=$version is not a Debian version (${why#dpkg: error: })" >&2
    exit 64
  fi
  if [ "$version" != "${version%-*}" ]; then  # debian/source/format: 3.0 (native)
    echo "tools/deb.sh: VERSION=$version has a Debian revision (-...), which a native package (debian/source/format) does" \
         "not have (dpkg-source refuses one): use e.g. VERSION=$debian_version+local1" >&2
    exit 64
  fi
  if ! dpkg --compare-versions "$version" gt "$debian_version"; then
    echo "tools/deb.sh: VERSION=$version does not sort above debian/changelog's $debian_version, so apt would not" \
         "install it as an upgrade: use e.g. VERSION=$debian_version+local1" >&2
    exit 64
  fi
fi
changelog() {
  if [ -n "$version" ]; then
    printf 'pled (%s) bookworm; urgency=medium\n\n  * Rebuilt as %s.\n\n -- %s  %s\n\n' "$version" "$version" \
      "$(sed -n 's/^ -- \(.*>\)  .*/\1/p' debian/changelog | head -1)" "$(date -R)"
  fi
  cat debian/changelog
}
if [ -n "$changelog_only" ]; then changelog; exit 0; fi
# The "W: pled: ..." lines on stdin that no glob in debian/lintian-warnings (its lines not comments) matches.
unexplained_warnings() {
  local line text pattern known
  while IFS= read -r line; do
    text=${line#W: pled: }
    known=
    while IFS= read -r pattern; do
      case $pattern in ''|'#'*) continue;; esac
      pattern=${pattern//[/\\[}; pattern=${pattern//]/\\]}  # lintian's brackets are literal; * and ? are globs
      # shellcheck disable=SC2053  # the pattern is a glob on purpose
      if [[ $text == $pattern ]]; then known=1; break; fi
    done < debian/lintian-warnings
    [ -n "$known" ] || printf '%s\n' "$line"
  done
}

work=$(mktemp -d "${TMPDIR:-/tmp}/pled-deb.XXXXXX")
trap 'rm -rf "$work"' EXIT INT TERM
mkdir -p "$work/pled" "$out"
git ls-files -z --cached --others --exclude-standard --deduplicate \
  | tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -C "$work/pled" -xf -
changelog > "$work/pled/debian/changelog"
(cd "$work/pled" && env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME="$work" LANG=C.UTF-8 \
   ${http_proxy:+http_proxy=$http_proxy} ${https_proxy:+https_proxy=$https_proxy} \
   dpkg-buildpackage -us -uc -b --no-sign) > "$work/build.log" 2>&1 || { tail -60 "$work/build.log"; exit 1; }
for f in "$work"/pled_*; do mv "$f" "$out/"; done
built=$(cd "$work/pled" && dpkg-parsechangelog -S Version)
deb=$(ls "$out"/pled_"${built#*:}"_*.deb)  # an epoch is not in the file's name
# lintian: no error may remain; debian/pled.lintian-overrides gives the reason for each tag it overrides. Quiet
# unless V=1 (then the build's log and lintian's every line): one line of counts, or lintian's output on an error.
if [ -n "${V:-}" ] && [ "${V:-}" != 0 ]; then
  cat "$work/build.log"
  lintian --fail-on error --no-tag-display-limit "$deb"
else
  lintian --fail-on error --no-tag-display-limit "$deb" > "$work/lintian.log" 2>&1 || { cat "$work/lintian.log"; exit 1; }
  warnings=$(grep -c '^W:' "$work/lintian.log" || true)
  unexplained=$(grep '^W:' "$work/lintian.log" | unexplained_warnings || true)
  others=$(printf '%s' "$unexplained" | grep -c . || true)
  echo "built $(basename "$deb"); lintian: no error, $warnings warning(s) ($((warnings - others)) explained in \
debian/lintian-warnings or overridden), $(grep -c '^I:' "$work/lintian.log" || true) info(s) (V=1 shows them and the \
build's log)"
  if [ -n "$unexplained" ]; then
    echo "lintian warnings not explained in debian/lintian-warnings (fix each, or explain it there):"
    printf '%s\n' "$unexplained"
  fi
fi
echo "$deb"
