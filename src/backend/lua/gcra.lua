-- One GCRA rate check, all or nothing (see gcra.rs, whose `Gcra::decide` runs the same steps),
-- shared by the rate script and the semaphore's combined acquire. Every number stays an integer
-- below 2^53, so Lua's doubles are exact: a TAT is whole microseconds plus a remainder in
-- 1/rate µs, and every comparison is made relative to now.
--
-- key: "<us> <rem>", expiring when the limiter would be full again; now: the server's µs.
-- Returns allowed (bool), remaining, retry after µs (-1 when allowed), reset after µs; spends
-- `n` (stores the new TAT) only when allowed.

-- floor(a / b), exact for 0 <= a < 2^53 and b > 0 whatever the division rounded to.
local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

local function gcra(key, rate, period, burst, n, now)
  -- A TAT in the past is now: the limiter is full.
  local base_us, base_rem = now, 0
  local stored = redis.call('GET', key)
  if stored then
    local us, rem = string.match(stored, '^(%d+) (%d+)$')
    us, rem = tonumber(us), tonumber(rem)
    if us and rem and us >= now then
      base_us, base_rem = us, rem
    end
  end

  -- new = base + n·T, with T = period / rate = t_us + t_rem / rate.
  local t_us = idiv(period, rate)
  local t_rem = period - t_us * rate
  local rem = base_rem + n * t_rem
  local carry = idiv(rem, rate)
  local new_us = base_us + n * t_us + carry
  local new_rem = rem - carry * rate

  -- In 1/rate µs, relative to now.
  local tolerance = burst * period
  local new_ahead = (new_us - now) * rate + new_rem
  local allowed = new_ahead <= tolerance
  local ahead = (base_us - now) * rate + base_rem
  if allowed then ahead = new_ahead end

  local slack = tolerance - ahead
  if slack < 0 then slack = 0 end
  local remaining = idiv(slack, period)
  if remaining > 4294967295 then remaining = 4294967295 end
  local reset_us = idiv(ahead + rate - 1, rate)
  local retry_us = -1
  if allowed then
    -- Expires when the limiter is full again: nothing is left behind.
    local ttl_ms = idiv(reset_us + 999, 1000)
    if ttl_ms < 1 then ttl_ms = 1 end
    redis.call('SET', key, string.format('%d %d', new_us, new_rem), 'PX', string.format('%d', ttl_ms))
  else
    retry_us = idiv(new_ahead - tolerance + rate - 1, rate)
  end
  return allowed, remaining, retry_us, reset_us
end
