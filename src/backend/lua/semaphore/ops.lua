-- Part 8 of the semaphore script: each operation's work and reply, the write-back, and `run`,
-- the whole call.

-- The operation's reply.
local reply
-- The operation (an error reply, for one no version of this crate sends).
local function step_operate()
  reply = nil
  if op == 'acquire' then
    -- Several acquires of one process may share a call; each is decided in turn, in arrival
    -- order, as if made alone. One released by this very call was cancelled by its caller
    -- meanwhile: it is not added.
    local cancelled = released_now
    -- A rate limit (KEYS[8]) decided with each acquire that would be granted at once.
    local rated = KEYS[8] ~= nil and KEYS[8] ~= promoted_key
    local rate, period, burst
    if rated then
      rate, period, burst = tonumber(ARGV[args]), tonumber(ARGV[args + 1]), tonumber(ARGV[args + 2])
      rated = rate > 0
    end
    reply = {}
    for i = args + 3, #ARGV - 2, 3 do
      local member, mode = ARGV[i], ARGV[i + 1]
      local weight, lease = parse(member)
      local level = level_of(member)
      local tenant = tenant_of(member)
      local state, token, rest = 0, 0, 0
      if mode == 'recheck' then
        state, token, rest = status(member)
      end
      local answer
      if state ~= 1 and weight > most(level, tenant) then
        answer = {3, most(level, tenant)}
      elseif state == 1 then
        answer = {1, token, rest, now_us, limit}
      elseif state == 2 then
        answer = {2, 0, now_us, limit}
      elseif cancelled[member] then
        answer = {0, 0, now_us, limit}
      elseif not waits_in[rank_of(level)] and admits(level, weight, tenant) and settled(lease) then
        local allowed, retry_us, remaining, reset_us = true, 0, nil, nil
        local cost = rated and tonumber(ARGV[i + 2])
        if cost and cost > 0 then
          allowed, remaining, retry_us, reset_us = gcra(KEYS[8], rate, period, burst, cost, now_us)
        end
        if allowed then
          local deadline
          token, deadline = grant(member, weight, lease, lease)
          -- (The 6th, whether anyone waits, is set once every member is decided.)
          answer = {1, token, left(deadline), now_us, limit, 0}
          if remaining then
            -- The rate was spent: what it left, for the RateLimit headers.
            answer[7], answer[8] = remaining, reset_us
          end
        else
          answer = {4, retry_us, limit}
        end
      elseif mode ~= 'once' then
        -- Strictly after every earlier arrival, so members queued by one call (or by two calls
        -- in the same microsecond) are served in the order they came.
        enqueue(member)
        wait(member)
        changed = true
        waiting = 1
        waits_in[rank_of(level)] = true
        answer = {2, 0, now_us, limit}
      else
        answer = {0, 0, now_us, limit}
      end
      table.insert(reply, answer)
    end
    -- Those not granted learn when the earliest lease ends, read once after every decision;
    -- those granted, whether anyone waits (a process holding prefetched slots gives them back).
    local retry = nil
    for _, answer in ipairs(reply) do
      if answer[1] == 0 or answer[1] == 2 then
        retry = retry or retry_in()
        answer[2] = retry
      elseif answer[1] == 1 then
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
    reply = math.max(used, 0)
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
    for _, entry in ipairs(redis.call('ZRANGE', tenants, 0, 999)) do
      local tenant = string.sub(entry, 2, 17)
      if not per_tenant[tenant] then
        table.insert(tenant_order, tenant)
      end
      per_tenant[tenant] = (per_tenant[tenant] or 0) + 1
    end
    for i, tenant in ipairs(tenant_order) do
      tenant_order[i] = tenant .. ':' .. per_tenant[tenant]
    end
    reply = {limit, math.max(used, 0), redis.call('ZCARD', queue), now, pinned and 1 or 0,
      table.concat(by_level, ','), table.concat(tenant_order, ','), shares or ''}
    -- Each process's latest name (the set is ordered by when each was told).
    local names = {}
    for _, entry in ipairs(redis.call('ZRANGE', procs, 0, -1)) do
      names[string.sub(entry, 1, 8)] = string.sub(entry, 10)
    end
    local entries = redis.call('ZRANGE', holders, 0, -1, 'WITHSCORES')
    for i = 1, #entries, 2 do
      local member = entries[i]
      table.insert(reply, member)
      table.insert(reply, int(math.floor(tonumber(entries[i + 1]))))
      table.insert(reply, tonumber(redis.call('HGET', since, member)) or 0)
      table.insert(reply, names[string.sub(member, 1, 8)] or '')
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
      local fields = {'state', struct.pack(STATE, math.max(used, 0), count, fence, horizon, line,
        arrived, now, alive_at or -1, silent_at or -1)}
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
  step_meta()
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
