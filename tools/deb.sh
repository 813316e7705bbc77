#!/usr/bin/env bash
# Build the Debian 12 package of pled's host side (debian/; `make deb`), then check it with lintian.
#
#     tools/deb.sh [OUT [VERSION]]
#
# OUT: where the .deb, .changes and .buildinfo go (default build/deb). VERSION: build as this Debian version instead
# of debian/changelog's, with a changelog entry saying so (the tests' upgrade). The build runs in a copy of the
# checkout's files (tracked, and untracked ones git does not ignore: dpkg-buildpackage writes beside its source
# directory) with a PATH of the system's directories only, so no other Python (a pyenv one under /root) takes part.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-build/deb}")
version=${2:-}
work=$(mktemp -d "${TMPDIR:-/tmp}/pled-deb.XXXXXX")
trap 'rm -rf "$work"' EXIT INT TERM
mkdir -p "$work/pled" "$out"
git ls-files -z --cached --others --exclude-standard --deduplicate \
  | tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -C "$work/pled" -xf -
if [ -n "$version" ]; then
  { printf 'pled (%s) bookworm; urgency=medium\n\n  * Rebuilt as %s.\n\n -- %s  %s\n\n' "$version" "$version" \
      "$(sed -n 's/^ -- \(.*>\)  .*/\1/p' debian/changelog | head -1)" "$(date -R)"; cat debian/changelog; } \
    > "$work/pled/debian/changelog"
fi
(cd "$work/pled" && env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME="$work" LANG=C.UTF-8 \
   ${http_proxy:+http_proxy=$http_proxy} ${https_proxy:+https_proxy=$https_proxy} \
   dpkg-buildpackage -us -uc -b --no-sign) > "$work/build.log" 2>&1 || { tail -60 "$work/build.log"; exit 1; }
for f in "$work"/pled_*; do mv "$f" "$out/"; done
deb=$(ls "$out"/pled_"$(cd "$work/pled" && dpkg-parsechangelog -S Version)"_*.deb)
# lintian: no error may remain; debian/pled.lintian-overrides gives the reason for each tag it overrides. Quiet
# unless V=1 (then the build's log and lintian's every line): one line of counts, or lintian's output on an error.
if [ -n "${V:-}" ] && [ "${V:-}" != 0 ]; then
  cat "$work/build.log"
  lintian --fail-on error --no-tag-display-limit "$deb"
else
  lintian --fail-on error --no-tag-display-limit "$deb" > "$work/lintian.log" 2>&1 || { cat "$work/lintian.log"; exit 1; }
  echo "built $(basename "$deb"); lintian: no error, $(grep -c '^W:' "$work/lintian.log" || true) warning(s), \
$(grep -c '^I:' "$work/lintian.log" || true) info(s) (V=1 shows them and the build's log)"
fi
echo "$deb"
