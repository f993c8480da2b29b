-- One distributed, first-come-first-served semaphore. Every operation is one call of this
-- script, so it runs atomically; times come from the Redis server clock, never a client's.
--
-- KEYS[1] holders: zset, member -> lease deadline (ms)
-- KEYS[2] meta:    hash, `used` = weight of the live holders, `count` = how many they are,
--                  `fence` = last fencing token, `horizon` = when holders and meta expire (ms),
--                  `limit` = the limit every process admits by, `pinned` = 1 when an operator set
--                  it (then meta never expires); otherwise the first process's configured limit,
--                  which goes with the other keys when the semaphore falls idle; `line` = when
--                  queue and alive expire (ms), `arrived` = the last arrival score given
--                  (µs), so arrivals in one call or one microsecond keep their order;
--                  `p:<member>` = 1 for a provisional grant not claimed yet (`pending`
--                  counts them), `s:<process tag>`
--                  = when a provisional grant of that process ran out unclaimed (ms): the
--                  process is silent (frozen or dead), and its other waiters are passed over
--                  until it makes a call
-- KEYS[3] queue:   zset, member -> arrival (µs, strictly increasing): who waits, oldest first
-- KEYS[4] alive:   zset, member -> deadline (ms) by which a waiter must show it still waits
-- KEYS[5] since:   hash, holder -> when it was granted (ms), for snapshots
-- KEYS[6] (acquire only, optional) a rate limiter's key, decided with the acquires
-- KEYS[#KEYS] (with a promotion fence) promoted: hash, `id` = the replication id under which
--                  this server was first seen promoted from a replica, `at` = when (ms); one
--                  key for every semaphore of the server (used through Sentinel only)
-- A member is "<holder id>:<weight>:<lease ms>", the id's first 8 hex digits naming its
-- process. All keys share one hash tag (one Cluster slot). Holders and meta expire at most half a lease after the latest lease (and are deleted
-- when nothing is held past that horizon); queue and alive expire with the latest waiter
-- deadline.
--
-- ARGV: operation, channel (the base of each process's own), its publish command (PUBLISH, or SPUBLISH on a cluster), limit,
-- patience ms, claim ms, promotion fence ms (0: none), the caller's process tag, k, then k
-- members to release
-- (holders or waiters; absent ones are ignored), then the operation's arguments:
--   acquire <rate> <period µs> <burst> (<member> <once|join|recheck> <cost>)...
--       -> per member, in order: {1, token, left µs, now µs, limit} granted
--          | {2, retry ms, now µs, limit} queued | {0, retry ms, now µs, limit} full
--          | {4, retry µs, limit} refused by the rate limit (nothing added, nothing spent)
--          (`limit`: the limit in force); a member also released by this call is not added.
--          With KEYS[6] (a rate limiter's key, `gcra` of lua/gcra.lua) and rate > 0, a member
--          that would be granted at once is granted only if the rate allows its cost, spent
--          in the same call; one that queues spends nothing
--   release                      -> how many of the k members held or waited
--   touch <member>...            -> {retry ms, then per member: 1, token, left µs (holds; claimed)
--                                    | 2, 0, 0 (still queued) | 0, 0, 0 (unknown)}
--   renew <member>...            -> {now µs, then per member: µs left of its new lease, or 0 if
--                                   it no longer holds (expired or removed: it is never added
--                                   back)}
--   used                         -> live weight
--   set_limit <n>                -> 1; every process admits by n from now on (pinned)
--   evict <id>                   -> 1 if the holder with that id was removed, else 0
--   snapshot                     -> {limit, used, waiting, now ms, then per holder: member,
--                                    deadline ms, granted ms}
-- An acquire whose weight is above the limit in force answers {3, limit}.
-- "left µs" is a deadline minus the server time of this call, exact to the µs: a client that
-- adds it to the moment it sent the call never believes a lease past the server's.
-- Whenever queued waiters fit they are admitted in arrival order, each with a provisional lease
-- of at most `claim` ms (and half its lease) that the waiter's process claims (touch or renew)
-- to get its full lease; each grant is published as "<member> <token> <deadline ms>" on
-- "<channel>:<the member's process>", which only that process subscribes to. "retry ms" is the time until the earliest lease ends: when an expiry may admit someone.
local holders, meta, queue, alive, since = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local op, channel, publisher, limit = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local patience, claim = tonumber(ARGV[5]), tonumber(ARGV[6])
local promotion_fence = tonumber(ARGV[7])
local caller = ARGV[8]
local released = tonumber(ARGV[9])
local args = 10 + released
if publisher ~= 'PUBLISH' and publisher ~= 'SPUBLISH' then
  return redis.error_reply('unknown publish command ' .. tostring(publisher))
end

local time = redis.call('TIME')
local now_us = tonumber(time[1]) * 1000000 + tonumber(time[2])
local now = math.floor(now_us / 1000)

-- Lua numbers are doubles: every integer sent to Redis is written here, as `%d` (`tostring`
-- would write 1.7e+15, and a number passed to redis.call as it is goes through %.17g, which
-- costs twice as much).
local function int(n)
  return string.format('%d', n)
end

local function parse(member)
  local weight, lease = string.match(member, ':(%d+):(%d+)$')
  return tonumber(weight) or 0, tonumber(lease) or 0
end

local function left(deadline)
  return deadline * 1000 - now_us
end

local stored = redis.call('HMGET', meta, 'used', 'count', 'fence', 'horizon', 'limit', 'pinned',
  'line', 'arrived', 'pending', 's:' .. caller)
local used, count = tonumber(stored[1]), tonumber(stored[2])
local fence, horizon = tonumber(stored[3]) or 0, tonumber(stored[4]) or 0
local line = tonumber(stored[7]) or 0
local arrived = tonumber(stored[8]) or 0
-- How many holders hold a provisional grant (a `p:` field each).
local pending = tonumber(stored[9]) or 0
local changed = false

-- A provisional grant is claimed (extended for a full lease) or gone: true if it was one.
local function settle_pending(member)
  if pending > 0 and redis.call('HDEL', meta, 'p:' .. member) == 1 then
    pending = pending - 1
    changed = true
    return true
  end
  return false
end
-- One limit for every process: the one stored with the semaphore, else this caller's, stored
-- for the others to adopt.
local pinned = stored[6] == '1'
if tonumber(stored[5]) then
  limit = tonumber(stored[5])
else
  changed = true
end
if op == 'set_limit' then
  limit = tonumber(ARGV[args])
  pinned = true
  changed = true
end

-- A replica promoted to master (a failover) may lack grants the old master made (replication
-- is asynchronous), and the old master may go on granting to processes that have not heard of
-- the failover yet, for as long as the sentinels' word a client acts on may be old (the fence,
-- sent by the client). So for a lease and the fence after this server is first seen promoted,
-- nothing new is granted here: every grant made elsewhere before has ended by then. Holders
-- it knows of renew as usual.
local promoted = nil
local promoted_key = promotion_fence > 0 and KEYS[#KEYS] or nil
if promoted_key then
  local info = redis.call('INFO', 'replication')
  local previous = string.match(info, 'master_replid2:(%x+)')
  if previous and string.find(previous, '[^0]') then
    local id = string.match(info, 'master_replid:(%x+)')
    local seen = redis.call('HMGET', promoted_key, 'id', 'at')
    if seen[1] == id then
      promoted = tonumber(seen[2])
    else
      promoted = now
      redis.call('HSET', promoted_key, 'id', id, 'at', int(now))
    end
  end
end
-- The earliest a grant held off by the fence may be made (ms), for the waiters' retry hint.
local fenced_until = nil
-- Whether a grant of `lease` ms may be made now.
local function settled(lease)
  if not promoted then
    return true
  end
  local from = promoted + lease + promotion_fence
  if now >= from then
    return true
  end
  fenced_until = math.min(fenced_until or from, from)
  return false
end

-- Drop holders whose lease has passed, if the earliest has.
local earliest = tonumber(redis.call('ZRANGE', holders, 0, 0, 'WITHSCORES')[2])
local expired = {}
if earliest and earliest <= now then
  local until_now = int(now)
  expired = redis.call('ZRANGEBYSCORE', holders, '-inf', until_now)
  redis.call('ZREMRANGEBYSCORE', holders, '-inf', until_now)
  redis.call('HDEL', since, unpack(expired))
  changed = true
end
-- The server's clock stepped back: deadlines set before the step lie more than a lease ahead
-- and would keep their slots a step too long. Each is clamped to now + its lease (one read
-- when the clock is sane); so are the waiters' liveness deadlines, to now + patience.
local function clamp(key, span_of)
  local latest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if not latest[2] or tonumber(latest[2]) <= now + span_of(latest[1]) then
    return false
  end
  local entries = redis.call('ZRANGEBYSCORE', key, '(' .. int(now), '+inf', 'WITHSCORES')
  for i = 1, #entries, 2 do
    local bound = now + span_of(entries[i])
    if tonumber(entries[i + 1]) > bound then
      redis.call('ZADD', key, 'XX', int(bound), entries[i])
    end
  end
  return true
end
if clamp(holders, function(member)
  local _, lease = parse(member)
  return lease
end) then
  changed = true
end
-- The line's expiry (`line`) lies at most 1.5 patience ahead unless the clock stepped back.
if line > now + patience + math.floor(patience / 2) then
  clamp(alive, function()
    return patience
  end)
end
-- A provisional grant that ran out unclaimed: its process is silent (frozen or dead), and
-- its other waiters are passed over until it is heard from (any call of it, below).
-- A silence lasts at most a patience (by then a dead process's waiters have left the line);
-- older marks are swept whenever a new one is made, so they stay few.
local function still_silent(marked)
  return marked ~= nil and now - marked < patience
end
local silenced = {}
for _, member in ipairs(expired) do
  if settle_pending(member) then
    table.insert(silenced, 's:' .. string.sub(member, 1, 8))
  end
end
if #silenced > 0 then
  local cursor = '0'
  repeat
    local page = redis.call('HSCAN', meta, cursor, 'MATCH', 's:*', 'COUNT', 100)
    cursor = page[1]
    for i = 1, #page[2], 2 do
      if not still_silent(tonumber(page[2][i + 1])) then
        redis.call('HDEL', meta, page[2][i])
      end
    end
  until cursor == '0'
  for _, field in ipairs(silenced) do
    redis.call('HSET', meta, field, int(now))
  end
end
if stored[10] then
  redis.call('HDEL', meta, 's:' .. caller)
end
if used and count then
  for _, member in ipairs(expired) do
    used = used - parse(member)
  end
  count = count - #expired
end
-- The counter is never trusted over the members it counts: when `meta` or `holders` went
-- missing or changed behind our back (eviction, a stray DEL), the sum is rebuilt from the
-- members, and their keys get a TTL again.
local card = redis.call('ZCARD', holders)
if used == nil or count ~= card then
  used, count = 0, card
  for _, member in ipairs(redis.call('ZRANGE', holders, 0, -1)) do
    used = used + parse(member)
  end
  horizon = 0
  if card > 0 then
    local latest = tonumber(redis.call('ZRANGE', holders, -1, -1, 'WITHSCORES')[2])
    horizon = latest + math.floor((latest - now) / 2) + 1
    redis.call('PEXPIREAT', holders, int(horizon))
  end
  changed = true
end

-- Holders and meta outlive the latest lease by at most half a lease (meta's TTL is set once,
-- at the end).
local function cover(lease)
  if now + lease > horizon then
    horizon = now + lease + math.floor(lease / 2)
    redis.call('PEXPIREAT', holders, int(horizon))
    changed = true
  end
end

-- Adds a holder (of `weight`, with `lease`, parsed from `member`) for `term` ms (at most its
-- lease); returns its token and deadline.
local function grant(member, weight, lease, term)
  local deadline = now + math.min(term, lease)
  redis.call('ZADD', holders, int(deadline), member)
  redis.call('HSET', since, member, int(now))
  used = used + weight
  count = count + 1
  -- Strictly increasing; the server time in µs as a floor keeps the token above every token
  -- issued before the counter expired in an idle spell.
  fence = math.max(fence + 1, now_us)
  cover(lease)
  changed = true
  return fence, deadline
end

-- Pushes a holder's deadline to a full lease from now (never shortens it, never re-adds a
-- holder that is gone); returns the deadline, or nil when it no longer holds.
local function extend(member)
  local deadline = tonumber(redis.call('ZSCORE', holders, member))
  if not deadline then
    return nil
  end
  local _, lease = parse(member)
  if now + lease > deadline then
    deadline = now + lease
    redis.call('ZADD', holders, 'XX', int(deadline), member)
    settle_pending(member)
    cover(lease)
    changed = true
  end
  return deadline
end

local removed = 0
for i = 10, args - 1 do
  local member = ARGV[i]
  if redis.call('ZREM', holders, member) == 1 then
    redis.call('HDEL', since, member)
    settle_pending(member)
    used = used - parse(member)
    count = count - 1
    changed = true
    removed = removed + 1
  elseif redis.call('ZREM', queue, member) == 1 then
    redis.call('ZREM', alive, member)
    removed = removed + 1
  end
end

-- An operator evicts a stuck holder by its id; its slot goes to the line below.
local evicted = 0
if op == 'evict' then
  local cursor = '0'
  repeat
    local page = redis.call('ZSCAN', holders, cursor, 'MATCH', ARGV[args] .. ':*', 'COUNT', 1000)
    cursor = page[2][1] and '0' or page[1]
    local member = page[2][1]
    if member and redis.call('ZREM', holders, member) == 1 then
      redis.call('HDEL', since, member)
      settle_pending(member)
      used = used - parse(member)
      count = count - 1
      changed = true
      evicted = 1
    end
  until cursor == '0'
end

-- Admit waiters in arrival order while the oldest fits; forget waiters that stopped answering
-- (and any whose liveness entry is gone).
local granted = {}
local waiting = redis.call('ZCARD', queue)
if waiting > 0 then
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', alive, '-inf', int(now))) do
    redis.call('ZREM', queue, member)
    redis.call('ZREM', alive, member)
  end
  -- The line's head, read a few at a time: a release usually admits one waiter and finds the
  -- next one not fitting, which one read answers. Every member read is taken out of the line
  -- or passed over before the next read, so a read always starts just after those passed.
  local head, at, passed = {}, 1, 0
  local function next_in_line()
    if at > #head then
      head, at = redis.call('ZRANGE', queue, passed, passed + 3), 1
    end
    at = at + 1
    return head[at - 1]
  end
  -- Waiters of a silent process keep their place but are passed over (at most 64 a call, so
  -- a frozen process with a long line costs a bounded read).
  local silent = {}
  local function oldest()
    local member = next_in_line()
    while member do
      local tag = string.sub(member, 1, 8)
      if silent[tag] == nil then
        silent[tag] = still_silent(tonumber(redis.call('HGET', meta, 's:' .. tag)))
      end
      if not silent[tag] then
        return member
      end
      if passed >= 64 then
        return nil
      end
      passed = passed + 1
      member = next_in_line()
    end
    return nil
  end
  while true do
    local member = oldest()
    while member and parse(member) > limit do
      -- Heavier than the limit now in force: it would block the line for ever. Dropped, it
      -- learns at its next refresh and is refused.
      redis.call('ZREM', queue, member)
      redis.call('ZREM', alive, member)
      member = oldest()
    end
    local weight, lease = 0, 0
    if member then
      weight, lease = parse(member)
    end
    if not member or used + weight > limit or not settled(lease) then
      waiting = member and 1 or 0
      break
    end
    redis.call('ZREM', queue, member)
    if redis.call('ZREM', alive, member) == 1 then
      local term = math.min(claim, math.max(math.floor(lease / 2), 1))
      local token, deadline = grant(member, weight, lease, term)
      redis.call('HSET', meta, 'p:' .. member, 1)
      pending = pending + 1
      granted[member] = token
      -- On the channel of the member's process only (its id starts with the process's tag).
      redis.call(publisher, channel .. ':' .. string.sub(member, 1, 8),
        member .. ' ' .. int(token) .. ' ' .. int(deadline))
    end
  end
end

-- The line's keys expire after the latest waiter's deadline (`line`, kept in meta), pushed half
-- a patience further each time, so most joins and touches need no PEXPIREAT; a line created by
-- this call always gets one.
local line_was_empty = waiting == 0
local function wait(member)
  local deadline = now + patience
  redis.call('ZADD', alive, int(deadline), member)
  if line_was_empty or deadline > line then
    line_was_empty = false
    line = deadline + math.floor(patience / 2)
    redis.call('PEXPIREAT', queue, int(line))
    redis.call('PEXPIREAT', alive, int(line))
    changed = true
  end
end

-- Time until the earliest lease ends or the promotion fence lets a grant through (at least
-- 1 ms), or the patience when neither is due. Provisional grants are looked past (a few of
-- them): they are claimed or given back within the claim window, and a release admits the
-- next waiter itself, so waiters polling for their end would only load the server.
local function retry_in()
  local due = nil
  if pending == 0 then
    due = tonumber(redis.call('ZRANGE', holders, 0, 0, 'WITHSCORES')[2])
  elseif pending < count then
    local firsts = redis.call('ZRANGE', holders, 0, 7, 'WITHSCORES')
    for i = 1, #firsts, 2 do
      if redis.call('HEXISTS', meta, 'p:' .. firsts[i]) == 0 then
        due = tonumber(firsts[i + 1])
        break
      end
    end
  end
  if fenced_until and (not due or fenced_until < due) then
    due = fenced_until
  end
  if due then
    return math.max(due - now, 1)
  end
  return patience
end

-- A known member's state: a holder, claimed for a full lease since its process is alive (a
-- grant whose announcement may have been lost gets a fresh token), a waiter (its deadline
-- pushed back), or unknown.
local function status(member)
  local deadline = extend(member)
  if deadline then
    local token = granted[member]
    if not token then
      fence = math.max(fence + 1, now_us)
      token = fence
      changed = true
    end
    return 1, token, left(deadline)
  end
  if waiting > 0 and redis.call('ZSCORE', queue, member) then
    wait(member)
    return 2, 0, 0
  end
  return 0, 0, 0
end

local reply
if op == 'acquire' then
  -- Several acquires of one process may share a call; each is decided in turn, in arrival
  -- order, as if made alone. One released by this very call was cancelled by its caller
  -- meanwhile: it is not added.
  local cancelled = {}
  for i = 10, args - 1 do
    cancelled[ARGV[i]] = true
  end
  -- A rate limit (KEYS[6]) decided with each acquire that would be granted at once.
  local rate, period, burst = tonumber(ARGV[args]), tonumber(ARGV[args + 1]), tonumber(ARGV[args + 2])
  local rated = KEYS[6] ~= nil and KEYS[6] ~= promoted_key and rate > 0
  reply = {}
  for i = args + 3, #ARGV - 2, 3 do
    local member, mode, cost = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
    local weight, lease = parse(member)
    local state, token, rest = 0, 0, 0
    if mode == 'recheck' then
      state, token, rest = status(member)
    end
    local answer
    if state ~= 1 and weight > limit then
      answer = {3, limit}
    elseif state == 1 then
      answer = {1, token, rest, now_us, limit}
    elseif state == 2 then
      answer = {2, 0, now_us, limit}
    elseif cancelled[member] then
      answer = {0, 0, now_us, limit}
    elseif waiting == 0 and used + weight <= limit and settled(lease) then
      local allowed, retry_us = true, 0
      if rated and cost > 0 then
        local _
        allowed, _, retry_us = gcra(KEYS[6], rate, period, burst, cost, now_us)
      end
      if allowed then
        local deadline
        token, deadline = grant(member, weight, lease, lease)
        answer = {1, token, left(deadline), now_us, limit}
      else
        answer = {4, retry_us, limit}
      end
    elseif mode ~= 'once' then
      -- Strictly after every earlier arrival, so members queued by one call (or by two calls
      -- in the same microsecond) are served in the order they came.
      arrived = math.max(now_us, arrived + 1)
      redis.call('ZADD', queue, int(arrived), member)
      changed = true
      waiting = 1
      wait(member)
      answer = {2, 0, now_us, limit}
    else
      answer = {0, 0, now_us, limit}
    end
    table.insert(reply, answer)
  end
  -- Those not granted learn when the earliest lease ends, read once after every decision.
  local retry = nil
  for _, answer in ipairs(reply) do
    if answer[1] == 0 or answer[1] == 2 then
      retry = retry or retry_in()
      answer[2] = retry
    end
  end
elseif op == 'release' then
  reply = removed
elseif op == 'touch' then
  reply = {retry_in()}
  for i = args, #ARGV do
    local state, token, rest = status(ARGV[i])
    table.insert(reply, state)
    table.insert(reply, token)
    table.insert(reply, rest)
  end
elseif op == 'renew' then
  reply = {now_us}
  for i = args, #ARGV do
    local deadline = extend(ARGV[i])
    table.insert(reply, deadline and left(deadline) or 0)
  end
elseif op == 'used' then
  reply = math.max(used, 0)
elseif op == 'set_limit' then
  reply = 1
elseif op == 'evict' then
  reply = evicted
elseif op == 'snapshot' then
  reply = {limit, math.max(used, 0), redis.call('ZCARD', queue), now}
  for _, entry in ipairs(redis.call('ZRANGE', holders, 0, -1, 'WITHSCORES')) do
    table.insert(reply, entry)
  end
  local at = 5
  while at <= #reply do
    table.insert(reply, at + 2, tonumber(redis.call('HGET', since, reply[at])) or 0)
    at = at + 3
  end
else
  return redis.error_reply('unknown semaphore operation ' .. tostring(op))
end

if changed then
  if count <= 0 and not pinned and horizon <= now then
    -- Nothing held and nothing to remember: nothing stays behind (the token floor survives
    -- the lost counter). Otherwise meta, with the limit in force, lives until the horizon.
    redis.call('DEL', meta)
  else
    -- The fields that change on every grant and release, and the rest only when they did.
    local fields = {'used', int(math.max(used, 0)), 'count', int(count), 'fence', int(fence)}
    if horizon ~= tonumber(stored[4]) then
      table.insert(fields, 'horizon')
      table.insert(fields, int(horizon))
    end
    if line ~= tonumber(stored[7] or 0) then
      table.insert(fields, 'line')
      table.insert(fields, int(line))
    end
    if arrived ~= tonumber(stored[8] or 0) then
      table.insert(fields, 'arrived')
      table.insert(fields, int(arrived))
    end
    if pending ~= tonumber(stored[9] or 0) then
      table.insert(fields, 'pending')
      table.insert(fields, int(math.max(pending, 0)))
    end
    if limit ~= tonumber(stored[5]) or (pinned and '1' or '0') ~= stored[6] then
      table.insert(fields, 'limit')
      table.insert(fields, int(limit))
      table.insert(fields, 'pinned')
      table.insert(fields, pinned and '1' or '0')
    end
    redis.call('HSET', meta, unpack(fields))
    if horizon ~= tonumber(stored[4]) then
      redis.call('PEXPIREAT', since, int(horizon))
      if not pinned then
        redis.call('PEXPIREAT', meta, int(horizon))
      end
    end
    if pinned then
      redis.call('PERSIST', meta)
    end
  end
end
return reply
