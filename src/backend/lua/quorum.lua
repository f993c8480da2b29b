-- One node's part of a semaphore kept by a quorum of independent masters (QuorumBackend).
-- The limit's L permits are L slots; each slot is a lease-based mutex on every node, and a
-- holder owns a slot only when it took that same slot on a majority of nodes. Times come from
-- this node's clock.
--
-- KEYS[1] owned:   zset, slot -> lease deadline (ms)
-- KEYS[2] owner:   hash, slot -> member
-- KEYS[3] counter: hash, slot -> last fencing value given out for the slot on this node
-- KEYS[4] born:    string, when this node's data began (ms); see `take`
-- KEYS[5] limit:   string, the limit set by an operator (`set_limit`), else the caller's
-- KEYS[6] opened:  string, this node's `born` if it took part in a cold start of this
--                  semaphore (see `take_cold`); expires when the data is a lease old
--
-- ARGV: operation, channel, limit, then:
--   free                          -> {earliest deadline in ms from now or 0, free slot...}
--   take <member> <lease ms> <slot>...
--        -> {1, counter...} (took every slot) | {0} (one was taken) | {2, ms} (abstaining)
--   take_cold <member> <lease ms> <slot>...   -> as `take`, never abstaining (a cold start)
--   seal <member> <value> <slot>...   -> how many of the member's slots now count >= value
--   renew <member> <lease ms> <slot>... -> how many of the member's slots were extended
--   release <member> <slot>...        -> how many were released (announced on the channel)
--   used                          -> how many slots are held
--   set_limit <n>                 -> 1
--   unset_limit                   -> 1 (the callers' own limit is back)
--   evict <id>                    -> how many slots the holder with that id lost
--   snapshot                      -> {limit, pinned (0|1), then per held slot: slot, member,
--                                     ms left}
--
-- `born` is set the first time this node serves any semaphore and never expires. A node
-- whose data is younger than a lease abstains from `take`: it cannot tell a first start from
-- a restart that forgot the slots it had granted, and those grants end within a lease. The
-- client can tell: when a majority of all the nodes abstain from one take, it is a cold start
-- (or a failure beyond what a quorum survives), and the client sends them `take_cold`. A node
-- that took part in a cold start records it (`opened`) and no longer abstains: it remembers
-- every grant since, so a node restarted later is alone in abstaining (QuorumBackend docs).
local owned, owner, counter, born_key, limit_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local opened = KEYS[6]
local op, channel = ARGV[1], ARGV[2]
-- (A pinned limit of another form than this crate writes is not read: no stored value may
-- lift the loops below.)
local pinned = redis.call('GET', limit_key)
local limit = pinned and string.find(pinned, '^%d+$') and #pinned <= 10 and tonumber(pinned)
  or tonumber(ARGV[3])

local time = redis.call('TIME')
local now_us = tonumber(time[1]) * 1000000 + tonumber(time[2])
local now = math.floor(now_us / 1000)

local function int(n)
  return string.format('%.0f', n)
end

-- Expired slots are free again.
-- Expired slots out, at most 256 a call (a later call takes the rest; until then they count as
-- held, never as free).
for _, slot in ipairs(redis.call('ZRANGEBYSCORE', owned, '-inf', now, 'LIMIT', 0, 256)) do
  redis.call('ZREM', owned, slot)
  redis.call('HDEL', owner, slot)
end

-- The member's slots among `from`.. of ARGV, as a list.
local function mine(member, from)
  local slots = {}
  for i = from, #ARGV do
    if redis.call('HGET', owner, ARGV[i]) == member then
      table.insert(slots, ARGV[i])
    end
  end
  return slots
end

-- Keys outlive the latest lease; the counters a day more, so tokens keep increasing.
local function cover(deadline)
  redis.call('PEXPIREAT', owned, deadline)
  redis.call('PEXPIREAT', owner, deadline)
  redis.call('PEXPIREAT', counter, deadline + 86400000)
end

if op == 'free' then
  local reply = {0}
  local first = redis.call('ZRANGE', owned, 0, 0, 'WITHSCORES')[2]
  if first then
    reply[1] = math.max(tonumber(first) - now, 1)
  end
  -- The lowest free slots, at most 1 024 of them: a bounded answer whatever the limit or what
  -- `owned` holds (a weight is far below it; every node answers its lowest, so a majority's
  -- agree).
  local held = {}
  for _, slot in ipairs(redis.call('ZRANGE', owned, 0, 4095)) do
    held[slot] = true
  end
  local slot = 0
  -- (At most 4 096 held slots and 1 025 free ones are passed: a bounded loop.)
  while slot < limit and #reply <= 1024 do
    if not held[tostring(slot)] then
      table.insert(reply, slot)
    end
    slot = slot + 1
  end
  return reply
elseif op == 'take' or op == 'take_cold' then
  local member, lease = ARGV[4], tonumber(ARGV[5])
  local born = tonumber(redis.call('GET', born_key))
  if not born then
    born = now
    redis.call('SET', born_key, int(now))
  end
  -- `opened` holds the `born` it was set under: an older one (`born` evicted) does not count.
  if now - born < lease and redis.call('GET', opened) ~= int(born) then
    if op ~= 'take_cold' then
      return {2, born + lease - now}
    end
    redis.call('SET', opened, int(born))
    redis.call('PEXPIREAT', opened, int(born + lease))
  end
  for i = 6, #ARGV do
    if redis.call('ZSCORE', owned, ARGV[i]) then
      return {0}
    end
  end
  local reply = {1}
  for i = 6, #ARGV do
    local slot = ARGV[i]
    redis.call('ZADD', owned, now + lease, slot)
    redis.call('HSET', owner, slot, member)
    local value = math.max((tonumber(redis.call('HGET', counter, slot)) or 0) + 1, now_us)
    redis.call('HSET', counter, slot, int(value))
    table.insert(reply, value)
  end
  cover(now + lease)
  return reply
elseif op == 'seal' then
  local member, value = ARGV[4], tonumber(ARGV[5])
  local slots = mine(member, 6)
  for _, slot in ipairs(slots) do
    local current = tonumber(redis.call('HGET', counter, slot)) or 0
    if value > current then
      redis.call('HSET', counter, slot, int(value))
    end
  end
  return #slots
elseif op == 'renew' then
  local member, lease = ARGV[4], tonumber(ARGV[5])
  local slots = mine(member, 6)
  for _, slot in ipairs(slots) do
    redis.call('ZADD', owned, 'XX', now + lease, slot)
  end
  if #slots > 0 then
    cover(now + lease)
  end
  return #slots
elseif op == 'release' then
  local slots = mine(ARGV[4], 5)
  for _, slot in ipairs(slots) do
    redis.call('ZREM', owned, slot)
    redis.call('HDEL', owner, slot)
  end
  if #slots > 0 then
    redis.call('PUBLISH', channel, 'released')
  end
  return #slots
elseif op == 'used' then
  return redis.call('ZCARD', owned)
elseif op == 'set_limit' then
  redis.call('SET', limit_key, ARGV[4])
  return 1
elseif op == 'unset_limit' then
  redis.call('DEL', limit_key)
  return 1
elseif op == 'evict' then
  local evicted = 0
  for _, slot in ipairs(redis.call('ZRANGE', owned, 0, 4095)) do
    local member = redis.call('HGET', owner, slot)
    if member and string.sub(member, 1, #ARGV[4] + 1) == ARGV[4] .. ':' then
      redis.call('ZREM', owned, slot)
      redis.call('HDEL', owner, slot)
      evicted = evicted + 1
    end
  end
  if evicted > 0 then
    redis.call('PUBLISH', channel, 'released')
  end
  return evicted
elseif op == 'snapshot' then
  local reply = {limit, redis.call('EXISTS', limit_key)}
  local entries = redis.call('ZRANGE', owned, 0, 999, 'WITHSCORES')
  for i = 1, #entries, 2 do
    table.insert(reply, tonumber(entries[i]))
    table.insert(reply, redis.call('HGET', owner, entries[i]) or '')
    table.insert(reply, tonumber(entries[i + 1]) - now)
  end
  return reply
end
return redis.error_reply('unknown quorum operation ' .. tostring(op))
