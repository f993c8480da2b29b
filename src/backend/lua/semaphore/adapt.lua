-- The adaptive limit, moved by the hold times of the holders
-- released here (src/adaptive.rs has the same steps, their reasons and their tests). Only
-- explicit releases are samples: a holder whose lease ran out (a crash) says nothing of the
-- downstream's latency. A pinned limit (set_limit) does not adapt.
-- Takes: `finite`, `int` (values.lua); `meta`, `limit`, `now` (args.lua); `changed`,
-- `pinned`, `adaptive` (meta.lua).

-- The state, read from meta at the first sample of the call and written back with meta.
local gradient

-- `n` releases (n holds that ended in a prefetch; else 1): held `held_ms` each (a mean),
-- with `in_flight` held just before, overloaded or not.
local function sample(held_ms, in_flight, overloaded, n)
  if not adaptive or pinned then
    return
  end
  -- (Locals here, not above: a constant captured by a function costs each call of the script
  -- an upvalue, about a thousand instructions, adaptive or not.)
  local WINDOW_MS, MIN_SAMPLES = 100, 10
  local SMOOTHING, TOLERANCE, DRIFT, BACKOFF = 0.5, 1.05, 0.001, 0.9
  -- The probe: every PROBE_EVERY ms the limit is lowered to PROBE_SHARE of itself for
  -- PROBE_WINDOWS windows (the first not measured), and the lowest of their means is the
  -- no-load latency again, raised by at most PROBE_RAISE at a time.
  local PROBE_EVERY, PROBE_SHARE, PROBE_WINDOWS, PROBE_RAISE = 30000, 0.5, 3, 1.25
  local g = gradient
  if not g then
    local low, high = string.match(adaptive, '^(%d+)/(%d+)$')
    local a = redis.call('HMGET', meta, 'a:lim', 'a:noload', 'a:start', 'a:n', 'a:sum', 'a:peak',
      'a:over', 'a:pat', 'a:psave', 'a:pn', 'a:plow')
    -- (Foreign values, not finite, read as not set.)
    g = {low = tonumber(low) or 1, high = tonumber(high) or limit, lim = finite(a[1]) or limit,
      noload = finite(a[2]), start = finite(a[3]), n = finite(a[4]) or 0,
      sum = finite(a[5]) or 0, peak = finite(a[6]) or 0, over = a[7] == '1',
      probe_at = finite(a[8]), saved = finite(a[9]), probed = finite(a[10]) or 0,
      lowest = finite(a[11])}
    g.lim = math.min(math.max(g.lim, g.low), g.high)
    gradient = g
  end
  g.start = g.start or now
  g.n = g.n + n
  g.sum = g.sum + math.max(held_ms, 0) * n
  g.peak = math.max(g.peak, in_flight)
  g.over = g.over or overloaded
  if now - g.start < WINDOW_MS or g.n < MIN_SAMPLES then
    return
  end
  local latency, over, peak = math.max(g.sum / g.n, 0.001), g.over, g.peak
  g.start, g.n, g.sum, g.peak, g.over = nil, 0, 0, 0, false
  changed = true
  if g.saved then
    g.probed = g.probed + 1
    if g.probed > 1 then
      g.lowest = math.min(g.lowest or latency, latency)
    end
    if g.probed >= PROBE_WINDOWS then
      g.noload = math.min(g.lowest, (g.noload or g.lowest) * PROBE_RAISE)
      g.lim, g.saved, g.probed, g.lowest = g.saved, nil, 0, nil
      g.probe_at = now + PROBE_EVERY
      limit = math.floor(g.lim + 0.5)
    end
    return
  end
  if g.noload and latency > g.noload then
    g.noload = g.noload + (latency - g.noload) * DRIFT
  else
    g.noload = latency
  end
  local target
  if over then
    target = g.lim * BACKOFF
  else
    local slope = math.min(math.max(TOLERANCE * g.noload / latency, 0.5), 1)
    local headroom = math.sqrt(g.lim)
    if slope < 1 then
      headroom = headroom / 3
    end
    target = g.lim * slope + headroom
    if peak < g.lim / 2 then
      target = math.min(target, g.lim)
    end
  end
  local busy = peak >= g.lim / 2
  g.lim = math.min(math.max(g.lim * (1 - SMOOTHING) + target * SMOOTHING, g.low), g.high)
  g.probe_at = g.probe_at or now + PROBE_EVERY
  -- Only a busy limit is probed (under half of it in flight, nothing queues).
  if now >= g.probe_at and busy then
    g.saved, g.probed, g.lowest = g.lim, 0, nil
    g.lim = math.max(g.lim * PROBE_SHARE, g.low)
  end
  limit = math.floor(g.lim + 0.5)
end

-- The state's fields, to write with meta.
local function gradient_fields(fields)
  local g = gradient
  if not g then
    return
  end
  local function real(x)
    return x and string.format('%.6f', x) or ''
  end
  for _, field in ipairs({{'a:lim', real(g.lim)}, {'a:noload', real(g.noload)},
      {'a:start', g.start and int(g.start) or ''}, {'a:n', int(g.n)}, {'a:sum', real(g.sum)},
      {'a:peak', int(g.peak)}, {'a:over', g.over and '1' or '0'},
      {'a:pat', g.probe_at and int(g.probe_at) or ''}, {'a:psave', real(g.saved)},
      {'a:pn', int(g.probed)}, {'a:plow', real(g.lowest)}}) do
    table.insert(fields, field[1])
    table.insert(fields, field[2])
  end
end

local function step_adapt()
  gradient = nil
end -- step_adapt
