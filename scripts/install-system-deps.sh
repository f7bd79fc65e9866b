#!/usr/bin/env bash
# Install the Debian 12 system packages crossfed's test suite needs: a real single-host
# Slurm 22.05 cluster (slurmctld, slurmd, slurmdbd, client tools), munge, MariaDB for
# accounting, squid (the real forward proxy of the proxy tests and bench/wan.py), and Chromium
# for the browser test.
#
# Idempotent and non-interactive; packages already installed are skipped. Runs as root
# (or through sudo when available). Services are not started by the install (a temporary
# policy-rc.d denies it); the test fixture (tests/helpers/slurm_cluster.py) starts its own daemons
# under a temporary directory.
#
# Usage: scripts/install-system-deps.sh [--no-chromium] [--dry-run]
#   --no-chromium   skip Chromium (large; only the browser test needs it)
#   --dry-run       print which packages would be installed and exit
set -euo pipefail

SERVICE_PACKAGES=(slurmctld slurmd slurm-client slurmdbd mariadb-server munge squid)
CHROMIUM_PACKAGES=(chromium)

with_chromium=1
dry_run=0
for arg in "$@"; do
  case "$arg" in
    --no-chromium) with_chromium=0 ;;
    --dry-run) dry_run=1 ;;
    -h | --help)
      sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"
      exit 0
      ;;
    *)
      echo "install-system-deps: unknown argument: $arg (try --help)" >&2
      exit 2
      ;;
  esac
done

if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-query >/dev/null 2>&1; then
  echo "install-system-deps: needs a Debian/Ubuntu system with apt-get and dpkg" >&2
  exit 1
fi

if ! grep -qs '^VERSION_CODENAME=bookworm' /etc/os-release; then
  echo "install-system-deps: warning: written for Debian 12 (bookworm); this is" \
    "$(. /etc/os-release 2>/dev/null && echo "${PRETTY_NAME:-unknown}")" >&2
fi

wanted=("${SERVICE_PACKAGES[@]}")
if [[ $with_chromium -eq 1 ]]; then
  wanted+=("${CHROMIUM_PACKAGES[@]}")
fi

missing=()
for pkg in "${wanted[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)
  if [[ "$status" != "installed" ]]; then
    missing+=("$pkg")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-system-deps: all packages present: ${wanted[*]}"
  exit 0
fi
echo "install-system-deps: installing: ${missing[*]}"
if [[ $dry_run -eq 1 ]]; then
  exit 0
fi

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo --preserve-env=DEBIAN_FRONTEND)
  else
    echo "install-system-deps: must run as root (no sudo found)" >&2
    exit 1
  fi
fi

export DEBIAN_FRONTEND=noninteractive
# Package postinst scripts try to start services; in containers without an init system
# that fails or hangs. A policy-rc.d that denies starts keeps the install quiet; it is
# removed again afterwards unless one was already there.
policy=/usr/sbin/policy-rc.d
added_policy=0
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee "$policy" >/dev/null
  "${SUDO[@]}" chmod 755 "$policy"
  added_policy=1
fi
cleanup() {
  if [[ $added_policy -eq 1 ]]; then
    "${SUDO[@]}" rm -f "$policy"
  fi
}
trap cleanup EXIT

"${SUDO[@]}" apt-get update -q
"${SUDO[@]}" apt-get install -y -q --no-install-recommends \
  -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
  "${missing[@]}"

for pkg in "${missing[@]}"; do
  dpkg-query -W -f='${Package} ${Version}\n' "$pkg"
done
echo "install-system-deps: done"
