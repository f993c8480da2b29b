-- Each operation's work and reply, the write-back, and `run`, the whole call: last, since
-- it takes from every file before it: `gcra` (gcra.lua), the reply codes (protocol.lua),
-- every file's `step_*` and per-call state (the grants, the line's answers: holders.lua,
-- line.lua), and meta's fields to write back (meta.lua).

-- The operation's reply.
local reply
-- The weight held as a reply tells it: the limit while it is not counted (sweep.lua's rebuild).
local function held()
  if used >= UNCOUNTED / 2 then
    return limit
  end
  return math.max(used, 0)
end
-- The operation (an error reply, for one no version of this crate sends).
local function step_operate()
  reply = nil
  if op == 'acquire' then
    -- Several acquires of one process may share a call; each is decided in turn, in arrival
    -- order, as if made alone. One released by this very call was cancelled by its caller
    -- meanwhile: it is not added.
    local cancelled = released_now
    -- A rate limit (KEYS[9]) decided with each acquire that would be granted at once.
    local rated = KEYS[9] ~= nil and KEYS[9] ~= promoted_key
    local rate, period, burst
    if rated then
      rate, period, burst = tonumber(ARGV[args]), tonumber(ARGV[args + 1]), tonumber(ARGV[args + 2])
      rated = rate > 0
    end
    reply = {}
    -- Whether a member was granted at once to a tenant whose head held up a class (see below).
    local to_tenant = false
    for i = args + 3, #ARGV - 2, 3 do
      local member, mode = ARGV[i], ARGV[i + 1]
      local weight, lease = parse(member)
      local level = level_of(member)
      local tenant = tenant_of(member)
      local state, token, rest = UNKNOWN, 0, 0
      if mode == 'recheck' then
        state, token, rest = status(member)
      end
      local answer
      if state ~= HOLDS and weight > most(level, tenant) then
        answer = {TOO_HEAVY, most(level, tenant)}
      elseif state == HOLDS then
        answer = {GRANTED, token, rest, now_us, limit}
      elseif state == WAITS then
        answer = {QUEUED, 0, now_us, limit}
      elseif cancelled[member] then
        answer = {FULL, 0, now_us, limit}
      elseif not waits_in[rank_of(level)] and admits(level, weight, tenant)
          and not (tenant and behind_own_head(member, level, tenant)) and settled(lease) then
        local allowed, retry_us, remaining, reset_us = true, 0, nil, nil
        local cost = rated and tonumber(ARGV[i + 2])
        if cost and cost > 0 then
          allowed, remaining, retry_us, reset_us = gcra(KEYS[9], rate, period, burst, cost, now_us)
        end
        if allowed then
          local deadline
          token, deadline = grant(member, weight, lease, lease)
          to_tenant = to_tenant or (tenant_cap ~= nil and tenant ~= nil and holding_up[tenant])
          -- (The 6th, whether anyone waits, is set once every member is decided.)
          answer = {GRANTED, token, left(deadline), now_us, limit, 0}
          if remaining then
            -- The rate was spent: what it left, for the RateLimit headers.
            answer[7], answer[8] = remaining, reset_us
          end
        else
          answer = {RATE_LIMITED, retry_us, limit}
        end
      elseif mode ~= 'once' then
        -- Strictly after every earlier arrival, so members queued by one call (or by two calls
        -- in the same microsecond) are served in the order they came.
        enqueue(member)
        wait(member)
        changed = true
        waiting = 1
        waits_in[rank_of(level)] = true
        answer = {QUEUED, 0, now_us, limit}
      else
        answer = {FULL, 0, now_us, limit}
      end
      table.insert(reply, answer)
    end
    if to_tenant then
      -- A grant to a tenant can leave its head that held up a class (or the classes below)
      -- passed over for that tenant's cap, with room behind it: the line is served again, so
      -- this call admits who now fits, not a later one. (Only then: nothing else a grant does
      -- makes room.)
      blocked = nil
      step_line()
    end
    -- Those not granted learn when the earliest lease ends, read once after every decision;
    -- those granted, whether anyone waits (a process holding prefetched slots gives them back).
    local retry = nil
    for _, answer in ipairs(reply) do
      if answer[1] == FULL or answer[1] == QUEUED then
        retry = retry or retry_in()
        answer[2] = retry
      elseif answer[1] == GRANTED then
        answer[6] = waiting > 0 and 1 or 0
      end
    end
  elseif op == 'release' then
    reply = {removed, waiting > 0 and 1 or 0, waiting > 0 and retry_in() or 0}
  elseif op == 'touch' then
    reply = {retry_in()}
    for i = args, #ARGV do
      local state, token, rest = status(ARGV[i])
      table.insert(reply, state)
      table.insert(reply, token)
      table.insert(reply, rest)
    end
  elseif op == 'renew' then
    reply = {now_us, waiting > 0 and 1 or 0}
    for i = args, #ARGV do
      local deadline = extend(ARGV[i])
      table.insert(reply, deadline and left(deadline) or 0)
    end
  elseif op == 'used' then
    reply = {held(), limit}
  elseif op == 'set_limit' or op == 'unset_limit' then
    reply = 1
  elseif op == 'evict' then
    reply = evicted
  elseif op == 'snapshot' then
    -- Waiters per level (each class's line and its parked tenants), and per tenant among the
    -- first 1 000 of the tenants' index (a bounded read, whatever the line holds).
    local by_level = {}
    for level = 0, 7 do
      local from = rank_of(level) * RANK
      by_level[level + 1] = redis.call('ZCOUNT', queue, int(from), '(' .. int(from + RANK))
        + redis.call('ZCOUNT', queue, int(PARKED + from), '(' .. int(PARKED + from + RANK))
    end
    local per_tenant, tenant_order = {}, {}
    for _, entry in ipairs(redis.call('ZRANGE', tenants, '0', int(SHOWN - 1))) do
      -- (An entry of another form is not counted.)
      local tenant = string.match(entry, '^%d(' .. string.rep('%x', 16) .. ')[#|]')
      if tenant and not per_tenant[tenant] then
        table.insert(tenant_order, tenant)
        per_tenant[tenant] = 0
      end
      if tenant then
        per_tenant[tenant] = per_tenant[tenant] + 1
      end
    end
    for i, tenant in ipairs(tenant_order) do
      tenant_order[i] = tenant .. ':' .. per_tenant[tenant]
    end
    -- The latest SHOWN processes' names (the set is ordered by when each was told) and
    -- protocol versions (a named process that never told one speaks version 1): how many
    -- processes of each version, as "<version>:<n>,...".
    local names, spoken, speakers, told = {}, {}, {}, {}
    for _, entry in ipairs(redis.call('ZRANGE', procs, int(-SHOWN), '-1')) do
      names[string.sub(entry, 1, 8)] = string.sub(entry, 10)
    end
    for _, entry in ipairs(redis.call('ZRANGE', versions, int(-SHOWN), '-1')) do
      -- (Entries of another form are not read.)
      local tag, version = string.match(entry, '^(%x%x%x%x%x%x%x%x) (%d%d?%d?)$')
      if tag then
        spoken[tag] = version
      end
    end
    for tag in pairs(names) do
      local version = spoken[tag] or '1'
      speakers[version] = (speakers[version] or 0) + 1
    end
    for version, n in pairs(speakers) do
      table.insert(told, version .. ':' .. n)
    end
    table.sort(told)
    -- The weight each class holds, over the first MAX_COUNTED holders (all of them unless the
    -- limit is larger), and the first SHOWN of those listed with when each was granted (one
    -- read for them all).
    local weights = {0, 0, 0, 0, 0, 0, 0, 0}
    local listed = {}
    local entries = redis.call('ZRANGE', holders, '0', int(MAX_COUNTED - 1), 'WITHSCORES')
    for i = 1, #entries, 2 do
      local member = entries[i]
      local weight = parse(member)
      -- (A member of no weight is of no form this crate writes: neither counted nor listed.)
      if weight >= 1 then
        local level = level_of(member) + 1
        weights[level] = weights[level] + weight
        if #listed < SHOWN then
          table.insert(listed, i)
        end
      end
    end
    reply = {limit, held(), redis.call('ZCARD', queue), now, pinned and 1 or 0,
      table.concat(by_level, ','), table.concat(tenant_order, ','), shares or '',
      table.concat(told, ','), table.concat(weights, ',')}
    if #listed > 0 then
      local members = {}
      for n, i in ipairs(listed) do
        members[n] = entries[i]
      end
      local granted = redis.call('HMGET', since, unpack(members))
      for n, i in ipairs(listed) do
        table.insert(reply, entries[i])
        table.insert(reply, int(math.min(math.floor(tonumber(entries[i + 1])), now + 2 ^ 40)))
        table.insert(reply, finite(granted[n]) or 0)
        table.insert(reply, names[string.sub(entries[i], 1, 8)] or '')
      end
    end
  else
    return redis.error_reply('unknown semaphore operation ' .. tostring(op))
  end
end -- step_operate

-- The state this call changed, written back.
local function step_write_back()
  if changed then
    if count <= 0 and not pinned and horizon <= now then
      -- Nothing held and nothing to remember: nothing stays behind (the token floor survives
      -- the lost counter). Otherwise meta, with the limit in force, lives until the horizon.
      redis.call('DEL', meta)
    else
      -- The counters in one field, the rest only when they changed.
      -- (`seen` stays while a clamp left deadlines for the next call: sweep.lua.)
      local fields = {'state', struct.pack(STATE, math.max(used, 0), count, fence, horizon, line,
        arrived, clamping and seen or now, alive_at or -1, silent_at or -1)}
      if stored_version ~= PROTOCOL_TEXT then
        table.insert(fields, 'v')
        table.insert(fields, PROTOCOL_TEXT)
      end
      if adaptive and adaptive ~= stored[5] then
        table.insert(fields, 'adaptive')
        table.insert(fields, adaptive)
      end
      gradient_fields(fields)
      class_fields(fields)
      if limit ~= stored_limit or (pinned and '1' or '0') ~= stored_pinned then
        table.insert(fields, 'limit')
        table.insert(fields, int(limit))
        table.insert(fields, 'pinned')
        table.insert(fields, pinned and '1' or '0')
      end
      redis.call('HSET', meta, unpack(fields))
      if unpinned ~= stored_unpinned then
        if unpinned then
          redis.call('HSET', meta, 'unpinned', int(unpinned))
        else
          redis.call('HDEL', meta, 'unpinned')
        end
      end
      if horizon ~= horizon_was then
        redis.call('PEXPIREAT', since, int(horizon))
        if horizon > now then
          -- (Not to a horizon passed: a name told by this call stays its claim window.)
          redis.call('PEXPIREAT', procs, int(horizon))
        end
        if not pinned then
          redis.call('PEXPIREAT', meta, int(horizon))
        end
      end
      if pinned then
        redis.call('PERSIST', meta)
      elseif stored_pinned == '1' then
        -- Unpinned by this call: meta expires with the holders again.
        redis.call('PEXPIREAT', meta, int(horizon))
      end
    end
  end
end -- step_write_back

-- One call: its keys and arguments, the reply. Each part's `step_*`, in the order of the parts
-- (sent as a script, each runs where it stands, and the script returns `reply`: script.rs).
local function run(keys, argv)
  KEYS, ARGV = keys, argv
  local refused = step_args()
  if refused then
    return refused
  end
  refused = step_meta()
  if refused then
    return refused
  end
  step_classes()
  step_tenants()
  step_fence()
  step_sweep()
  step_adapt()
  step_holders()
  step_line()
  refused = step_operate()
  if refused then
    return refused
  end
  step_write_back()
  return reply
end -- run
