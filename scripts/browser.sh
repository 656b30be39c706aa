#!/usr/bin/env bash
# The dashboard's browser tests (tests/engine/test_dashboard_browser.py) drive Debian's chromium
# through Playwright; Playwright's own browser download is not reachable from these
# machines. Installs the package when /usr/bin/chromium is missing. Idempotent.
set -euo pipefail
[ -x /usr/bin/chromium ] && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "browser: installing Debian's chromium for the browser tests" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
