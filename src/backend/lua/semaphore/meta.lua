-- Meta's decoding: the counters in `state`, the fields beside them, and the limit in force
-- (`step_meta`); a semaphore kept by a newer protocol is refused here, before any write.
-- Takes: `PROTOCOL` (protocol.lua); `whole`, `exact` (values.lua); `ARGV`, `meta`, `op`,
-- `limit`, `adapt_min`, `adapt_max`, `caller`, `args` (args.lua).

-- The counters every call reads and most calls write are one field, `state`, nine doubles
-- (struct.pack: read and written without a number's parse or formatting); the rest are
-- fields of their own, written only when they change.
local STATE = '<ddddddddd'
local stored
local used, count, fence, horizon, line, arrived
-- The server time of the latest call that set a deadline (ms): each holder's deadline lies
-- within its lease of it, so only a clock behind it can leave one further ahead (sweep.lua).
local seen
-- No waiter's liveness deadline is before this (ms; nil when not known): waiters that stopped
-- answering are looked for once it has passed (line.lua).
local alive_at
-- When a process was last marked silent (ms): a patience later no mark is in force (sweep.lua).
local silent_at
-- What `state` said of the horizon when this call began (the write-back renews the keys'
-- expiry when it moved), and the fields read beside it.
local horizon_was, stored_limit, stored_pinned, stored_unpinned, stored_version
local changed
-- The classes' shares in force (classes.lua): as stored with the limit, and as decided.
local stored_shares, shares
-- One limit for every process: the one stored with the semaphore, else this caller's, stored
-- for the others to adopt; `pinned` by an operator, with the limit to return to.
local pinned, unpinned
-- Whether the limit adapts ("<min>/<max>"), decided with the limit by whoever stores it.
local adaptive

-- The semaphore's state as stored, and the limit in force.
local function step_meta()
  stored = redis.call('HMGET', meta, 'state', 'limit', 'pinned', 's:' .. caller, 'adaptive',
    'unpinned', 'classes', 'used', 'v', 'scan')
  -- Kept by a newer protocol: refused before anything is written.
  local version = whole(stored[9], 2 ^ 31)
  if version and version > PROTOCOL then
    return redis.error_reply(string.format('dlimit: protocol %d keeps %s, and this build speaks '
      .. 'protocol %d (and 1): upgrade this process; nothing was written', version, meta,
      PROTOCOL))
  end
  used, count, fence, horizon, line, arrived, seen, alive_at, silent_at = nil, nil, nil, nil,
    nil, nil, nil, nil, nil
  if stored[1] and #stored[1] == 72 then
    -- Foreign bytes may unpack to anything: every value `exact`, the counts whole and not
    -- negative, else the counters are rebuilt (sweep.lua). (Nine locals, not a table: no
    -- allocation on every call for the collector to reclaim.)
    local u, c, f, h, l, a, s, at, si = struct.unpack(STATE, stored[1])
    if exact(u) and exact(c) and exact(f) and exact(h) and exact(l) and exact(a) and exact(s)
        and exact(at) and exact(si) and u >= 0 and c >= 0 and u % 1 == 0 and c % 1 == 0
        and f >= 0 then
      used, count, fence, horizon, line, arrived, seen, alive_at, silent_at =
        u, c, f, h, l, a, s, at, si
    end
  end
  stored_version = stored[9]
  if stored[8] then
    -- Fields of an earlier version's counters (`used`, `count`, ...): a process of that
    -- version shares the semaphore. Its counters and this one's are rebuilt from the holders
    -- (sweep.lua) each time the other wrote, so the limit holds through a rolling upgrade;
    -- the old fields go.
    local token = tonumber(redis.call('HGET', meta, 'fence'))
    redis.call('HDEL', meta, 'used', 'count', 'fence', 'horizon', 'line', 'arrived', 'seen',
      'alive_at', 'silent_at')
    used, fence = nil, math.max(fence or 0, token or 0)
  end
  horizon_was = horizon
  fence, horizon, line, arrived = fence or 0, horizon or 0, line or 0, arrived or 0
  -- (-1 when not known.)
  seen = seen ~= -1 and seen or nil
  alive_at = alive_at ~= -1 and alive_at or nil
  silent_at = silent_at ~= -1 and silent_at or nil
  stored_limit, stored_pinned = whole(stored[2], 2 ^ 32 - 1), stored[3]
  changed = false
  stored_shares = stored[7] or nil
  shares = nil
  pinned = stored_pinned == '1'
  -- (A missing field reads as false.)
  adaptive = stored[5] or nil
  local configured = limit
  unpinned = whole(stored[6], 2 ^ 32 - 1)
  stored_unpinned = unpinned
  if stored_limit then
    limit = stored_limit
  else
    changed = true
    adaptive = adapt_min and (adapt_min .. '/' .. adapt_max) or nil
  end
  if op == 'set_limit' then
    -- The limit to return to: the one in force, unless it is a pin, or the caller's own (an
    -- operator's tool pinning a semaphore nobody uses has no limit of its own to give).
    if not pinned and stored_limit then
      unpinned = limit
    end
    limit = tonumber(ARGV[args])
    pinned = true
    changed = true
  elseif op == 'unset_limit' then
    if pinned then
      limit = unpinned or limit
      unpinned = nil
      pinned = false
      changed = true
    end
  elseif pinned and not unpinned and op ~= 'snapshot' and op ~= 'evict' then
    -- Pinned before any process used it: the first process's configured limit is the one to
    -- return to.
    unpinned = configured
    changed = true
  end
end -- step_meta
