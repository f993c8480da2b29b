-- One distributed, first-come-first-served semaphore. Every operation is one call of this
-- script, so it runs atomically; times come from the Redis server clock, never a client's.
--
-- KEYS[1] holders: zset, member -> lease deadline (ms)
-- KEYS[2] meta:    hash, `used` = weight of the live holders, `fence` = last fencing token,
--                  `horizon` = when holders and meta expire (ms)
-- KEYS[3] queue:   zset, member -> arrival (µs): who waits, oldest first
-- KEYS[4] alive:   zset, member -> deadline (ms) by which a waiter must show it still waits
-- A member is "<holder id>:<weight>:<lease ms>". All keys share the `{name}` hash tag (one
-- Cluster slot). Holders and meta expire at most half a lease after the latest lease (and are
-- deleted when the last holder leaves); queue and alive expire with the latest waiter deadline.
--
-- ARGV: operation, channel, limit, k, then k members to release (holders or waiters; absent
-- ones are ignored), then the operation's arguments:
--   acquire <member> <patience ms> <queue: 1|0> <first: 1|0>
--       -> {1, token, lease ms} granted | {2, retry ms} queued | {0, retry ms} full, not queued
--   release                          -> how many of the k members held or waited
--   touch <patience ms> <member>...  -> {retry ms, then per member: 1, token, lease ms (granted)
--                                        | 2, 0, 0 (still queued) | 0, 0, 0 (unknown)}
--   renew <member>...                -> per member: its new lease ms, or 0 if it no longer holds
--                                       (expired or removed: it is never added back)
--   used                             -> live weight
-- Whenever queued waiters fit they are admitted in arrival order, and each grant is published
-- on the channel as "<member> <token> <lease ms>". "retry ms" is the time until the earliest
-- lease ends: when an expiry may admit someone.
local holders, meta, queue, alive = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local op, channel, limit = ARGV[1], ARGV[2], tonumber(ARGV[3])
local released = tonumber(ARGV[4])
local args = 5 + released

local time = redis.call('TIME')
local now_us = tonumber(time[1]) * 1000000 + tonumber(time[2])
local now = math.floor(now_us / 1000)

-- Lua numbers are doubles: format integers explicitly so Redis never sees "1.7e+15".
local function int(n)
  return string.format('%.0f', n)
end

local function parse(member)
  local weight, lease = string.match(member, ':(%d+):(%d+)$')
  return tonumber(weight) or 0, tonumber(lease) or 0
end

local stored = redis.call('HMGET', meta, 'used', 'fence', 'horizon')
local used, fence, horizon = tonumber(stored[1]), tonumber(stored[2]) or 0, tonumber(stored[3]) or 0
local changed = false

-- Drop holders whose lease has passed. The running sum is rebuilt from the members if `meta`
-- went missing (deleted behind our back), so it never admits more than the members allow.
local expired = redis.call('ZRANGEBYSCORE', holders, '-inf', now)
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', holders, '-inf', now)
  changed = true
end
if used == nil then
  used = 0
  for _, member in ipairs(redis.call('ZRANGE', holders, 0, -1)) do
    used = used + parse(member)
  end
  changed = true
else
  for _, member in ipairs(expired) do
    used = used - parse(member)
  end
end

-- Holders and meta outlive the latest lease by at most half a lease.
local function cover(lease)
  if now + lease > horizon then
    horizon = now + lease + math.floor(lease / 2)
    redis.call('PEXPIREAT', holders, horizon)
    redis.call('PEXPIREAT', meta, horizon)
    changed = true
  end
end

local function grant(member)
  local weight, lease = parse(member)
  redis.call('ZADD', holders, now + lease, member)
  used = used + weight
  -- Strictly increasing; the server time in µs as a floor keeps the token above every token
  -- issued before the counter expired in an idle spell.
  fence = math.max(fence + 1, now_us)
  cover(lease)
  changed = true
  return fence, lease
end

local removed = 0
for i = 5, args - 1 do
  local member = ARGV[i]
  if redis.call('ZREM', holders, member) == 1 then
    used = used - parse(member)
    changed = true
    removed = removed + 1
  elseif redis.call('ZREM', queue, member) == 1 then
    redis.call('ZREM', alive, member)
    removed = removed + 1
  end
end

-- Admit waiters in arrival order while the oldest fits; forget waiters that stopped answering.
local granted = {}
local waiting = redis.call('ZCARD', queue)
if waiting > 0 then
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', alive, '-inf', now)) do
    redis.call('ZREM', queue, member)
    redis.call('ZREM', alive, member)
  end
  while true do
    local member = redis.call('ZRANGE', queue, 0, 0)[1]
    if not member or used + parse(member) > limit then
      waiting = member and 1 or 0
      break
    end
    redis.call('ZREM', queue, member)
    redis.call('ZREM', alive, member)
    local token, lease = grant(member)
    granted[member] = {token, lease}
    redis.call('PUBLISH', channel, member .. ' ' .. int(token) .. ' ' .. lease)
  end
end

local function wait(member, patience)
  redis.call('ZADD', alive, now + patience, member)
  redis.call('PEXPIREAT', queue, now + patience)
  redis.call('PEXPIREAT', alive, now + patience)
end

-- Time until the earliest lease ends (at least 1 ms), or `fallback` when nobody holds.
local function retry_in(fallback)
  local first = redis.call('ZRANGE', holders, 0, 0, 'WITHSCORES')[2]
  if first then
    return math.max(tonumber(first) - now, 1)
  end
  return fallback
end

-- A known member's state: a holder (a grant whose announcement may have been lost gets a fresh
-- token), a waiter (its deadline pushed back), or unknown.
local function status(member, patience)
  local made = granted[member]
  if made then
    return 1, made[1], made[2]
  end
  local deadline = redis.call('ZSCORE', holders, member)
  if deadline then
    fence = math.max(fence + 1, now_us)
    changed = true
    return 1, fence, tonumber(deadline) - now
  end
  if waiting > 0 and redis.call('ZSCORE', queue, member) then
    wait(member, patience)
    return 2, 0, 0
  end
  return 0, 0, 0
end

local reply
if op == 'acquire' then
  local member, patience = ARGV[args], tonumber(ARGV[args + 1])
  local may_queue, first = ARGV[args + 2] == '1', ARGV[args + 3] == '1'
  local state, token, lease = 0, 0, 0
  if not first then
    state, token, lease = status(member, patience)
  end
  if state == 1 then
    reply = {1, token, lease}
  elseif state == 2 then
    reply = {2, retry_in(patience)}
  elseif waiting == 0 and used + parse(member) <= limit then
    token, lease = grant(member)
    reply = {1, token, lease}
  elseif may_queue then
    redis.call('ZADD', queue, now_us, member)
    waiting = 1
    wait(member, patience)
    reply = {2, retry_in(patience)}
  else
    reply = {0, retry_in(patience)}
  end
elseif op == 'release' then
  reply = removed
elseif op == 'touch' then
  local patience = tonumber(ARGV[args])
  reply = {retry_in(patience)}
  for i = args + 1, #ARGV do
    local state, token, lease = status(ARGV[i], patience)
    table.insert(reply, state)
    table.insert(reply, token)
    table.insert(reply, lease)
  end
elseif op == 'renew' then
  reply = {}
  for i = args, #ARGV do
    local member = ARGV[i]
    local _, lease = parse(member)
    -- XX: only a member that still holds is extended; CH: count it when its score changed.
    if lease > 0 and redis.call('ZADD', holders, 'XX', 'CH', now + lease, member) == 1 then
      cover(lease)
      table.insert(reply, lease)
    elseif redis.call('ZSCORE', holders, member) then
      table.insert(reply, lease) -- renewed twice within the same millisecond
    else
      table.insert(reply, 0)
    end
  end
elseif op == 'used' then
  reply = math.max(used, 0)
else
  return redis.error_reply('unknown semaphore operation ' .. tostring(op))
end

if changed then
  if used <= 0 and redis.call('EXISTS', holders) == 0 then
    -- The last holder left: nothing stays behind (the token floor survives the lost counter).
    redis.call('DEL', meta)
  else
    redis.call('HSET', meta, 'used', int(math.max(used, 0)), 'fence', int(fence), 'horizon', int(horizon))
    if stored[3] == false then
      redis.call('PEXPIREAT', meta, horizon)
    end
  end
end
return reply
