-- Tenants, served in turn inside each class. Only a tenant's
-- head (its oldest waiter of the class) stands in the class's line; its later waiters are
-- parked: in `queue` past every class's range (so a lookup finds them; the line never reads
-- them), and in `tenants` (KEYS[7]), a lex-ordered set of score 0 holding per class and tenant
-- `<rank><tenant>#<head>` and `<rank><tenant>|<arrival, 15 digits>|<parked member>`. When a
-- head leaves the line (granted, cancelled, gone silent), the tenant's oldest parked waiter
-- joins the line at the back, as a new arrival: one tenant's flood waits behind every other
-- tenant's next request. The set holds one entry per waiter of a tenant and expires with the
-- line.
-- Takes: `int` (values.lua); `KEYS`, `queue`, `alive`, `patience`, `now`, `spend` (args.lua);
-- `line` (meta.lua); `RANK`, `level_of`, `rank_of`, `next_arrival`, `tenant_of` (classes.lua).

local tenants
local PARKED = 8 * RANK

-- `<rank><tenant>` of a member of a tenant.
local function tenant_line(member, tenant)
  return rank_of(level_of(member)) .. tenant
end

local function head_of(line_of)
  local marker = redis.call('ZRANGEBYLEX', tenants, '[' .. line_of .. '#', '(' .. line_of .. '$',
    'LIMIT', 0, 1)[1]
  return marker and string.sub(marker, #line_of + 2)
end

local function parked_entry(line_of, arrival, member)
  return line_of .. '|' .. string.format('%015d', arrival) .. '|' .. member
end

-- The oldest live parked waiter of `line_of` (rank `rank`) becomes its head, at the back of
-- the class's line; parked waiters found gone on the way are dropped.
local function promote(line_of, rank)
  -- (Within the call's budget: a tenant left with no head is healed by its next waiter's
  -- touch, `heal` below.)
  while spend(1) do
    local entry = redis.call('ZRANGEBYLEX', tenants, '[' .. line_of .. '|', '(' .. line_of .. '}',
      'LIMIT', 0, 1)[1]
    if not entry then
      return
    end
    local member = string.sub(entry, #line_of + 18)
    local deadline = tonumber(redis.call('ZSCORE', alive, member))
    if deadline and deadline > now then
      -- The marker first: the set never empties (which would drop its expiry) on the way.
      redis.call('ZADD', tenants, 0, line_of .. '#' .. member)
      redis.call('ZREM', tenants, entry)
      redis.call('ZADD', queue, int(rank * RANK + next_arrival()), member)
      return
    end
    redis.call('ZREM', tenants, entry)
    redis.call('ZREM', queue, member)
    redis.call('ZREM', alive, member)
  end
end

-- Puts `member` in line (before `wait` gives it a liveness deadline, and the tenants' index
-- its expiry): at the back of its class, or parked behind its tenant's head.
local function enqueue(member)
  local rank = rank_of(level_of(member))
  local arrival = next_arrival()
  local tenant = tenant_of(member)
  if tenant then
    local line_of = tenant_line(member, tenant)
    local head = head_of(line_of)
    if head and redis.call('ZSCORE', queue, head) then
      redis.call('ZADD', queue, int(PARKED + rank * RANK + arrival), member)
      redis.call('ZADD', tenants, 0, parked_entry(line_of, arrival, member))
      return
    end
    if head then
      -- A head that left the line unseen (its keys expired or were evicted).
      redis.call('ZREM', tenants, line_of .. '#' .. head)
    end
    redis.call('ZADD', tenants, 0, line_of .. '#' .. member)
  end
  redis.call('ZADD', queue, int(rank * RANK + arrival), member)
end

-- `member`, of `tenant`, left the line from `score`: a parked one takes its entry with it, a
-- head makes way for its tenant's next.
local function left_line(member, tenant, score)
  local line_of = tenant_line(member, tenant)
  local rank = rank_of(level_of(member))
  if score >= PARKED then
    redis.call('ZREM', tenants, parked_entry(line_of, score - PARKED - rank * RANK, member))
    return
  end
  redis.call('ZREM', tenants, line_of .. '#' .. member)
  promote(line_of, rank)
end

-- Takes `member` out of the line (a waiter cancelled, or gone silent); true if it waited.
local function unqueue(member)
  local tenant = tenant_of(member)
  local score = tenant and tonumber(redis.call('ZSCORE', queue, member))
  if redis.call('ZREM', queue, member) == 0 then
    return false
  end
  redis.call('ZREM', alive, member)
  if score then
    left_line(member, tenant, score)
  end
  return true
end

-- A parked waiter (at `score`) whose tenant has no head standing (its head left unseen: keys
-- expired or evicted) would wait for ever: its tenant's oldest parked one is made head, or
-- itself when the index lost it too.
local healthy
local function heal(member, tenant, score)
  local line_of = tenant_line(member, tenant)
  healthy = healthy or {}
  if healthy[line_of] then
    -- Checked by this call already (a touch carries every waiter of its process).
    return
  end
  healthy[line_of] = true
  local rank = rank_of(level_of(member))
  local head = head_of(line_of)
  if head and redis.call('ZSCORE', queue, head) then
    return
  end
  if head then
    redis.call('ZREM', tenants, line_of .. '#' .. head)
  end
  promote(line_of, rank)
  if not head_of(line_of) then
    redis.call('ZREM', tenants, parked_entry(line_of, score - PARKED - rank * RANK, member))
    redis.call('ZADD', queue, int(rank * RANK + next_arrival()), member)
    redis.call('ZADD', tenants, 0, line_of .. '#' .. member)
    redis.call('PEXPIREAT', tenants, int(math.max(line, now + patience)))
  end
end

local function step_tenants()
  tenants = KEYS[7]
  -- (Made by the first heal of the call.)
  healthy = nil
end -- step_tenants
