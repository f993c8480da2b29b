-- One rate check: `gcra` (lua/gcra.lua, prepended to this file) on the server's clock.
--
-- KEYS[1]  the limiter's key
-- ARGV     rate, period (µs), burst, cost
-- returns  {allowed 0|1, remaining, retry after µs (-1 when allowed), reset after µs}
if redis.replicate_commands then redis.replicate_commands() end

local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local allowed, remaining, retry_us, reset_us = gcra(KEYS[1], tonumber(ARGV[1]),
  tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), now)
return {allowed and 1 or 0, remaining, retry_us, reset_us}
