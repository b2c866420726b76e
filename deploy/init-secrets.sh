#!/bin/sh
# compose.yaml's one-shot `init-secrets` service: makes the stack's secrets on the first
# `docker compose up` and keeps them afterwards (each lives in its own named volume):
#
#   $INTERNAL_DIR/secret   the internal secret every router, prefill and decode process proves on internal
#                          calls and KV connections (SPLITSERVE_INTERNAL_SECRET_FILE); mode 0400
#   $REDIS_DIR/password    Redis' admin password (deploy/redis-start.sh: the `default` user, for operators
#                          and the health check); mode 0440: Redis reads it through the group
#   $REDIS_ROUTER_DIR/password  the Redis user `router`'s password (the router reads it through
#                          REDIS_PASSWORD_FILE); mode 0440
#   $REDIS_WORKER_DIR/password  the Redis user `worker`'s (prefill and decode); mode 0440
#   $METRICS_DIR/key       an API key with the metrics scope only, Prometheus' bearer token for the
#                          router's /metrics; mode 0440: Prometheus reads it through the group
#   $METRICS_DIR/api-keys  the same key as a line of the router's static keys file
#                          (SPLITSERVE_ROUTER_API_KEYS_FILE: "<secret> name=prometheus scopes=metrics");
#                          mode 0400
#
# compose runs it as uid/gid 10001 (the splitserve images' user), so every file belongs to 10001:10001;
# Redis (uid 999) and Prometheus (65534) get the group 10001 (compose.yaml's group_add). Run as root
# (an older compose.yaml, or by hand) it hands the files to 10001:10001 the same way.
# An existing, non-empty file is left as it is. New values are 48 random letters and digits (URL-safe:
# the password goes into redis:// URLs). Rotate: `docker compose down`, remove the volume(s)
# (`docker volume rm splitserve_internal-secret splitserve_redis-secret splitserve_redis-router-secret
# splitserve_redis-worker-secret splitserve_redis-planner-secret splitserve_metrics-key`),
# `docker compose up -d` (docs/security.md).
set -eu

INTERNAL_DIR=${INTERNAL_DIR:-/run/secrets/internal}
REDIS_DIR=${REDIS_DIR:-/run/secrets/redis}
REDIS_ROUTER_DIR=${REDIS_ROUTER_DIR:-/run/secrets/redis-router}
REDIS_WORKER_DIR=${REDIS_WORKER_DIR:-/run/secrets/redis-worker}
REDIS_PLANNER_DIR=${REDIS_PLANNER_DIR:-/run/secrets/redis-planner}
METRICS_DIR=${METRICS_DIR:-/run/secrets/metrics}

# random: 48 random letters and digits
random() {
    tr -dc 'A-Za-z0-9' </dev/urandom | head -c 48
}

# put FILE OWNER MODE VALUE: VALUE into FILE, given its mode and (as root) its owner before it takes
# FILE's name. Existing files are never read nor changed in place (with mode 0400 and no capabilities
# this container could not).
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
for dir in "$REDIS_DIR" "$REDIS_ROUTER_DIR" "$REDIS_WORKER_DIR" "$REDIS_PLANNER_DIR"; do
    if [ -s "$dir/password" ]; then kept "$dir/password"; else
        put "$dir/password" 10001:10001 0440 "$(random)"
    fi
done
if [ -s "$METRICS_DIR/key" ] && [ -s "$METRICS_DIR/api-keys" ]; then kept "$METRICS_DIR/key" "$METRICS_DIR/api-keys"; else
    key=$(random)
    put "$METRICS_DIR/key" 10001:10001 0440 "$key"
    put "$METRICS_DIR/api-keys" 10001:10001 0400 "$key name=prometheus scopes=metrics"
fi
