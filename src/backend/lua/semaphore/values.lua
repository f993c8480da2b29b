-- Stored values and numbers written out: what a stored number is trusted as (`whole`,
-- `exact`, `finite`: every stored value is checked before it is trusted), every integer sent
-- to Redis (`int`), and keys moved out of the compact encoding (`widen`). Takes nothing.

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
