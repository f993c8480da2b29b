-- One distributed, first-come-first-served semaphore. Every operation is one call of this
-- library, so it runs atomically; times come from the Redis server clock, never a client's.
-- The library is `gcra.lua` then the files of this directory, each after every file it takes
-- names from (`semaphore.rs` joins them: protocol, values, args, members, meta, classes,
-- tenants, fence, sweep, adapt, holders, line, ops); each file's locals are the later files'
-- too, and each starts by saying its role and what it takes from which earlier file.
-- docs/protocol.md states every key, field, member, argument and reply, and the protocol's
-- version.
--
-- Every call's work is bounded whatever is stored: it carries at most MAX_RELEASES releases
-- and MAX_MEMBERS other members (below), and every loop over stored data spends the call's
-- BUDGET (`spend`, args.lua): what is left over is left to later calls, told to come soon.
--
-- Loaded as a function library (FUNCTION LOAD) where the server allows it, its definitions are
-- made once per server, and `run` (ops.lua) is each call; else it goes as a script, each
-- `step_*` body inlined where it stands (script.rs). Every file declares its per-call state at
-- its top and sets all of it in its `step_*` function, so no call sees another's. Two things
-- outlive a call, neither of them state: what members say of themselves (`facts`,
-- members.lua, each entry a function of the member's text alone, bounded) and one empty
-- table calls without shares only read (`NONE`, classes.lua).

-- This file: the protocol's numbers (docs/protocol.md): its version, the codes its replies
-- carry, and the bounds of one call. src/backend/redis/protocol.rs names the same numbers, and
-- a test checks that the two agree; nothing else writes them as literals. Takes nothing.

-- The version of the keys' layout this build speaks: stored in meta (`v`) with the state. A
-- semaphore stored by a newer version is refused, with nothing written; version 1 (the layout
-- before the version was stored, which lacks `v`) is the same layout and is served beside this.
local PROTOCOL = 2
local PROTOCOL_TEXT = '2'

-- An acquire's answer for each member: granted, queued, full (not queued), heavier than its
-- class may ever hold, refused by the rate limit. A touch's status for each member: holds,
-- waits, unknown.
local FULL, GRANTED, QUEUED, TOO_HEAVY, RATE_LIMITED = 0, 1, 2, 3, 4
local UNKNOWN, HOLDS, WAITS = 0, 1, 2

-- The most members one call carries to release, and the most it acquires, touches or renews: a
-- process splits a longer list across calls.
local MAX_RELEASES, MAX_MEMBERS = 32, 16
-- The most a call does of the work stored data sets (members dropped, admitted, passed over,
-- promoted, clamped, read to rebuild the counters): the rest is left to later calls, which
-- are told to come soon (`retry_in`). No stored data can lift it.
local BUDGET = 32
-- The most holders a call reads to count their weight; with more, the weight held is taken as
-- UNCOUNTED (above any limit) until they are fewer. And the fields meta holds at most beside
-- twice the limit (each class's and tenant's count, the adaptive state, silence marks) before
-- it is made anew with only this version's.
local MAX_COUNTED, UNCOUNTED, META_FIELDS = 256, 2 ^ 40, 64
-- The most holders, processes and tenant entries an operator's snapshot lists.
local SHOWN = 100
