-- The promotion fence after a failover.
-- Takes: `whole` (values.lua); `KEYS`, `promotion_fence`, `now`, `now_text` (args.lua);
-- `seen` (meta.lua).

-- A replica promoted to master (a failover) may lack grants the old master made (replication
-- is asynchronous), and the old master may go on granting to processes that have not heard of
-- the failover yet, for as long as the sentinels' word a client acts on may be old (the fence,
-- sent by the client). So for a lease and the fence after this server is first seen promoted,
-- nothing new is granted here: every grant made elsewhere before has ended by then. Holders
-- it knows of renew as usual.
local promoted, promoted_key
-- The earliest a grant held off by the fence may be made (ms), for the waiters' retry hint.
local fenced_until
-- Whether a grant of `lease` ms may be made now.
local function settled(lease)
  if not promoted then
    return true
  end
  local from = promoted + lease + promotion_fence
  if now >= from then
    return true
  end
  fenced_until = math.min(fenced_until or from, from)
  return false
end

-- Whether this server was promoted, and when it was first seen so.
local function step_fence()
  promoted, fenced_until = nil, nil
  promoted_key = promotion_fence > 0 and KEYS[#KEYS] or nil
  if promoted_key then
    local info = redis.call('INFO', 'replication')
    local previous = string.match(info, 'master_replid2:(%x+)')
    if previous and string.find(previous, '[^0]') then
      local id = string.match(info, 'master_replid:(%x+)')
      local seen = redis.call('HMGET', promoted_key, 'id', 'at')
      -- (A time not of this crate's form is written anew.)
      if seen[1] == id and whole(seen[2], 2 ^ 52) then
        promoted = whole(seen[2], 2 ^ 52)
      else
        promoted = now
        redis.call('HSET', promoted_key, 'id', id, 'at', now_text)
      end
    end
  end
end -- step_fence
