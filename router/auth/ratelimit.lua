-- Per-key rate limits, checked and charged atomically (router/auth/ratelimit.py explains the design).
--
-- KEYS[1]  the key's buckets, a hash: r = requests left, rt = its time (ms); t = tokens left, tt = its time
-- KEYS[2]  the key's in-flight requests, a sorted set: request id -> the time (ms) its hold expires
--
-- acquire: ARGV = 'acquire', rpm, tpm, max_concurrent (0 = no such limit), tokens, hold_ms, request_id
--   returns {allowed (0|1), reason ('' | 'requests' | 'tokens' | 'concurrency'), retry_ms (-1: never),
--            requests_left, requests_reset_ms, tokens_left, tokens_reset_ms}   (numbers as strings)
-- release: ARGV = 'release', tpm, refund, request_id
--   returns 1 if the request was in flight (and its tokens were refunded), else 0
-- refuse:  ARGV = 'refuse', rpm (0: not charged), refusals per minute
--   a request refused after its parse: one request off the requests bucket (never below 0: the work was
--   done) and one off the refusals bucket (f, ft); returns {refusals_left, ms until one is back (0: left)}
--
-- Time is the server's (TIME), so every router sharing this Redis shares one clock and one budget.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local IDLE_MS = 61000 -- an untouched bucket refills completely within 60 s: it may then disappear
local EPS = 1e-9

local function fmt(x)
  return string.format('%.17g', x)
end

-- the bucket's level now: capacity cap, refilled at cap per minute; a missing bucket is full
local function level(field, cap)
  local lvl = tonumber(redis.call('HGET', KEYS[1], field))
  local ts = tonumber(redis.call('HGET', KEYS[1], field .. 't'))
  if not lvl or not ts then return cap end
  return math.min(cap, lvl + math.max(0, now - ts) * cap / 60000)
end

local function reset_ms(lvl, cap)
  return (cap - lvl) * 60000 / cap
end

if ARGV[1] == 'release' then
  local tpm, refund = tonumber(ARGV[2]), tonumber(ARGV[3])
  local was = redis.call('ZREM', KEYS[2], ARGV[4])
  if was == 1 and tpm > 0 and refund > 0 then
    local lvl = math.min(tpm, level('t', tpm) + refund)
    redis.call('HSET', KEYS[1], 't', fmt(lvl), 'tt', fmt(now))
    redis.call('PEXPIRE', KEYS[1], IDLE_MS)
  end
  return was
end

if ARGV[1] == 'refuse' then
  local rpm, cap = tonumber(ARGV[2]), tonumber(ARGV[3])
  if rpm > 0 then
    redis.call('HSET', KEYS[1], 'r', fmt(math.max(0, level('r', rpm) - 1)), 'rt', fmt(now))
  end
  local f = math.max(0, level('f', cap) - 1)
  redis.call('HSET', KEYS[1], 'f', fmt(f), 'ft', fmt(now))
  redis.call('PEXPIRE', KEYS[1], IDLE_MS)
  local wait = 0
  if f + EPS < 1 then wait = (1 - f) * 60000 / cap end
  return {fmt(f), fmt(wait)}
end

local rpm, tpm, maxc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local need, hold_ms, rid = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]

local reason, wait = '', 0
local function refuse(why, ms)
  if wait >= 0 and (ms < 0 or ms > wait) then reason, wait = why, ms end
end

local r, tk = -1, -1
if rpm > 0 then
  r = level('r', rpm)
  if r + EPS < 1 then refuse('requests', (1 - r) * 60000 / rpm) end
end
if tpm > 0 then
  tk = level('t', tpm)
  if need > tpm then
    refuse('tokens', -1) -- more than the bucket holds: waiting cannot help
  elseif tk + EPS < need then
    refuse('tokens', (need - tk) * 60000 / tpm)
  end
end
local track = maxc > 0 or tpm > 0 -- in flight entries: concurrency, and refunds that happen only once
if track then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', fmt(now)) end
if maxc > 0 then
  local busy = redis.call('ZCARD', KEYS[2])
  if redis.call('ZSCORE', KEYS[2], rid) then busy = busy - 1 end
  if busy >= maxc then
    -- a slot frees when one of the key's requests ends, which cannot be known here: at the latest when
    -- the earliest hold expires; the hint is capped at 1 s
    local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
    local ms = 1000
    if first[2] then ms = math.max(1, math.min(ms, tonumber(first[2]) - now)) end
    refuse('concurrency', ms)
  end
end

local allowed = 0
if reason == '' then
  allowed = 1
  if rpm > 0 then
    r = math.max(0, r - 1)
    redis.call('HSET', KEYS[1], 'r', fmt(r), 'rt', fmt(now))
  end
  if tpm > 0 then
    tk = math.max(0, tk - need)
    redis.call('HSET', KEYS[1], 't', fmt(tk), 'tt', fmt(now))
  end
  if rpm > 0 or tpm > 0 then redis.call('PEXPIRE', KEYS[1], IDLE_MS) end
  if track then
    redis.call('ZADD', KEYS[2], fmt(now + hold_ms), rid)
    if redis.call('PTTL', KEYS[2]) < hold_ms + 1000 then redis.call('PEXPIRE', KEYS[2], hold_ms + 1000) end
  end
end

local r_reset, t_reset = 0, 0
if rpm > 0 then r_reset = reset_ms(r, rpm) end
if tpm > 0 then t_reset = reset_ms(tk, tpm) end
return {allowed, reason, fmt(wait), fmt(r), fmt(r_reset), fmt(tk), fmt(t_reset)}
