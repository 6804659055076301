#!/bin/sh
# Mooncake's store.so links libibverbs.so.1 (Debian package libibverbs1). Install it
# when this is a Debian-like system and we are root; otherwise say what is missing.
# Never fails the install: everything but --hicache-storage-backend mooncake works
# without it.
PY=${1:-.venv/bin/python}
if "$PY" -c "import mooncake.store" 2>/dev/null; then exit 0; fi
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing libibverbs1 (needed by Mooncake's store.so)"
        (apt-get install -y -q libibverbs1 >/dev/null 2>&1 || \
         (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libibverbs1 >/dev/null 2>&1)) || true
    fi
fi
if "$PY" -c "import mooncake.store" 2>/dev/null; then exit 0; fi
echo "NOTE: Mooncake Store is unavailable: $("$PY" -c 'import mooncake.store' 2>&1 | tail -1)"
echo "      install the Debian package libibverbs1 (apt-get install libibverbs1) to use"
echo "      --hicache-storage-backend mooncake; everything else works without it."
exit 0
