#!/usr/bin/env bash
# Make a local stand-in for the `python:3.11-slim` base image, for machines that cannot reach a
# container registry.
#
# The stand-in is a Debian bookworm minbase root filesystem (Python 3.11, venv, pip and
# ca-certificates) built with debootstrap and loaded with `docker import`. Its python is
# /usr/bin/python3, with `python` and `pip` links in /usr/local/bin. The machine's own CA
# certificates are copied in so that pip inside the image trusts a TLS-intercepting proxy.
#
# Usage: docker/make-base-image.sh            (as root; does nothing when the image exists)
# Environment:
#   BASE_IMAGE_TAG  tag to create (default python:3.11-slim)
#   DEBIAN_SUITE    suite to bootstrap (default bookworm: its python3 is 3.11)
#   DEBIAN_MIRROR   mirror URL (default: the Debian archive that /etc/apt/sources.list* names)
set -euo pipefail

TAG="${BASE_IMAGE_TAG:-python:3.11-slim}"
SUITE="${DEBIAN_SUITE:-bookworm}"

say() { printf 'make-base-image: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

command -v docker >/dev/null 2>&1 || die "the docker client is not installed"
docker info >/dev/null 2>&1 || die "no Docker engine answers (start one: scripts/ci-docker.sh)"

if docker image inspect "$TAG" >/dev/null 2>&1; then
    say "$TAG already exists; nothing to do"
    exit 0
fi

[ "$(id -u)" -eq 0 ] || die "debootstrap needs root; run this script as root"
command -v debootstrap >/dev/null 2>&1 || die "debootstrap is missing: apt-get install -y debootstrap"

# The Debian archive this machine's apt already uses: the first 'deb' source, in one-line or
# deb822 format, whose suite is the release itself (not -security, -updates, -backports).
find_mirror() {
    python3 - "$@" <<'PY'
import glob, re, sys

def one_line(path):
    for raw in open(path, encoding="utf-8", errors="replace"):
        line = raw.split("#", 1)[0].strip()
        if not line.startswith("deb "):
            continue
        line = re.sub(r"\[[^\]]*\]", " ", line[4:]).split()
        if len(line) >= 2:
            yield line[0], [line[1]]

def deb822(path):
    text = open(path, encoding="utf-8", errors="replace").read()
    for stanza in re.split(r"\n\s*\n", text):
        fields = {}
        for raw in stanza.splitlines():
            if raw.startswith("#") or ":" not in raw or raw[:1].isspace():
                continue
            key, _, value = raw.partition(":")
            fields[key.strip().lower()] = value.split()
        if "deb" not in fields.get("types", []) or fields.get("enabled", ["yes"])[0] == "no":
            continue
        for uri in fields.get("uris", []):
            yield uri, fields.get("suites", [])

found = []
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
    try:
        found += list(one_line(path))
    except OSError:
        pass
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    try:
        found += list(deb822(path))
    except OSError:
        pass
for uri, suites in found:
    if any("-" not in s and "/" not in s for s in suites) and "security" not in uri:
        print(uri)
        break
PY
}

MIRROR="${DEBIAN_MIRROR:-$(find_mirror)}"
[ -n "$MIRROR" ] || die "no Debian mirror found in /etc/apt/sources.list*; set DEBIAN_MIRROR"

WORK="$(mktemp -d /tmp/serving-canary-base.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
ROOTFS="$WORK/rootfs"
LOG="$WORK/debootstrap.log"

say "debootstrap $SUITE from $MIRROR (about a minute)"
start=$SECONDS
if ! debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        "$SUITE" "$ROOTFS" "$MIRROR" >"$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2
    die "debootstrap failed (log above)"
fi
say "debootstrap done in $((SECONDS - start))s"

# Trust the machine's extra CA certificates (a TLS-intercepting proxy) inside the image.
shopt -s nullglob
certs=(/usr/local/share/ca-certificates/*.crt)
shopt -u nullglob
if [ "${#certs[@]}" -gt 0 ]; then
    mkdir -p "$ROOTFS/usr/local/share/ca-certificates"
    cp "${certs[@]}" "$ROOTFS/usr/local/share/ca-certificates/"
    say "copied ${#certs[@]} CA certificate(s) into the image"
fi
chroot "$ROOTFS" update-ca-certificates >/dev/null 2>&1 || say "warning: update-ca-certificates failed"

# Slim it down, let pip install into it (as the official image allows), and mimic its layout.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* \
       "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* \
       "$ROOTFS"/usr/lib/python3*/EXTERNALLY-MANAGED
mkdir -p "$ROOTFS/usr/local/bin"
ln -sf /usr/bin/python3 "$ROOTFS/usr/local/bin/python"
ln -sf /usr/bin/python3 "$ROOTFS/usr/local/bin/python3"
ln -sf /usr/bin/pip3 "$ROOTFS/usr/local/bin/pip"
ln -sf /usr/bin/pip3 "$ROOTFS/usr/local/bin/pip3"

say "importing the root filesystem as $TAG"
start=$SECONDS
tar -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["python3"]' \
    --message "local stand-in for $TAG (debootstrap $SUITE)" \
    - "$TAG" >/dev/null
say "imported in $((SECONDS - start))s: $(docker image inspect -f '{{.Size}}' "$TAG" \
    | awk '{printf "%.0f MB", $1 / 1e6}')"
docker run --rm --network none "$TAG" python -c 'import sys, venv; print("python", sys.version.split()[0])' >&2
