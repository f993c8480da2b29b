
-- scripts/s1-floor appends this to a copy of ops.lua (never to the crate's own): a measuring
-- fixture, not a semaphore. It answers S1's one kind of call (a plain semaphore's release of
-- a holder riding on the next acquire) with the least work this protocol allows, to see what
-- the cheapest such call costs a real S1 run; anything else goes to the crate's `run`. It
-- keeps no grant times, tells no names, checks no counters, and with FLOOR (nine commands:
-- TIME, HMGET, ZREM, ZRANGE, ZREM, ZADD, PUBLISH, ZADD, HSET) neither reads the earliest
-- lease nor keeps the waiters' liveness, so the crate's own calls may drop waiters: a bound,
-- not an alternative.
local FLOOR = false
local crate_run = run
run = function(keys, argv)
  if argv[1] ~= 'acquire' or argv[7] ~= '0' or #argv[8] ~= 8 or not tonumber(argv[4]) then
    return crate_run(keys, argv)
  end
  local a = 10 + tonumber(argv[9])
  if argv[a] ~= '0' then
    return crate_run(keys, argv)
  end
  for i = 10, a - 1 do
    local b = string.byte(argv[i], 1)
    if b == 33 or b == 64 then
      return crate_run(keys, argv)
    end
  end
  for i = a + 3, #argv - 2, 3 do
    if not string.match(argv[i], '^%x+:%d+:%d+$') then
      return crate_run(keys, argv)
    end
  end
  local h, m, q, live = keys[1], keys[2], keys[3], keys[4]
  local st = redis.call('HMGET', m, 'state', 'limit', 's:' .. argv[8], 'classes', 'pinned',
    'used', 'adaptive')
  if not st[1] or #st[1] ~= 72 or not st[2] or st[3] or st[4] or st[5] == '1' or st[6]
      or st[7] then
    return crate_run(keys, argv)
  end
  local time = redis.call('TIME')
  local n_us = time[1] * 1000000 + time[2]
  local n = math.floor(n_us / 1000)
  local pat, clm = argv[5] + 0, argv[6] + 0
  local u, c, f, hz, ln, arr, sn, al, sl = struct.unpack(STATE, st[1])
  if al == -1 or al <= n or sn > n or (sl ~= -1 and n - sl < pat)
      or math.floor(n / 1000) ~= math.floor(sn / 1000) or ln > n + pat + math.floor(pat / 2) then
    return crate_run(keys, argv)
  end
  local dd
  if not FLOOR then
    local earliest = redis.call('ZRANGE', h, '0', '0', 'WITHSCORES')
    local first = earliest[2] and earliest[2] + 0
    if (first and first <= n + 0.5) or (c > 0) ~= (first ~= nil) then
      return crate_run(keys, argv)
    end
    dd = first and math.floor(first)
  end
  local lim = st[2] + 0
  local function cover(lease)
    if n + lease > hz then
      hz = n + lease + math.floor(lease / 2)
      redis.call('PEXPIREAT', h, int(hz))
      redis.call('PEXPIREAT', m, int(hz))
    end
  end
  for i = 10, a - 1 do
    local member = argv[i]
    if redis.call('ZREM', h, member) == 1 then
      u, c = u - parse(member), c - 1
    elseif redis.call('ZREM', q, member) == 1 then
      redis.call('ZREM', live, member)
    end
  end
  local firsts, at = redis.call('ZRANGE', q, '0', '1'), 1
  while firsts[at] and u < lim do
    local member = firsts[at]
    local w, lease = parse(member)
    if u + w > lim then
      break
    end
    redis.call('ZREM', q, member)
    if not FLOOR then
      redis.call('ZREM', live, member)
    end
    local deadline = n + math.min(clm, math.max(math.floor(lease / 2), 1), lease)
    dd = math.min(dd or deadline, deadline)
    redis.call('ZADD', h, int(deadline) .. '.5', member)
    u, c, f = u + w, c + 1, math.max(f + 1, n_us)
    cover(lease)
    redis.call(argv[3], argv[2] .. ':' .. string.sub(member, 1, 8),
      string.format('%s %d %d', member, f, deadline))
    at = at + 1
    if at > #firsts and u < lim then
      firsts, at = redis.call('ZRANGE', q, '0', '1'), 1
    end
  end
  local waits = firsts[at] ~= nil
  local answers = {}
  for i = a + 3, #argv - 2, 3 do
    local member, mode = argv[i], argv[i + 1]
    local w, lease = parse(member)
    if w > lim then
      table.insert(answers, {3, lim})
    elseif not waits and u + w <= lim then
      local deadline = n + lease
      dd = math.min(dd or deadline, deadline)
      redis.call('ZADD', h, int(deadline), member)
      u, c, f = u + w, c + 1, math.max(f + 1, n_us)
      cover(lease)
      table.insert(answers, {1, f, deadline * 1000 - n_us, n_us, lim, 0})
    elseif mode ~= 'once' then
      arr = math.max((n - 1767225600000) * 16, arr + 1)
      redis.call('ZADD', q, int(3 * RANK + arr), member)
      local deadline = n + pat
      if not FLOOR then
        redis.call('ZADD', live, int(deadline), member)
      end
      al = math.min(al, deadline)
      if deadline > ln then
        ln = deadline + math.floor(pat / 2)
        redis.call('PEXPIREAT', q, int(ln))
        redis.call('PEXPIREAT', live, int(ln))
      end
      waits = true
      table.insert(answers, {2, 0, n_us, lim})
    else
      table.insert(answers, {0, 0, n_us, lim})
    end
  end
  local retry = dd and math.max(dd - n, 1) or pat
  for _, answer in ipairs(answers) do
    if answer[1] == 0 or answer[1] == 2 then
      answer[2] = retry
    elseif answer[1] == 1 then
      answer[6] = waits and 1 or 0
    end
  end
  redis.call('HSET', m, 'state', struct.pack(STATE, math.max(u, 0), c, f, hz, ln, arr, n, al, sl))
  return answers
end
