-- One distributed, first-come-first-served semaphore. Every operation is one call of this
-- script, so it runs atomically; times come from the Redis server clock, never a client's.
-- The script is this file and the eight after it, in order (classes, tenants, fence, sweep,
-- adapt, holders, line, ops; `semaphore.rs` joins them after `gcra.lua`); each part's locals
-- are the next parts' too.
--
-- KEYS[1] holders: zset, member -> lease deadline (ms); a provisional grant not claimed yet
--                  has its deadline + 0.5 (a score's fraction marks it at no extra command)
-- KEYS[2] meta:    hash, `state` = the counters as nine doubles (struct.pack '<d' x 9): the
--                  weight of the live holders (`used`), how many they are (`count`), the last
--                  fencing token (`fence`), when holders and meta expire (`horizon`, ms), when
--                  queue and alive expire (`line`, ms), the last arrival score given
--                  (`arrived`, so arrivals in one call or one microsecond keep their order),
--                  the server time of the latest call that wrote it (`seen`, ms), a time no
--                  waiter's liveness deadline is before (`alive_at`, ms) and when the latest
--                  process was marked silent (`silent_at`, ms), -1 for those not known;
--                  `limit` = the limit every process admits by, `pinned` = 1 when an operator
--                  set it (then meta never expires); otherwise the first process's configured
--                  limit, which goes with the other keys when the semaphore falls idle;
--                  `s:<process tag>`
--                  = when a provisional grant of that process ran out unclaimed (ms): the
--                  process is silent (frozen or dead), and its other waiters are passed over
--                  until it makes a call;
--                  `adaptive` = "<min>/<max>" when the limit adapts
--                  (set with the state by the process that creates it), and its state in
--                  `a:lim`, `a:noload`, `a:start`, `a:n`, `a:sum`, `a:peak`, `a:over`, and
--                  the probe's `a:pat`, `a:psave`, `a:pn`, `a:plow` (adapt.lua);
--                  `unpinned` = while pinned, the limit to return to when unpinned (the one
--                  in force before, else the first configured limit a process calls with);
--                  `classes` = the classes' shares, stored with the limit, and `c<level>` =
--                  the weight each class holds (classes.lua), `u:<tenant>` = the weight a
--                  tenant holds, while it holds some, under a per-tenant cap
--                  (classes.lua)
-- KEYS[3] queue:   zset, member -> its class's rank × 2^48 + its arrival (strictly increasing):
--                  who waits, by class (highest first), then oldest first; a tenant's
--                  parked waiters past every class, at 2^51 + that (tenants.lua)
-- KEYS[4] alive:   zset, member -> deadline (ms) by which a waiter must show it still waits
-- KEYS[5] since:   hash, holder -> when it was granted (ms), for snapshots
-- KEYS[6] procs:   zset, "<process tag> <process name>" -> when last told (ms), for snapshots;
--                  names not told for an hour are dropped; expires with holders
-- KEYS[7] tenants: zset of score 0, by lex: each tenant's head and parked waiters per class
--                  (tenants.lua); expires with the line
-- KEYS[8] (acquire only, optional) a rate limiter's key, decided with the acquires
-- KEYS[#KEYS] (with a promotion fence) promoted: hash, `id` = the replication id under which
--                  this server was first seen promoted from a replica, `at` = when (ms); one
--                  key for every semaphore of the server (used through Sentinel only)
-- A member is "<holder id>[:c<level>][:t<tenant>][:p]:<weight>:<lease ms>" (level 4, NORMAL,
-- without; the tenant in 16 hex digits; `:p` for a slot a process may keep in its prefetch
-- pool), the id's first 8 hex digits naming its process. All keys share one hash tag (one
-- Cluster slot). Holders and meta expire at most half a lease after the latest lease (and are
-- deleted when nothing is held past that horizon); queue and alive expire with the latest
-- waiter deadline.
--
-- ARGV: operation, channel (the base of each process's own), its publish command (PUBLISH, or
-- SPUBLISH on a cluster), the caller's limit (`<n>`, or `<initial>/<min>/<max>` adaptive,
-- then `|<shares>` when its classes have any),
-- patience ms, claim ms, promotion fence ms (0: none), the caller's process tag (followed by
-- a space and the process's name now and then, to be kept in procs), k, then k members to
-- release
-- (holders or waiters; absent ones are ignored; for an adaptive limit, `!` before one marks
-- its hold overloaded, then `@<µs>:` says how long its process held it; `@<µs>*<n>:` alone
-- is n such holds that ended without a release, in a prefetch pool), then the operation's
-- arguments:
--   acquire <rate> <period µs> <burst> (<member> <once|join|recheck> <cost>)...
--       -> per member, in order: {1, token, left µs, now µs, limit, anyone waits (0|1)[, rate
--          remaining, rate reset µs]} granted (the last two when the grant spent the rate)
--          | {2, retry ms, now µs, limit} queued | {0, retry ms, now µs, limit} full
--          | {4, retry µs, limit} refused by the rate limit (nothing added, nothing spent)
--          (`limit`: the limit in force); a member also released by this call is not added.
--          With KEYS[8] (a rate limiter's key, `gcra` of lua/gcra.lua) and rate > 0, a member
--          that would be granted at once is granted only if the rate allows its cost, spent
--          in the same call; one that queues spends nothing
--   release                      -> {how many of the k members held or waited, anyone waits
--                                    (0|1), retry ms (0 when nobody waits)}
--   touch <member>...            -> {retry ms, then per member: 1, token, left µs (holds; claimed)
--                                    | 2, 0, 0 (still queued) | 0, 0, 0 (unknown)}
--   renew <member>...            -> {now µs, anyone waits (0|1), then per member: µs left of
--                                   its new lease, or 0 if
--                                   it no longer holds (expired or removed: it is never added
--                                   back)}
--   used                         -> live weight
--   set_limit <n>                -> 1; every process admits by n from now on (pinned)
--   unset_limit                  -> 1; the pin is gone: the limit in force before it (or the
--                                   first configured one a process called with) is back,
--                                   and an adaptive limit adapts again
--   evict <id>                   -> 1 if the holder with that id was removed, else 0
--   snapshot                     -> {limit, used, waiting, now ms, pinned (0|1), waiting per
--                                    level ("<n0>,...,<n7>"), tenants' waiting
--                                    ("<tenant>:<n>,..."), the shares in force, then per
--                                    holder: member, deadline
--                                    ms, granted ms, process name ('' when not known)}
-- An acquire whose weight is above what its class may ever hold under the limit in force (the
-- limit, less the other classes' reservations, at most its cap) answers {3, that most}.
-- "left µs" is a deadline minus the server time of this call, exact to the µs: a client that
-- adds it to the moment it sent the call never believes a lease past the server's.
-- Whenever queued waiters fit they are admitted in arrival order, each with a provisional lease
-- of at most `claim` ms (and half its lease) that the waiter's process claims (touch or renew)
-- to get its full lease; each grant is published as "<member> <token> <deadline ms>" on
-- "<channel>:<the member's process>", which only that process subscribes to. "retry ms" is the
-- time until the earliest lease ends (or sooner, never later): when an expiry may admit
-- someone.
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
  if weight then
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
  known = {weight and weight + 0 or 0, lease and lease + 0 or 0, level, tenant, pool, tag}
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
local horizon_was, stored_limit, stored_pinned, stored_unpinned
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
  procs = KEYS[6]
  op, channel, publisher = ARGV[1], ARGV[2], ARGV[3]
  -- The caller's limit, then `|` and its classes' shares when it has any (most callers send
  -- a plain number: no pattern for it).
  limit = tonumber(ARGV[4])
  caller_shares, adapt_min, adapt_max = '', nil, nil
  if not limit then
    local limit_text, initial
    limit_text, caller_shares = string.match(ARGV[4], '^([^|]*)|?(.*)$')
    initial, adapt_min, adapt_max = string.match(limit_text, '^(%d+)/(%d+)/(%d+)$')
    limit = tonumber(initial or limit_text)
  end
  patience, claim = tonumber(ARGV[5]), tonumber(ARGV[6])
  promotion_fence = tonumber(ARGV[7])
  caller, caller_name = string.sub(ARGV[8], 1, 8), string.sub(ARGV[8], 10)
  args = 10 + tonumber(ARGV[9])
  if publisher ~= 'PUBLISH' and publisher ~= 'SPUBLISH' then
    return redis.error_reply('unknown publish command ' .. tostring(publisher))
  end
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
    'unpinned', 'classes', 'used')
  used, count, fence, horizon, line, arrived, seen, alive_at, silent_at = nil, nil, nil, nil,
    nil, nil, nil, nil, nil
  if stored[1] and #stored[1] == 72 then
    used, count, fence, horizon, line, arrived, seen, alive_at, silent_at =
      struct.unpack(STATE, stored[1])
  end
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
  stored_limit, stored_pinned = tonumber(stored[2]), stored[3]
  changed = false
  stored_shares = stored[7] or nil
  shares = nil
  pinned = stored_pinned == '1'
  -- (A missing field reads as false.)
  adaptive = stored[5] or nil
  local configured = limit
  unpinned = tonumber(stored[6])
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
