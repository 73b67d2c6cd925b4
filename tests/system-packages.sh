#!/usr/bin/env bash
# The Debian packages `make test` needs besides .venv: nginx with its njs module (the gateway: tests/unit/
# test_gateway_config.py checks the rendered config with `nginx -t`, tests/integration/test_gateway.py runs it) and
# Chromium (the pages' browser tests: tests/browser.py). Installed here when this machine can (root or password-less
# sudo, apt-get); otherwise the suite does not start, and the one command to run is printed.
set -euo pipefail
PACKAGES="nginx-light libnginx-mod-http-js chromium"
have() {
    { command -v nginx >/dev/null 2>&1 || test -x /usr/sbin/nginx; } \
        && test -f /usr/lib/nginx/modules/ngx_http_js_module.so && command -v chromium >/dev/null 2>&1
}
have && exit 0
refuse() {
    echo "make test needs nginx (with its njs module) and Chromium ($1); install them once, then run make test again:" >&2
    echo "    sudo apt-get install -y $PACKAGES" >&2
    exit 1
}
command -v apt-get >/dev/null 2>&1 || refuse "no apt-get here: use your package manager's nginx, njs and chromium"
if [ "$(id -u)" = 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
else
    refuse "installing them needs root"
fi
echo "installing the Debian packages the tests use: $PACKAGES"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $PACKAGES >/dev/null
have || refuse "apt-get ran, yet nginx's njs module or chromium is still missing"
