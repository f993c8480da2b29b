-- One distributed semaphore. Every operation is one call of this script, so it runs atomically.
--
-- KEYS[1] holders: sorted set, member "<holder id>:<weight>", score = lease deadline in ms of the
--                  Redis server clock (never the client's).
-- KEYS[2] meta:    hash, `used` = sum of the weights of the live holders, `fence` = last fencing token.
-- Both keys share the `{name}` hash tag (one Cluster slot) and expire with the last lease.
--
-- ARGV[1] is the operation:
--   acquire <member> <weight> <limit> <lease ms> -> {1, fencing token, lease ms} | {0, ms until the earliest deadline}
--   release <member> <channel>                   -> 1 if the holder was live, else 0; publishes its weight on <channel>
--   used                                         -> live weight
local holders, meta = KEYS[1], KEYS[2]
local op = ARGV[1]

local time = redis.call('TIME')
local now_us = tonumber(time[1]) * 1000000 + tonumber(time[2])
local now = math.floor(now_us / 1000)

local function weight_of(member)
  return tonumber(string.match(member, ':(%d+)$')) or 0
end

-- Lua numbers are doubles: format integers explicitly so Redis never sees "1.7e+15".
local function int(n)
  return string.format('%.0f', n)
end

-- Drops holders whose lease has passed and returns the live weight. The running sum is rebuilt
-- from the members if `meta` went missing (deleted behind our back), so it can never admit more
-- than the members allow.
local function purge()
  local expired = redis.call('ZRANGEBYSCORE', holders, '-inf', now)
  local stored = redis.call('HGET', meta, 'used')
  local used = tonumber(stored)
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', holders, '-inf', now)
  end
  if used == nil then
    used = 0
    for _, member in ipairs(redis.call('ZRANGE', holders, 0, -1)) do
      used = used + weight_of(member)
    end
  else
    for _, member in ipairs(expired) do
      used = used - weight_of(member)
    end
  end
  if redis.call('ZCARD', holders) == 0 then
    if stored then
      redis.call('DEL', meta)
    end
    return 0
  end
  used = math.max(used, 0)
  if stored ~= int(used) then
    redis.call('HSET', meta, 'used', int(used))
  end
  return used
end

-- Both keys live exactly as long as the latest lease.
local function expire_with_latest()
  local latest = redis.call('ZRANGE', holders, -1, -1, 'WITHSCORES')
  if latest[2] then
    redis.call('PEXPIREAT', holders, latest[2])
    redis.call('PEXPIREAT', meta, latest[2])
  end
end

if op == 'acquire' then
  local member, weight, limit, lease = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
  local used = purge()
  if used + weight > limit then
    local first = redis.call('ZRANGE', holders, 0, 0, 'WITHSCORES')
    local wait = lease
    if first[2] then
      wait = math.max(tonumber(first[2]) - now, 1)
    end
    return {0, wait}
  end
  redis.call('ZADD', holders, now + lease, member)
  -- The counter expires with the semaphore; taking the server time in µs as a floor keeps the
  -- token above every token issued before an idle spell.
  local fence = math.max((tonumber(redis.call('HGET', meta, 'fence')) or 0) + 1, now_us)
  redis.call('HSET', meta, 'used', int(used + weight), 'fence', int(fence))
  expire_with_latest()
  return {1, fence, lease}
elseif op == 'release' then
  local member, channel = ARGV[2], ARGV[3]
  local weight = weight_of(member)
  if redis.call('ZREM', holders, member) == 0 then
    return 0
  end
  if redis.call('ZCARD', holders) == 0 then
    redis.call('DEL', holders, meta)
  else
    local used = (tonumber(redis.call('HGET', meta, 'used')) or weight) - weight
    redis.call('HSET', meta, 'used', int(math.max(used, 0)))
  end
  redis.call('PUBLISH', channel, weight)
  return 1
elseif op == 'used' then
  return purge()
end
return redis.error_reply('unknown semaphore operation ' .. tostring(op))
