-- The line, first come first served in each class, higher classes first: waiters admitted,
-- queued, and the retry hint.
-- Takes: `UNKNOWN`, `HOLDS`, `WAITS` (protocol.lua); `int`, `widen` (values.lua); the keys,
-- `channel`, `publisher`, `patience`, `claim`, `now`, `work`, `spend`, `left` (args.lua);
-- `parse`, `tag_of` (members.lua); `fence`, `line`, `alive_at`, `silent_at`, `changed`,
-- `shares` (meta.lua); `RANK`, `level_of`, `rank_of`, `tenant_of`, `most`, `room`,
-- `blocked`, `admits`, `next_arrival`, `NONE` (classes.lua); `tenants`, `PARKED`,
-- `tenant_line`, `head_of`, `left_line`, `unqueue`, `heal` (tenants.lua); `fenced_until`,
-- `settled` (fence.lua); `due`, `still_silent` (sweep.lua); `grant`, `extend` (holders.lua).

-- Admit waiters, each class in arrival order while its oldest fits; forget waiters that
-- stopped answering (and any whose liveness entry is gone). `granted`: the token of each
-- member granted by this call.
local granted
-- The line's first two (by class, then arrival): whether anyone waits, and the first class's
-- head, so most calls read the line once (a release usually admits one waiter and finds the
-- next not fitting; each member read costs its conversion and its parse, about as much as a
-- command: two, not four, spared 7 % of a contended call).
-- (Numbers go to Redis as strings: one passed as it is costs a float's formatting, and so does
-- `int`: the head's bounds are written out.)
local HEAD, HEAD_LAST, HEAD_COUNT = 2, '1', '2'
local firsts
-- A waiter's place in the line: its class's rank, or past every class (8 and up) when parked.
-- Only a tenant's waiters park, so the others' place is in their names (a score read costs
-- its formatting as a float and a parse back).
local function place(member)
  if tenant_of(member) then
    return math.floor(tonumber(redis.call('ZSCORE', queue, member)) / RANK)
  end
  return rank_of(level_of(member))
end
-- Whether anyone waits (1) or not (0), and the classes (by rank) whose oldest waiter still
-- waits: a newcomer of one queues behind it. `tenant_capped`: the tenants (by
-- `<rank><tenant>`) whose head was passed over for its tenant's cap; `cut_off`: the classes
-- whose reading stopped among waiters passed over (64 of them, or the budget), where the index
-- tells whether a tenant's head stands further on. A newcomer waits behind its own tenant's
-- head, but not behind heads passed over: a class of many tenants at their cap takes newcomers
-- (holding them up, the budget's 32 reads could never reach them). `holding_up`: the tenants
-- whose head holds up its class, waiting for room (at most one a class).
local waiting, waits_in, tenant_capped, cut_off, holding_up
-- The processes whose waiters are passed over (by tag), and whether any was marked within a
-- patience; the class served, its head as read so far, the next of it to look at, and how
-- many of it were passed over.
local silent, anyone_silent
local rank, head, at, passed
-- Whether the line was empty when this call began, until a waiter joins.
local line_was_empty
-- Each class in turn, highest first: its head read two at a time, since a release usually
-- admits one waiter and finds the next one not fitting, which one read answers. Every
-- member read is taken out of the line or passed over before the next read, so a read
-- always starts just after those passed.
local function next_in_line()
  if at > #head then
    head, at = redis.call('ZRANGEBYSCORE', queue, int(rank * RANK), '(' .. int((rank + 1) * RANK),
      'LIMIT', int(passed), HEAD_COUNT), 1
  end
  at = at + 1
  return head[at - 1]
end
-- Waiters of a silent process keep their place but are passed over (at most 64 a call, so
-- a frozen process with a long line costs a bounded read).
local function oldest()
  local member = next_in_line()
  while member do
    local tag = tag_of(member)
    if silent[tag] == nil then
      -- (No read while no process was marked within a patience.)
      silent[tag] = anyone_silent and still_silent(tonumber(redis.call('HGET', meta, 's:' .. tag)))
    end
    if not silent[tag] then
      return member
    end
    if passed >= 64 or not spend(1) then
      cut_off[rank] = true
      return nil
    end
    passed = passed + 1
    member = next_in_line()
  end
  return nil
end
-- The head of a class out of the line, with a provisional grant (unless its liveness entry
-- is gone), announced to its process; its tenant's next waiter joins the line.
local function admit(member, weight, lease, tenant)
  redis.call('ZREM', queue, member)
  local live = redis.call('ZREM', alive, member) == 1
  if tenant then
    left_line(member, tenant, 0)
  end
  if not live then
    return
  end
  local term = math.min(claim, math.max(math.floor(lease / 2), 1))
  local token, deadline = grant(member, weight, lease, term, true)
  granted[member] = token
  -- On the channel of the member's process only (its id starts with the process's tag).
  redis.call(publisher, channel .. ':' .. tag_of(member),
    string.format('%s %d %d', member, token, deadline))
end

-- Whether `member`, of `tenant` at `level`, comes after its tenant's head in its class (one
-- passed over for the tenant's cap, or in a class read only in part: the index tells): it
-- waits behind it rather than be granted past it.
local function behind_own_head(member, level, tenant)
  local r = rank_of(level)
  if tenant_capped[r .. tenant] then
    return true
  end
  if not cut_off[r] then
    return false
  end
  local head = head_of(tenant_line(member, tenant))
  return head ~= nil and redis.call('ZSCORE', queue, head) ~= false
end

-- The line served: whoever fits admitted, waiters gone dropped.
local function step_line()
  granted = {}
  firsts = redis.call('ZRANGE', queue, '0', HEAD_LAST)
  waiting = #firsts > 0 and 1 or 0
  -- (The scan below writes the last three, so only a call that scans makes them: NONE,
  -- classes.lua's shared empty table, serves the rest.)
  waits_in, tenant_capped, cut_off, holding_up = {}, NONE, NONE, NONE
  if waiting > 0 then
    tenant_capped, cut_off, holding_up = {}, {}, {}
    -- Waiters that stopped answering, once the earliest liveness deadline may have passed.
    if not alive_at or alive_at <= now then
      -- (The budget's worth a call: the earliest deadline left, passed already, brings the
      -- next call back for the rest.)
      local gone = redis.call('ZRANGEBYSCORE', alive, '-inf', now_text, 'LIMIT', '0', int(work))
      for _, member in ipairs(gone) do
        if not spend(1) then
          break
        end
        unqueue(member)
        redis.call('ZREM', alive, member)
      end
      -- Every later deadline is a call's now + its patience: at least this one's.
      alive_at = tonumber(redis.call('ZRANGE', alive, '0', '0', 'WITHSCORES')[2]) or now + patience
      changed = true
      if #gone > 0 then
        firsts = redis.call('ZRANGE', queue, '0', HEAD_LAST)
      end
    end
    -- Waiters gone that this call had no budget for: nobody is admitted until a later call
    -- (soon: `retry_in`) has them out, since one of them may stand first in line.
    local gone_left = alive_at <= now
    if gone_left then
      unfinished = true
      for r = 0, 7 do
        waits_in[r] = true
      end
    end
    silent = {}
    anyone_silent = still_silent(silent_at)
    rank, head, at, passed = nil, {}, 1, 0
    -- The class's heads passed over for their tenant's cap (a list, or nil). (A local of the
    -- scan, not of the file: the script form inlines every step into one function, which Lua
    -- allows 200 locals.)
    local capped
    rank = firsts[1] and place(firsts[1])
    -- The first class's members among the first few are its head's first read.
    for _, member in ipairs(firsts) do
      if place(member) == rank then
        table.insert(head, member)
      end
    end
    waiting = 0
    if gone_left then
      waiting, rank = 1, nil
    end
    while rank and rank <= 7 do
      while true do
        local member = oldest()
        local level = rank_of(rank)
        while member and (parse(member) > most(level, tenant_of(member)) or parse(member) < 1) do
          -- Heavier than its class (or tenant) may ever hold under the limit now in force: it
          -- would block the line for ever. Dropped, and told so on its process's channel (the
          -- member alone: not a grant, so its process checks its line at once, finds it unknown
          -- and asks again, to be refused), rather than at its next touch, up to a second on.
          -- (So is a member of no weight: no version writes one.)
          unqueue(member)
          redis.call(publisher, channel .. ':' .. tag_of(member), member)
          member = spend(1) and oldest()
          if member == false then
            -- The budget ran out with the rest of the class unread.
            cut_off[rank] = true
          end
        end
        if not member then
          break
        end
        local weight, lease = parse(member)
        local tenant = tenant_of(member)
        local fit = room(level, weight, tenant)
        if fit == 'tenant' then
          -- Its tenant holds all it may: passed over, as a silent process's waiters are.
          waiting = 1
          tenant_capped[rank .. tenant] = true
          capped = capped or {}
          table.insert(capped, member)
          if passed >= 64 or not spend(1) then
            cut_off[rank] = true
            break
          end
          passed = passed + 1
        elseif not admits(level, weight, tenant) or not settled(lease) then
          waiting = 1
          waits_in[rank] = true
          if tenant then
            holding_up[tenant] = true
          end
          if fit ~= 'capped' then
            blocked = blocked or rank
          end
          break
        elseif not spend(tenant and 4 or 2) then
          -- The rest are admitted by the next call, which `retry_in` brings soon; until then
          -- this class's newcomers queue behind them.
          waiting = 1
          waits_in[rank] = true
          blocked = blocked or rank
          break
        else
          admit(member, weight, lease, tenant)
        end
      end
      if capped and cut_off[rank] then
        -- Read only in part, past heads at their tenant's cap: they go to the back of the
        -- class, in their order, so the next call reads on past them. (Kept in place, more of
        -- them than a call reads would hide for as long as their tenants stay capped whoever
        -- waits behind them, room or not.) At most the 64 passed, and only where the line is
        -- that long: never in the model's configurations, and MemoryBackend reads it whole.
        local scored = {}
        for _, member in ipairs(capped) do
          table.insert(scored, int(rank * RANK + next_arrival()))
          table.insert(scored, member)
        end
        -- (One command for all: one a member costs 3-5 µs each.)
        redis.call('ZADD', queue, unpack(scored))
      end
      if blocked and not shares then
        -- Without shares nothing of a lower class fits where this one does not.
        break
      end
      local after = redis.call('ZRANGEBYSCORE', queue, int((rank + 1) * RANK), '+inf',
        'LIMIT', '0', '1')[1]
      -- (Past this class whatever its name says: a member another layout scored stands where
      -- its score puts it, and the loop ends within the eight classes.)
      rank = after and math.max(place(after), rank + 1)
      head, at, passed = {}, 1, 0
      capped = nil
    end
  end
  line_was_empty = waiting == 0
end -- step_line

-- The line's keys expire after the latest waiter's deadline (`line`, kept in meta), pushed half
-- a patience further each time, so most joins and touches need no PEXPIREAT; a line created by
-- this call always gets one.
local function wait(member)
  local deadline = now + patience
  redis.call('ZADD', alive, int(deadline), member)
  if alive_at and deadline < alive_at then
    alive_at = deadline
    changed = true
  end
  if line_was_empty or deadline > line then
    line_was_empty = false
    line = deadline + math.floor(patience / 2)
    redis.call('PEXPIREAT', queue, int(line))
    redis.call('PEXPIREAT', alive, int(line))
    if #firsts >= HEAD and redis.call('ZCARD', queue) >= 4 then
      widen(queue)
      widen(alive)
    end
    changed = true
  end
  if tenant_of(member) then
    -- The tenants' index lives as long as any tenant's waiter: each pushes it (a semaphore
    -- without tenants never touches it).
    redis.call('PEXPIREAT', tenants, int(math.max(line, deadline)))
  end
end

-- Time until the earliest lease ends or the promotion fence lets a grant through (at least
-- 1 ms), or the patience when neither is due. A provisional grant's end counts too: when its
-- process is frozen or dead it ends unclaimed while every live process waits for an
-- announcement, and only a call can give its slot on (a live process's release admits the
-- next waiter before that anyway, so this costs a touch per claim window at most).
local function retry_in()
  local until_due = due
  if fenced_until and (not until_due or fenced_until < until_due) then
    until_due = fenced_until
  end
  if unfinished then
    -- Work left for later calls (protocol.lua's BUDGET): the next comes soon.
    until_due = math.min(until_due or now + 10, now + 10)
  end
  if until_due then
    -- (Never later than a patience: a foreign deadline far ahead, or at +inf, until clamped.)
    return math.min(math.max(until_due - now, 1), patience)
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
    return HOLDS, token, left(deadline)
  end
  local tenant = tenant_of(member)
  local score = (waiting > 0 or tenant) and tonumber(redis.call('ZSCORE', queue, member))
  if score then
    wait(member)
    if score >= PARKED then
      heal(member, tenant, score)
    end
    return WAITS, 0, 0
  end
  return UNKNOWN, 0, 0
end
