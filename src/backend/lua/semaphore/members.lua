-- What a member says of itself, read from its text and kept across calls (`facts`, `learn`,
-- `parse`, `prefetched`, `tag_of`), and the marks a release puts before it (`released_member`).
-- Takes nothing: only what its own text says.

-- What a member says of itself: {weight, lease, class level (4 without `:c`), tenant (nil
-- without `:t`), prefetched (`:p`), its process's tag (its first 8 characters)}. A malformed
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
-- process without a release (their slots stayed in its prefetch).
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

-- Whether a member's slot may be kept on hand by its process's prefetch (`:p`, after the id).
local function prefetched(member)
  return (facts[member] or learn(member))[5]
end

-- The tag of a member's process (the first 8 hex digits of its id).
local function tag_of(member)
  return (facts[member] or learn(member))[6]
end
