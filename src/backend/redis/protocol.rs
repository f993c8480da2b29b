//! The semaphore script's protocol as the Rust side names it: the codes its replies carry,
//! and the bounds of one call (its version is the crate's `PROTOCOL_VERSION`). `lua/semaphore/protocol.lua` names the same
//! numbers for the script, and a test below checks that the two agree; docs/protocol.md
//! states the whole protocol.

/// An acquire's answer for one member.
pub(super) const FULL: i64 = 0;
pub(super) const GRANTED: i64 = 1;
pub(super) const QUEUED: i64 = 2;
pub(super) const TOO_HEAVY: i64 = 3;
pub(super) const RATE_LIMITED: i64 = 4;

/// A touch's status for one member.
pub(super) const UNKNOWN: i64 = 0;
pub(super) const HOLDS: i64 = 1;
pub(super) const WAITS: i64 = 2;

/// The most releases one call carries, and the most members it acquires, touches or renews: a
/// longer list is split across calls, so no call keeps Redis busy for long.
pub(super) const MAX_RELEASES: usize = 32;
pub(super) const MAX_MEMBERS: usize = 16;

/// What the script's error reply says when a newer protocol keeps the semaphore.
pub(super) const NEWER: &str = "this build speaks protocol";

#[cfg(test)]
mod tests {
    use super::*;

    /// The `local NAME, ... = value, ...` lines of protocol.lua, as (name, value) pairs.
    fn lua_constants() -> Vec<(String, String)> {
        let source = include_str!("../lua/semaphore/protocol.lua");
        let mut constants = Vec::new();
        for line in source.lines() {
            let Some((names, values)) = line
                .strip_prefix("local ")
                .and_then(|rest| rest.split_once(" = "))
            else {
                continue;
            };
            for (name, value) in names.split(", ").zip(values.split(", ")) {
                constants.push((name.to_owned(), value.trim_matches('\'').to_owned()));
            }
        }
        constants
    }

    #[test]
    fn the_script_and_the_rust_side_name_the_same_numbers() {
        let lua = lua_constants();
        let value = |name: &str| {
            lua.iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| panic!("protocol.lua names no {name}"))
        };
        let expected: [(&str, String); 12] = [
            ("PROTOCOL", crate::PROTOCOL_VERSION.to_string()),
            ("PROTOCOL_TEXT", crate::PROTOCOL_VERSION.to_string()),
            ("FULL", FULL.to_string()),
            ("GRANTED", GRANTED.to_string()),
            ("QUEUED", QUEUED.to_string()),
            ("TOO_HEAVY", TOO_HEAVY.to_string()),
            ("RATE_LIMITED", RATE_LIMITED.to_string()),
            ("UNKNOWN", UNKNOWN.to_string()),
            ("HOLDS", HOLDS.to_string()),
            ("WAITS", WAITS.to_string()),
            ("MAX_RELEASES", MAX_RELEASES.to_string()),
            ("MAX_MEMBERS", MAX_MEMBERS.to_string()),
        ];
        for (name, rust) in expected {
            assert_eq!(
                value(name),
                rust,
                "{name} differs between protocol.lua and protocol.rs"
            );
        }
    }
}
