-- Part 4 of the semaphore script: expired holders out, the clamps for a clock stepped back,
-- the silent processes, and the counters checked against the members they count.

-- When the earliest lease ends (ms; nil when nothing is held): never later than the truth,
-- since a grant of this call lowers it (holders.lua) and a release or renewal, which would
-- raise it, leaves it be (a waiter told to retry early finds out and is told again).
local due

-- The server's clock stepped back: deadlines set before the step lie more than a lease ahead
-- and would keep their slots a step too long. Each is clamped to now + its lease; so are the
-- waiters' liveness deadlines, to now + patience. Every deadline was set by a call at `seen`
-- or before it, within its lease (or patience) of that call, so only a clock behind `seen`
-- (or meta lost, which forgets it) can need it: no read at all when the clock is sane.
local function clamp(key, span_of)
  local latest = redis.call('ZRANGE', key, '-1', '-1', 'WITHSCORES')
  if not latest[2] or math.floor(tonumber(latest[2])) <= now + span_of(latest[1]) then
    return false
  end
  local entries = redis.call('ZRANGEBYSCORE', key, '(' .. now_text, '+inf', 'WITHSCORES')
  for i = 1, #entries, 2 do
    local bound = now + span_of(entries[i])
    local score = tonumber(entries[i + 1])
    if math.floor(score) > bound then
      -- (A provisional grant stays one.)
      redis.call('ZADD', key, 'XX', int(bound) .. (score % 1 ~= 0 and '.5' or ''), entries[i])
    end
  end
  return true
end
-- A provisional grant that ran out unclaimed: its process is silent (frozen or dead), and
-- its other waiters are passed over until it is heard from (any call of it, below).
-- A silence lasts at most a patience (by then a dead process's waiters have left the line);
-- older marks are swept whenever a new one is made, so they stay few.
local function still_silent(marked)
  return marked ~= nil and now - marked < patience
end

-- Expired holders out, deadlines clamped after a step back, silent processes marked, the
-- caller's name kept, and the counters checked.
local function step_sweep()
  -- The earliest deadline, read once a call: holders whose lease has passed are dropped when it
  -- has, the counters are checked against it (below), and it is the waiters' retry hint
  -- (`retry_in`, line.lua).
  local earliest = redis.call('ZRANGE', holders, '0', '0', 'WITHSCORES')
  -- (Score with its fraction: a provisional grant whose deadline is now has passed too. Digits
  -- from the server: arithmetic reads them with one parse, `tonumber` takes two.)
  local first = earliest[2] and earliest[2] + 0
  -- Whose provisional grants (a score with a fraction) ran out unclaimed: the mark of each one's
  -- process.
  local expired, silenced = {}, {}
  if first and first <= now + 0.5 then
    local until_now = now_text .. '.5'
    local entries = redis.call('ZRANGEBYSCORE', holders, '-inf', until_now, 'WITHSCORES')
    for i = 1, #entries, 2 do
      table.insert(expired, entries[i])
      if tonumber(entries[i + 1]) % 1 ~= 0 then
        table.insert(silenced, 's:' .. tag_of(entries[i]))
      end
    end
    redis.call('ZREMRANGEBYSCORE', holders, '-inf', until_now)
    redis.call('HDEL', since, unpack(expired))
    changed = true
    earliest = redis.call('ZRANGE', holders, '0', '0', 'WITHSCORES')
    first = earliest[2] and earliest[2] + 0
  end
  due = first and math.floor(first)
  if (not seen or now < seen) and clamp(holders, function(member)
    local _, lease = parse(member)
    return lease
  end) then
    -- (Deadlines moved earlier, the earliest perhaps among them.)
    due = math.floor(tonumber(redis.call('ZRANGE', holders, '0', '0', 'WITHSCORES')[2]))
    changed = true
  end
  -- The line's expiry (`line`) lies at most 1.5 patience ahead unless the clock stepped back.
  if line > now + patience + math.floor(patience / 2) and clamp(alive, function()
    return patience
  end) then
    -- Deadlines moved earlier: the line is looked over for waiters gone this very call.
    alive_at = now
    changed = true
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
      redis.call('HSET', meta, field, now_text)
    end
    silent_at = now
  end
  if stored[4] then
    redis.call('HDEL', meta, 's:' .. caller)
  end
  -- The caller's name, told now and then (`RedisBackendBuilder::process_name`), for snapshots.
  -- Names not told for an hour go, so the set holds the processes of the last hour at most; the
  -- set expires with the holders (its expiry moves with theirs, at the end), and lives a claim
  -- window at least: the caller tells its name again after a pause that long, not sooner.
  if caller_name ~= '' then
    redis.call('ZADD', procs, now_text, ARGV[8])
    redis.call('ZREMRANGEBYSCORE', procs, '-inf', int(now - 3600000))
    redis.call('PEXPIREAT', procs, int(math.max(horizon, now + claim)))
  end
  if used and count then
    for _, member in ipairs(expired) do
      account(member, -1)
    end
    count = count - #expired
  end
  -- The counter is never trusted over the members it counts: when `meta` or `holders` went
  -- missing behind our back (eviction, a stray DEL, a TTL), the sum is rebuilt from the members,
  -- and their keys get a TTL again. Whole keys go, and the earliest read tells whether any
  -- holder is left; once a second the count is checked against the members too (a call that
  -- failed half-way, an ACL refusing a command after a write, leaves them apart).
  local card = used and seen and math.floor(now / 1000) ~= math.floor(seen / 1000)
    and redis.call('ZCARD', holders)
  if used == nil or (count > 0) ~= (earliest[1] ~= nil) or (card and card ~= count) then
    local members = redis.call('ZRANGE', holders, 0, -1)
    used, count = 0, #members
    if shares then
      for level = 0, 7 do
        in_class[level] = 0
      end
    end
    if tenant_cap then
      -- Every tenant's count is rebuilt too: those holding nothing lose their field.
      local cursor = '0'
      repeat
        local page = redis.call('HSCAN', meta, cursor, 'MATCH', 'u:*', 'COUNT', 100)
        cursor = page[1]
        for i = 1, #page[2], 2 do
          local tenant = string.sub(page[2][i], 3)
          tenant_held[tenant], tenant_dirty[tenant] = 0, true
        end
      until cursor == '0'
    end
    for _, member in ipairs(members) do
      account(member, 1)
    end
    horizon = 0
    if count > 0 then
      local latest = math.floor(tonumber(redis.call('ZRANGE', holders, -1, -1, 'WITHSCORES')[2]))
      horizon = latest + math.floor((latest - now) / 2) + 1
      redis.call('PEXPIREAT', holders, int(horizon))
    end
    changed = true
  end
end -- step_sweep
