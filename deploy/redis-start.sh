#!/bin/sh
# compose.yaml's Redis: one ACL user per component, then redis-server with the arguments given.
#
#   default every command and key, with the admin password: operators (redis-cli with REDISCLI_AUTH), the
#           health check, and Redis' own AOF loading (Redis 7.0 replays MULTI/EXEC from the append-only
#           file as the default user: with `default` off or limited it drops every transaction on a restart)
#   router  the router (and `splitserve keys` in its container): API keys, rate limits, router
#           ownership, request records, the worker index sets (it drops dead ids); worker entries, KV
#           events and the transfer ledger read-only
#   worker  prefill and decode: their registry entries and index sets, KV events, the transfer ledger,
#           request records; no API key, no rate limit, nothing of the routers' or the planner's
#   planner the planner: its forecast's arrivals log (planner:*), the worker index sets (it drops dead
#           ids, as the router does); worker entries and the routers' liveness and URLs read-only; no
#           API key, no rate limit, no request record, no KV event, no lease
#
# No service user gets the dangerous commands (CONFIG, KEYS, FLUSHALL, DEBUG, MONITOR, ...) or any
# pub/sub channel; a connection without a user and password can do nothing (default needs its password). Each
# password comes from its own file, written by init-secrets into its own volume: the router's container
# mounts only the router's, prefill and decode only the workers'. The ACL file goes to /tmp (a tmpfs,
# mode 0600), never onto the command line. Needs Redis 7 (read-only key patterns: %R~).
#
# Environment: REDIS_SECRETS (/run/secrets: default's in redis/, router's in redis-router/, worker's in
# redis-worker/, planner's in redis-planner/, each a `password` file), SPLITSERVE_REDIS_PREFIX (splitserve:, the services' and
# router's redis_prefix), REDIS_ACL_FILE (/tmp/users.acl).
set -eu

secrets=${REDIS_SECRETS:-/run/secrets}
p=${SPLITSERVE_REDIS_PREFIX:-splitserve:}
acl=${REDIS_ACL_FILE:-/tmp/users.acl}

password() { # password FILE: its content, refused when empty or not one token
    pw=$(cat "$1") || exit 1
    case "$pw" in "" | *[!A-Za-z0-9]*) echo "redis-start: $1 is empty or not letters and digits" >&2; exit 1 ;; esac
    printf '%s' "$pw"
}
admin=$(password "$secrets/redis/password")
router=$(password "$secrets/redis-router/password")
worker=$(password "$secrets/redis-worker/password")
planner=$(password "$secrets/redis-planner/password")

umask 077
cat >"$acl" <<EOF
user default on >$admin ~* &* +@all
user router on >$router resetchannels +@all -@dangerous ~${p}apikey* ~${p}ratelimit:* ~${p}router:* ~${p}owned:* ~${p}routers ~${p}req:* ~${p}workers:* %R~${p}worker:* %R~${p}kvev:* %R~${p}kvsnap:* %R~${p}lease:*
user worker on >$worker resetchannels +@all -@dangerous ~${p}worker:* ~${p}workers:* ~${p}kvev:* ~${p}kvsnap:* ~${p}lease:* ~${p}req:*
user planner on >$planner resetchannels +@all -@dangerous ~${p}planner:* ~${p}workers:* %R~${p}worker:* %R~${p}router:* %R~${p}routers
EOF
exec redis-server --aclfile "$acl" "$@"
