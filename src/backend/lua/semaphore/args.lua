-- The call: its keys and arguments (`step_args`), the server's time, and the call's work
-- budget (`spend`), with the time left of a deadline (`left`).
-- Takes: `PROTOCOL`, `MAX_RELEASES`, `MAX_MEMBERS`, `BUDGET` (protocol.lua); `int`
-- (values.lua).
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


local function left(deadline)
  return deadline * 1000 - now_us
end

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
