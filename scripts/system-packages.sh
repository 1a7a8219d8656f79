#!/usr/bin/env bash
# Debian packages kvops needs outside the virtualenv: redis-server (tests start private
# ones; `make run` starts one when none answers), chromium (browser tests), g++ (the
# CPU kernels in kernels/csrc are compiled on the machine that runs them), node (the
# pages' JavaScript unit tests) and PostgreSQL's server (make test runs part of the suite
# on it: a private cluster when none answers, tests/session_postgres.py).
# Installs only what is missing; does nothing when all are present.
set -euo pipefail
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v chromium >/dev/null || missing+=(chromium)
command -v g++ >/dev/null || missing+=(g++)
command -v node >/dev/null || missing+=(nodejs)
command -v initdb >/dev/null || compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null \
    || missing+=(postgresql)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "kvops needs these system packages: ${missing[*]} (install them, then re-run make setup)" >&2
    exit 1
fi
echo "installing system packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
