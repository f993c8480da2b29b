-- The sweep: expired holders out, the clamps for a clock stepped back, the silent
-- processes, and the counters checked against the members they count.
-- Takes: `BUDGET`, `MAX_COUNTED`, `UNCOUNTED`, `META_FIELDS` (protocol.lua); `int`
-- (values.lua); the keys, `limit`, `patience`, `claim`, `caller`, `now`, `work`, `spend`
-- (args.lua); `parse`, `tag_of` (members.lua); the state (`used`, `count`, `horizon`,
-- `line`, `seen`, `alive_at`, `silent_at`, `changed`, `shares`: meta.lua); `in_class`,
-- `tenant_cap`, `account`, `NONE` (classes.lua).

-- When the earliest lease ends (ms; nil when nothing is held): never later than the truth,
-- since a grant of this call lowers it (holders.lua) and a release or renewal, which would
-- raise it, leaves it be (a waiter told to retry early finds out and is told again).
local due
-- The clamp below left deadlines for a later call: `seen` stays as it was, so that call clamps.
local clamping

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
  -- (The budget's worth a call, the earliest first: a later call clamps the rest, since the
  -- latest still lies too far ahead; `seen` is kept until then, write-back in ops.lua.)
  local entries = redis.call('ZRANGEBYSCORE', key, '(' .. now_text, '+inf', 'WITHSCORES',
    'LIMIT', '0', int(math.max(work, 1)))
  for i = 1, #entries, 2 do
    if not spend(1) then
      break
    end
    local bound = now + span_of(entries[i])
    local score = tonumber(entries[i + 1])
    if math.floor(score) > bound then
      -- (A provisional grant stays one.)
      redis.call('ZADD', key, 'XX', int(bound) .. (score % 1 ~= 0 and '.5' or ''), entries[i])
    end
  end
  clamping = true
  return true
end
-- A provisional grant that ran out unclaimed: its process is silent (frozen or dead), and
-- its other waiters are passed over until it is heard from (any call of it, below).
-- A silence lasts at most a patience (by then a dead process's waiters have left the line);
-- older marks are swept whenever a new one is made, so they stay few.
local function still_silent(marked)
  return marked ~= nil and now - marked < patience
end

-- The fields of meta a rebuild keeps (the counters are rebuilt, the silence marks forgotten).
local KEPT = {'limit', 'pinned', 'adaptive', 'unpinned', 'classes', 'v', 'a:lim', 'a:noload',
  'a:start', 'a:n', 'a:sum', 'a:peak', 'a:over', 'a:pat', 'a:psave', 'a:pn', 'a:plow'}

-- The counters rebuilt from the holders (`members`, when read already), and, when meta holds
-- more fields than this version keeps (`bloated`: an older build's, or foreign) or tenants
-- are counted (each tenant's count is rebuilt: those holding nothing lose their field), meta
-- made anew with only the fields it keeps. More holders than MAX_COUNTED are not read: the weight held is then
-- UNCOUNTED, so nothing is admitted until expiries and releases bring them under it (a
-- bounded call before an exact one; the limit holds throughout).
local function rebuild(members, bloated)
  -- (With a per-tenant cap, always: a tenant's count left from before would be added to.)
  if bloated or tenant_cap then
    local values = redis.call('HMGET', meta, unpack(KEPT))
    redis.call('DEL', meta)
    local fields = {}
    for i, field in ipairs(KEPT) do
      if values[i] then
        table.insert(fields, field)
        table.insert(fields, values[i])
      end
    end
    if #fields > 0 then
      redis.call('HSET', meta, unpack(fields))
    end
    -- (Its expiry, lost with the key, is set again at the write-back.)
    horizon_was = nil
  end
  count = redis.call('ZCARD', holders)
  if not members and count <= MAX_COUNTED then
    members = redis.call('ZRANGE', holders, '0', '-1')
  end
  used = members and 0 or UNCOUNTED
  if shares then
    for level = 0, 7 do
      in_class[level] = 0
    end
  end
  for _, member in ipairs(members or NONE) do
    account(member, 1)
  end
  horizon = 0
  if count > 0 then
    local latest = math.floor(math.min(tonumber(redis.call('ZRANGE', holders, -1, -1,
      'WITHSCORES')[2]), now + 2 ^ 40))
    horizon = math.max(latest, now) + math.floor(math.max(latest - now, 0) / 2) + 1
    redis.call('PEXPIREAT', holders, int(horizon))
  end
  changed = true
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
  clamping = false
  if first and first <= now + 0.5 then
    -- (The budget's worth a call: `due`, passed already, brings the callers back for the rest.)
    local until_now = now_text .. '.5'
    local entries = redis.call('ZRANGEBYSCORE', holders, '-inf', until_now, 'WITHSCORES',
      'LIMIT', '0', int(BUDGET))
    for i = 1, #entries, 2 do
      table.insert(expired, entries[i])
      if tonumber(entries[i + 1]) % 1 ~= 0 then
        table.insert(silenced, 's:' .. tag_of(entries[i]))
      end
    end
    spend(#expired)
    redis.call('ZREM', holders, unpack(expired))
    redis.call('HDEL', since, unpack(expired))
    changed = true
    earliest = redis.call('ZRANGE', holders, '0', '0', 'WITHSCORES')
    first = earliest[2] and earliest[2] + 0
  end
  due = first and math.floor(first)
  -- (And once a second, below: a deadline past a holder's lease is foreign too.)
  local check = used and seen and math.floor(now / 1000) ~= math.floor(seen / 1000)
  if (not seen or now < seen or check) and clamp(holders, function(member)
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
    -- Marks older than a patience are swept a page at a time, from where the last sweep
    -- stopped (`scan` in meta): a bounded read however many fields meta holds.
    local page = redis.call('HSCAN', meta, stored[10] or '0', 'MATCH', 's:*', 'COUNT', 100)
    for i = 1, #page[2], 2 do
      if not still_silent(tonumber(page[2][i + 1])) then
        redis.call('HDEL', meta, page[2][i])
      end
    end
    redis.call('HSET', meta, 'scan', page[1])
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
    -- Which protocol each process speaks, told with its name (a process of version 1, which
    -- does not tell, is named in procs and missing here): for `dlimit show`. Kept as procs is.
    redis.call('ZADD', versions, now_text, caller .. ' ' .. PROTOCOL)
    redis.call('ZREMRANGEBYSCORE', versions, '-inf', int(now - 3600000))
    redis.call('PEXPIREAT', versions, int(math.max(horizon, now + claim)))
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
  -- holder is left; the count is checked against the members on every call, and once a
  -- second the weights too (a call that failed half-way, an ACL refusing a command after a
  -- write, leaves them apart), and meta's size (fields an older build leaves behind: see
  -- `rebuild`).
  -- (The count every call, one command: a holder added behind the script's back, by another
  -- program or a foreign write, is counted before anything else is admitted.)
  local card = used and redis.call('ZCARD', holders)
  local members, drift
  if check and card <= MAX_COUNTED then
    members = redis.call('ZRANGE', holders, '0', '-1')
    local sum = 0
    for _, member in ipairs(members) do
      sum = sum + parse(member)
    end
    drift = sum ~= used and sum
  end
  if drift then
    redis.log(redis.LOG_WARNING, string.format('dlimit: %s counted a weight of %d held where its '
      .. 'holders hold %d; counted again', meta, used, drift))
  end
  -- (HLEN refused by an ACL: meta is cleaned when it is rebuilt for another reason.)
  local size = check and redis.pcall('HLEN', meta)
  local bloated = type(size) == 'number' and size > META_FIELDS + 2 * limit
  if used == nil or used >= UNCOUNTED or card ~= count or drift or bloated then
    rebuild(members, bloated)
  end
end -- step_sweep
