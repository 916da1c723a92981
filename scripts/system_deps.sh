#!/usr/bin/env bash
# System packages the test suite needs, installed when missing (Debian/Ubuntu, apt-get):
#   redis-server  a real Redis for the gateway replicas' shared store (tests start their own
#                 on a loopback port; the system service is not used).
#   chromium      a real browser for the pages' tests (tests/browser: Playwright drives this
#                 executable headless; Playwright's own browser download is not used), with
#                 fonts-liberation so that the screenshots have readable text.
#   dnsmasq       a real DNS server (Debian's dnsmasq-base: the binary, no system service) for
#                 the DNS groups' tests (tests/test_membership_dns.py starts one on loopback).
# Does nothing when every one is already on PATH. Needs root (or sudo) only when it installs.
set -euo pipefail

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    need+=(chromium fonts-liberation)
fi
command -v dnsmasq >/dev/null 2>&1 || [ -x /usr/sbin/dnsmasq ] || need+=(dnsmasq-base)
if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
        echo "scripts/system_deps.sh: need root (or sudo) to install: ${need[*]}" >&2; exit 1
    fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "scripts/system_deps.sh: no apt-get here; install these yourself: ${need[*]}" >&2
    exit 1
fi
echo "== scripts/system_deps.sh: apt-get install ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# (Debian's package starts the system service where systemd runs; the tests never use it.)
