-- Holders granted, extended and released; an operator's evict.
-- Takes: `finite`, `int`, `widen` (values.lua); `holders`, `since`, `op`, `args`, `now`,
-- `spend` (args.lua); `parse`, `released_member`, `prefetched` (members.lua); `used`, `count`,
-- `fence`, `horizon`, `changed`, `pinned`, `adaptive` (meta.lua); `account` (classes.lua);
-- `unqueue` (tenants.lua); `due` (sweep.lua); `sample` (adapt.lua).

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
-- lease), provisional (its score's fraction says so) until its process claims it; returns its
-- token and deadline.
local function grant(member, weight, lease, term, provisional)
  local deadline = now + math.min(term, lease)
  due = math.min(due or deadline, deadline)
  redis.call('ZADD', holders, provisional and int(deadline) .. '.5' or int(deadline), member)
  redis.call('HSET', since, member, now_text)
  account(member, 1)
  count = count + 1
  if count == 4 then
    widen(holders)
    widen(since, true)
  end
  -- Strictly increasing; the server time in µs as a floor keeps the token above every token
  -- issued before the counter expired in an idle spell.
  fence = math.max(fence + 1, now_us)
  cover(lease)
  changed = true
  return fence, deadline
end

-- Pushes a holder's deadline to a full lease from now (never shortens it, never re-adds a
-- holder that is gone), which claims a provisional grant; returns the deadline, or nil when
-- it no longer holds.
local function extend(member)
  local score = tonumber(redis.call('ZSCORE', holders, member))
  if not score then
    return nil
  end
  local deadline = math.floor(score)
  local _, lease = parse(member)
  if now + lease > deadline then
    deadline = now + lease
    redis.call('ZADD', holders, 'XX', int(deadline), member)
    cover(lease)
    changed = true
  end
  return deadline
end

-- How many of the members to release held or waited, and which they are; whether an
-- operator's evict removed one.
local removed, released_now, evicted

-- The members this call releases, and an operator's evict.
local function step_holders()
  removed, released_now = 0, {}
  for i = 10, args - 1 do
    local member, overloaded, held, n = released_member(ARGV[i])
    released_now[member] = true
    if member == '' then
      -- Holds that ended in a prefetch: samples, nothing to release.
      if held then
        sample(held, used, overloaded, n)
      end
    elseif redis.call('ZREM', holders, member) == 1 then
      if adaptive and not pinned then
        -- The process's own measure, else the time since the grant here (a process built with
        -- a fixed limit does not send one). A prefetched slot released unsent was on hand in its
        -- pool: the time since its grant here is no hold.
        if not held and not prefetched(member) then
          local granted = finite(redis.call('HGET', since, member))
          held = granted and now - granted
        end
        if held then
          sample(held, used, overloaded, 1)
        end
      end
      redis.call('HDEL', since, member)
      account(member, -1)
      count = count - 1
      changed = true
      removed = removed + 1
    elseif unqueue(member) then
      removed = removed + 1
    end
  end

  -- An operator evicts a stuck holder by its id; its slot goes to the line below.
  evicted = 0
  if op == 'evict' then
    -- (A page a unit of the budget: a holder not found within it is reported not found.)
    local cursor = '0'
    repeat
      local page = redis.call('ZSCAN', holders, cursor, 'MATCH', ARGV[args] .. ':*', 'COUNT', 100)
      cursor = page[2][1] and '0' or page[1]
      local member = page[2][1]
      if member and redis.call('ZREM', holders, member) == 1 then
        redis.call('HDEL', since, member)
        account(member, -1)
        count = count - 1
        changed = true
        evicted = 1
      end
    until cursor == '0' or not spend(1)
  end
end -- step_holders
