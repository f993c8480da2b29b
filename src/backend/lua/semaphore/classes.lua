-- Classes. A member's class is its level
-- (`:c<level>` after its id; 4, NORMAL, without). The line serves a higher level first, each
-- class in arrival order. With shares (`classes` in meta: `<level>r<n>` reserved, `<level>m<n>`
-- at most, `tm<n>` at most per tenant, comma-separated; decided with the limit by whoever
-- stores it), meta keeps what each class holds in `c<level>`, and a class is admitted only
-- where its share allows: the slots other classes reserve and do not hold stay free for them,
-- and a class never holds more than its cap. With a per-tenant cap, meta keeps what each
-- tenant (`:t<16 hex>` after the class) holds in `u:<tenant>`, only while it holds some.
-- src/class.rs has the same rules and their tests.
-- Takes: `finite`, `int` (values.lua); `meta`, `limit`, `caller_shares`, `now` (args.lua);
-- `facts`, `learn` (members.lua); `used`, `arrived`, `stored_limit`, `stored_shares`,
-- `shares` (meta.lua).

-- A queued member's score: its class's rank (0 for the highest level) times 2^48, then its
-- arrival, strictly increasing (`arrived`; below 2^48 for centuries: a floor of 1/16 ms since
-- 2026 keeps it above every arrival before the counter was lost).
local RANK = 281474976710656
local function level_of(member)
  return (facts[member] or learn(member))[3]
end
local function rank_of(level)
  return 7 - level
end
local function next_arrival()
  local EPOCH_MS = 1767225600000
  arrived = math.max((now - EPOCH_MS) * 16, arrived + 1)
  -- Written back whoever asked (a promotion too), so no later arrival can share the score.
  changed = true
  return arrived
end

-- Each class's reservation and cap, what each holds, and whether that changed.
local reserved, at_most, in_class, held_changed

local function tenant_of(member)
  return (facts[member] or learn(member))[4]
end
-- The per-tenant cap, and what each tenant read so far holds (`dirty`: changed by this call).
local tenant_cap
local tenant_held, tenant_dirty
local function held_by(tenant)
  local n = tenant_held[tenant]
  if n == nil then
    n = math.max(finite(redis.call('HGET', meta, 'u:' .. tenant)) or 0, 0)
    tenant_held[tenant] = n
  end
  return n
end

-- A holder's weight counted in (`sign` 1) or out (-1) of `used`, its class's count and its
-- tenant's.
local function account(member, sign)
  local weight = parse(member)
  used = used + sign * weight
  if shares then
    local level = level_of(member)
    in_class[level] = in_class[level] + sign * weight
    held_changed = true
    local tenant = tenant_cap and tenant_of(member)
    if tenant then
      tenant_held[tenant] = held_by(tenant) + sign * weight
      tenant_dirty[tenant] = true
    end
  end
end

-- The most a member of `level` (of `tenant`, if any) may ever hold under the limit in force.
local function most(level, tenant)
  if not shares then
    return limit
  end
  local others = 0
  for other, n in pairs(reserved) do
    if other ~= level then
      others = others + n
    end
  end
  local m = math.max(limit - others, 0)
  if at_most[level] then
    m = math.min(m, at_most[level])
  end
  if tenant and tenant_cap then
    m = math.min(m, tenant_cap)
  end
  return m
end

-- Whether `weight` more of `level` (for `tenant`, if any) fits now: 'fits', 'tenant' (its
-- tenant holds all it may: it holds up no other tenant), 'capped' (its class holds all it may:
-- it holds up no other class) or 'full' (the pool the reservations leave is full).
local function room(level, weight, tenant)
  if shares then
    if tenant and tenant_cap and held_by(tenant) + weight > tenant_cap then
      return 'tenant'
    end
    if at_most[level] and in_class[level] + weight > at_most[level] then
      return 'capped'
    end
    local kept = 0
    for other, n in pairs(reserved) do
      if other ~= level then
        kept = kept + math.max(n - in_class[other], 0)
      end
    end
    if used + weight + kept > limit then
      return 'full'
    end
    return 'fits'
  end
  if used + weight > limit then
    return 'full'
  end
  return 'fits'
end

-- The highest class (lowest rank) whose oldest waiter waits for the pool, found by the line
-- below: a lower class is admitted only inside its own reservation while it waits.
local blocked
local function admits(level, weight, tenant)
  if room(level, weight, tenant) ~= 'fits' then
    return false
  end
  if blocked and blocked < rank_of(level) then
    return reserved[level] ~= nil and in_class[level] + weight <= reserved[level]
  end
  return true
end

-- The shares and the classes' counts, to write with meta (the tenants' at once: a tenant
-- holding nothing keeps no field).
local function class_fields(fields)
  for tenant in pairs(tenant_dirty) do
    if tenant_held[tenant] > 0 then
      redis.call('HSET', meta, 'u:' .. tenant, int(tenant_held[tenant]))
    else
      redis.call('HDEL', meta, 'u:' .. tenant)
    end
  end
  if shares and shares ~= stored_shares then
    table.insert(fields, 'classes')
    table.insert(fields, shares)
  end
  if held_changed then
    for level = 0, 7 do
      table.insert(fields, 'c' .. level)
      table.insert(fields, int(math.max(in_class[level], 0)))
    end
  end
end

-- What a call without shares (or without a tenant cap) has in place of the tables above: it
-- only reads them (every write is behind `shares` or `tenant_cap`), so one empty table, made
-- once, serves every such call. (A write would be seen by later calls: keep them behind.)
local NONE = {}

-- The shares in force and what each class (and tenant) holds.
local function step_classes()
  if arrived >= RANK then
    -- Written by a version that counted arrivals in µs.
    arrived = 0
  end
  if stored_shares then
    shares = stored_shares
  elseif not stored_limit and caller_shares ~= '' then
    shares = caller_shares
  end
  if shares and #shares > 256 then
    -- Longer than any this crate writes (eight classes' two shares and a tenant cap): foreign,
    -- and not read (a bounded call; the limit itself still holds).
    shares = nil
  end
  held_changed = false
  reserved, at_most, in_class = NONE, NONE, NONE
  if shares then
    reserved, at_most, in_class = {}, {}, {}
    for level, kind, n in string.gmatch(shares, '(%d)([rm])(%d+)') do
      if kind == 'r' then
        reserved[tonumber(level)] = tonumber(n)
      else
        at_most[tonumber(level)] = tonumber(n)
      end
    end
    local counts = redis.call('HMGET', meta, 'c0', 'c1', 'c2', 'c3', 'c4', 'c5', 'c6', 'c7')
    for level = 0, 7 do
      in_class[level] = math.max(finite(counts[level + 1]) or 0, 0)
    end
  end
  tenant_cap = shares and tonumber(string.match(shares, 'tm(%d+)'))
  tenant_held, tenant_dirty = NONE, NONE
  if tenant_cap then
    tenant_held, tenant_dirty = {}, {}
  end
  blocked = nil
end -- step_classes
