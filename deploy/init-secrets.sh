#!/bin/sh
# compose.yaml's one-shot `init-secrets` service: makes the stack's secrets on the first
# `docker compose up` and keeps them afterwards (each lives in its own named volume):
#
#   $INTERNAL_DIR/secret   the internal secret every router, prefill and decode process proves on internal
#                          calls and KV connections (SPLITSERVE_INTERNAL_SECRET_FILE); uid 10001, mode 0400
#   $REDIS_DIR/password    Redis' password (redis-server --requirepass; the splitserve containers read it
#                          through REDIS_PASSWORD_FILE); owner 999 (redis), group 10001, mode 0440
#   $METRICS_DIR/key       an API key with the metrics scope only, Prometheus' bearer token for the
#                          router's /metrics; owner 65534 (the prometheus image's nobody), mode 0400
#   $METRICS_DIR/api-keys  the same key as a line of the router's static keys file
#                          (SPLITSERVE_ROUTER_API_KEYS_FILE: "<secret> name=prometheus scopes=metrics");
#                          uid 10001, mode 0400
#
# An existing, non-empty file is left as it is. New values are 48 random letters and digits (URL-safe:
# the password goes into redis:// URLs). Rotate: `docker compose down`, remove the volume(s)
# (`docker volume rm splitserve_internal-secret splitserve_redis-secret splitserve_metrics-key`),
# `docker compose up -d` (docs/security.md).
set -eu

INTERNAL_DIR=${INTERNAL_DIR:-/run/secrets/internal}
REDIS_DIR=${REDIS_DIR:-/run/secrets/redis}
METRICS_DIR=${METRICS_DIR:-/run/secrets/metrics}

# random: 48 random letters and digits
random() {
    tr -dc 'A-Za-z0-9' </dev/urandom | head -c 48
}

# put FILE OWNER MODE VALUE: VALUE into FILE, given its mode and (as root) its owner before it takes
# FILE's name. Existing files are never read nor changed in place: as root without CAP_DAC_OVERRIDE or
# CAP_FOWNER this container could not.
put() {
    [ "${#4}" -ge 48 ] || { echo "init-secrets: no randomness for $1" >&2; exit 1; }
    umask 077
    printf '%s' "$4" >"$1.new"
    chmod "$3" "$1.new"
    if [ "$(id -u)" = 0 ]; then
        chown "$2" "$1.new"
    fi
    mv -f "$1.new" "$1"
    echo "init-secrets: created $1"
}

kept() {
    echo "init-secrets: kept $*"
}

if [ -s "$INTERNAL_DIR/secret" ]; then kept "$INTERNAL_DIR/secret"; else
    put "$INTERNAL_DIR/secret" 10001:10001 0400 "$(random)"
fi
if [ -s "$REDIS_DIR/password" ]; then kept "$REDIS_DIR/password"; else
    put "$REDIS_DIR/password" 999:10001 0440 "$(random)"
fi
if [ -s "$METRICS_DIR/key" ] && [ -s "$METRICS_DIR/api-keys" ]; then kept "$METRICS_DIR/key" "$METRICS_DIR/api-keys"; else
    key=$(random)
    put "$METRICS_DIR/key" 65534:65534 0400 "$key"
    put "$METRICS_DIR/api-keys" 10001:10001 0400 "$key name=prometheus scopes=metrics"
fi
