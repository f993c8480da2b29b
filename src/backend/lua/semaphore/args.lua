-- One distributed, first-come-first-served semaphore. Every operation is one call of this
-- script, so it runs atomically; times come from the Redis server clock, never a client's.
-- The script is protocol.lua, this file and the eight after it, in order (classes, tenants,
-- fence, sweep, adapt, holders, line, ops; `semaphore.rs` joins them after `gcra.lua`); each
-- part's locals are the next parts' too. docs/protocol.md states every key, field, member,
-- argument and reply, and the protocol's version.
--
-- Every call's work is bounded whatever is stored: it carries at most MAX_RELEASES releases
-- and MAX_MEMBERS other members (protocol.lua), and every loop over stored data spends the
-- call's BUDGET (`spend`): what is left over is left to later calls, told to come soon.
--
-- Loaded as a function library (FUNCTION LOAD) where the server allows it, its definitions are
-- made once per server, and `run` (ops.lua) is each call; else it goes as a script, each
-- `step_*` body inlined where it stands (script.rs). Every part declares its per-call state at
-- its top and sets all of it in its `step_*` function, so no call sees another's. Two things
-- outlive a call, neither of them state: what members say of themselves (`facts`, each entry
-- a function of the member's text alone, bounded) and one empty table calls without shares
-- only read (`NONE`, classes.lua).
local KEYS, ARGV
local holders, meta, queue, alive, since, procs
local op, channel, publisher
-- The caller's limit and its classes' shares (classes.lua), and whether it adapts.
local limit, caller_shares, adapt_min, adapt_max
local patience, claim, promotion_fence
local caller, caller_name
-- Where the operation's own arguments start, after the k members to release.
local args
local now_us, now, now_text
-- The call's keys beside the first six: the tenants' index (tenants.lua) and the processes'
-- protocol versions (`versions`, set with their names: sweep.lua).
local versions

-- What is left of this call's BUDGET, and whether a loop found more to do than it allowed:
-- then the callers are told to come back soon (`retry_in`, line.lua), and a later call goes on.
local work, unfinished
local function spend(units)
  if work < units then
    unfinished = true
    return false
  end
  work = work - units
  return true
end

-- A stored count as this version writes it (decimal digits, 1 to `high`), else nil: foreign
-- text (a number of another form, negative, fractional, huge, `inf`, `nan`) is not trusted.
local function whole(text, high)
  if type(text) ~= 'string' or #text > 15 or not string.find(text, '^%d+$') then
    return nil
  end
  local n = tonumber(text)
  if n < 1 or n > high then
    return nil
  end
  return n
end

-- Whether `x` is a number this crate could have written: not NaN, within 2^53 either way
-- (so exact in a double; infinities are not).
local function exact(x)
  return x == x and x > -2 ^ 53 and x < 2 ^ 53
end

-- A stored number of any form, if `exact` (else nil: `inf`, `nan`, huge, not a number).
local function finite(text)
  local x = tonumber(text)
  if x and exact(x) then
    return x
  end
  return nil
end

-- Lua numbers are doubles: every integer sent to Redis is written here, as `%d` (`tostring`
-- would write 1.7e+15, and a number passed to redis.call as it is goes through %.17g, which
-- costs twice as much).
local function int(n)
  return string.format('%d', n)
end
-- Keys of more than a few members are kept in Redis's general encodings (skiplist, hashtable):
-- the compact one (a listpack, up to 128 members by default) scans its entries on every
-- lookup, parsing a zset's scores on the way, where the others find a member by its hash. A
-- member longer than 64 bytes converts a key for good (Redis does not convert back on
-- removal), so one goes in and out: holders and since when four hold, the line when its
-- expiry is pushed while four wait. (Meta converts with its first write: `state` is 72 bytes.)
local function widen(key, hash)
  local encoding = redis.pcall('OBJECT', 'ENCODING', key)
  if type(encoding) ~= 'string' or encoding == 'skiplist' or encoding == 'hashtable' then
    -- Converted already, or OBJECT refused to this user by an ACL: only the speed-up is lost.
    return
  end
  local long = string.rep('~', 65)
  if hash then
    redis.call('HSET', key, long, '')
    redis.call('HDEL', key, long)
  else
    redis.call('ZADD', key, '0', long)
    redis.call('ZREM', key, long)
  end
end

-- What a member says of itself: {weight, lease, class level (4 without `:c`), tenant (nil
-- without `:t`), pooled (`:p`), its process's tag (its first 8 characters)}. A malformed
-- member weighs 0. Patterns cost more than the rest of most steps, and a member meets several
-- calls (it joins, heads the line, is admitted, is released): what each member says is kept
-- across calls (it depends on its text alone), and forgotten wholesale once 1 000 are kept, so
-- the memory stays bounded whatever members are sent. (Sent as a script, each call starts with
-- none.) `learn` reads a member not kept yet; the readers below look in `facts` first, so a
-- member known already costs one lookup and no call (a contended call asks about 25 times).
local facts, facts_kept = {}, 0
local function learn(member)
  local known
  if facts_kept >= 1000 then
    facts, facts_kept = {}, 0
  end
  facts_kept = facts_kept + 1
  local tag = string.sub(member, 1, 8)
  local at = string.find(member, ':', 1, true) or #member + 1
  -- (Most members are plain, `<id>:<weight>:<lease>`: one match says so.)
  local weight, lease = string.match(member, '^:(%d+):(%d+)$', at)
  if weight and #weight < 10 and #lease < 13 then
    known = {weight + 0, lease + 0, 4, nil, false, tag}
    facts[member] = known
    return known
  end
  local level, tenant, pool = 4, nil, false
  local colon, kind, digit = string.byte(member, at, at + 2)
  if colon == 58 and kind == 99 and digit and digit >= 48 and digit <= 55
      and string.byte(member, at + 3) == 58 then
    level, at = digit - 48, at + 3
    colon, kind = string.byte(member, at, at + 1)
  end
  if colon == 58 and kind == 116 then
    local stop = string.find(member, ':', at + 2, true)
    if stop then
      tenant, at = string.sub(member, at + 2, stop - 1), stop
      colon, kind = string.byte(member, at, at + 1)
    end
  end
  if colon == 58 and kind == 112 and string.byte(member, at + 2) == 58 then
    pool, at = true, at + 2
  end
  weight, lease = string.match(member, '^:(%d+):(%d+)$', at)
  -- (Digits, or nil: arithmetic reads them with one parse where `tonumber` takes two.)
  weight, lease = weight and weight + 0 or 0, lease and lease + 0 or 0
  if weight > 2 ^ 32 - 1 or lease > 2 ^ 32 - 1 then
    -- Beyond any this crate sends: malformed.
    weight, lease = 0, 0
  end
  known = {weight, lease, level, tenant, pool, tag}
  facts[member] = known
  return known
end

local function parse(member)
  local known = facts[member] or learn(member)
  return known[1], known[2]
end

-- A member to release, whether its hold was marked overloaded (`!` before it), how long its
-- process held it (ms, from `@<µs>:` before it; nil when not told), and how many holds that
-- was: `@<µs>*<n>:` with no member after it is n holds of that mean that ended in their
-- process without a release (their slots stayed in its prefetch pool).
local function released_member(text)
  local overloaded = string.byte(text, 1) == 33
  if overloaded then
    text = string.sub(text, 2)
  end
  local held, n, member
  if string.byte(text, 1) == 64 then
    held, n, member = string.match(text, '^@(%d+)%*?(%d*):(.*)$')
  end
  if held then
    return member, overloaded, tonumber(held) / 1000, tonumber(n) or 1
  end
  return text, overloaded, nil, 1
end

-- Whether a member's slot may sit idle in its process's prefetch pool (`:p`, after the id).
local function pooled(member)
  return (facts[member] or learn(member))[5]
end

-- The tag of a member's process (the first 8 hex digits of its id).
local function tag_of(member)
  return (facts[member] or learn(member))[6]
end

local function left(deadline)
  return deadline * 1000 - now_us
end

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

-- The call's arguments and the server's time; an error reply for arguments no version of
-- this crate sends.
local function step_args()
  holders, meta, queue, alive, since = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
  procs, versions = KEYS[6], KEYS[8]
  op, channel, publisher = ARGV[1], ARGV[2], ARGV[3]
  -- The caller's limit, then `|` and its classes' shares when it has any (most callers send
  -- a plain number: no pattern for it).
  limit = tonumber(ARGV[4])
  caller_shares, adapt_min, adapt_max = '', nil, nil
  if not limit then
    local limit_text, initial
    limit_text, caller_shares = string.match(ARGV[4] or '', '^([^|]*)|?(.*)$')
    initial, adapt_min, adapt_max = string.match(limit_text, '^(%d+)/(%d+)/(%d+)$')
    limit = tonumber(initial or limit_text)
  end
  patience, claim = tonumber(ARGV[5]), tonumber(ARGV[6])
  promotion_fence = tonumber(ARGV[7])
  caller, caller_name = string.sub(ARGV[8] or '', 1, 8), string.sub(ARGV[8] or '', 10)
  local k = tonumber(ARGV[9])
  if publisher ~= 'PUBLISH' and publisher ~= 'SPUBLISH' then
    return redis.error_reply('unknown publish command ' .. tostring(publisher))
  end
  if not (limit and patience and claim and promotion_fence and k) or #KEYS < 8 then
    return redis.error_reply('dlimit: malformed call of protocol ' .. PROTOCOL)
  end
  args = 10 + k
  -- The members beside the releases: an acquire's go in threes after its rate's three.
  local members = op == 'acquire' and (#ARGV - args - 2) / 3 or #ARGV - args + 1
  if k > MAX_RELEASES or members > MAX_MEMBERS then
    return redis.error_reply(string.format('dlimit: a call carries at most %d releases and %d '
      .. 'members (this one %d and %d)', MAX_RELEASES, MAX_MEMBERS, k, members))
  end
  work, unfinished = BUDGET, false
  local time = redis.call('TIME')
  -- (Digits from the server: arithmetic reads each with one parse, `tonumber` takes two.)
  now_us = time[1] * 1000000 + time[2]
  now = math.floor(now_us / 1000)
  -- (Written once: several commands of a call carry it.)
  now_text = int(now)
end -- step_args

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
