//! What a call of the semaphore script sends, written out: the keys and the arguments every
//! call starts with ([`Head`], in docs/protocol.md's order), the caller's limit as the script
//! takes it, the word for each acquire mode, and the marks a release or a batch of samples
//! carries (and the lease read back from a member's text). Kept apart from the calls that
//! send them so the layout of one call is stated once, next to nothing else.

use std::fmt::Write;
use std::sync::Arc;
use std::time::Duration;

use redis::Cmd;

use crate::AdaptiveLimit;
use crate::backend::store::{Ending, Mode, Samples};
use crate::class::Classes;
use crate::waitlist::PATIENCE;

/// The names of a semaphore's keys after its `<prefix>{<name>}:`, in the order every call
/// sends them.
pub(super) const KEYS: [&str; 8] = [
    "holders", "meta", "queue", "alive", "since", "procs", "tenants", "versions",
];

/// What every call of one semaphore sends before the releases it carries (docs/protocol.md,
/// "Calls").
pub(super) struct Head<'a> {
    /// The semaphore's keys ([`KEYS`]).
    pub(super) keys: &'a [String],
    /// The rate limiter's key, for an acquire that spends it in the same call.
    pub(super) rate_key: Option<&'a str>,
    /// Behind Sentinel, the server's promotion key and the fence.
    pub(super) promoted: Option<&'a (String, Duration)>,
    pub(super) op: &'a str,
    pub(super) channel: &'a str,
    /// `PUBLISH` or `SPUBLISH`.
    pub(super) publisher: &'static str,
    /// The caller's limit ([`limit_arg`]).
    pub(super) limit: &'a str,
    pub(super) claim: Duration,
    /// The process tag, with its name now and then.
    pub(super) caller: &'a str,
}

impl Head<'_> {
    /// Writes the keys, the arguments every call starts with, and `count` releases.
    pub(super) fn write<'m>(
        &self,
        command: &mut Cmd,
        count: usize,
        releases: impl Iterator<Item = &'m str>,
    ) {
        let keys = self.keys.len()
            + usize::from(self.rate_key.is_some())
            + usize::from(self.promoted.is_some());
        command.arg(keys).arg(self.keys);
        if let Some(key) = self.rate_key {
            command.arg(key);
        }
        if let Some((key, _)) = self.promoted {
            command.arg(key);
        }
        command
            .arg(self.op)
            .arg(self.channel)
            .arg(self.publisher)
            .arg(self.limit)
            .arg(PATIENCE.as_millis() as u64)
            .arg(self.claim.as_millis() as u64)
            .arg(
                self.promoted
                    .map_or(0, |(_, fence)| fence.as_millis() as u64),
            )
            .arg(self.caller)
            .arg(count);
        for member in releases {
            command.arg(member);
        }
    }
}

/// How the script is told the limit: `<limit>`, or `<initial>/<min>/<max>` for an adaptive
/// one, then `|<classes' shares>` when any (the process that creates the semaphore's state
/// decides both).
pub(super) fn limit_arg(limit: u32, adaptive: Option<AdaptiveLimit>, classes: &Classes) -> String {
    let mut arg = match adaptive {
        Some(AdaptiveLimit { initial, min, max }) => format!("{initial}/{min}/{max}"),
        None => limit.to_string(),
    };
    if classes.any() {
        arg.push('|');
        arg.push_str(&classes.encode());
    }
    arg
}

/// The word the script takes for each mode.
pub(super) fn mode_word(mode: Mode) -> &'static str {
    match mode {
        Mode::Once => "once",
        Mode::Join => "join",
        Mode::Recheck => "recheck",
    }
}

/// How a release names its member for the script (`lua/semaphore/adapt.lua`): a process
/// built adaptive puts `@<µs held>:` before it (its own measure of the hold, free of the
/// hand-off delays of grant announcements and carried releases), and `!` before that
/// marks an overloaded hold.
pub(super) fn released(member: &Arc<str>, ending: Ending, adaptive: bool) -> Arc<str> {
    let held = ending.held.filter(|_| adaptive);
    if held.is_none() && !ending.overloaded {
        return member.clone();
    }
    let mut text = String::with_capacity(member.len() + 16);
    if ending.overloaded {
        text.push('!');
    }
    if let Some(held) = held {
        // Writing to a String cannot fail.
        let _ = write!(text, "@{}:", held.as_micros());
    }
    text.push_str(member);
    text.into()
}

/// Holds that ended in a prefetch, as a release with no member:
/// `[!]@<µs mean>*<count>:` (`lua/semaphore/holders.lua`).
pub(super) fn sampled(samples: Samples) -> Arc<str> {
    let mut text = String::with_capacity(24);
    if samples.overloaded {
        text.push('!');
    }
    // Writing to a String cannot fail.
    let _ = write!(text, "@{}*{}:", samples.mean.as_micros(), samples.count);
    text.into()
}

/// The lease a member's text ends with (`...:<lease ms>`), after any marks a release puts
/// before it; none for a sample (`@<µs>*<n>:`).
pub(super) fn lease_of(text: &str) -> Option<Duration> {
    let (_, lease) = text.rsplit_once(':')?;
    lease.parse().ok().map(Duration::from_millis)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owed_release_is_kept_for_its_lease_and_a_sample_not_at_all() {
        assert_eq!(lease_of("ab12:3:30000"), Some(Duration::from_secs(30)));
        assert_eq!(
            lease_of("!@1500:ab12:c2:p:1:2000"),
            Some(Duration::from_secs(2))
        );
        assert_eq!(lease_of("@1500*3:"), None);
        assert_eq!(lease_of("no-lease"), None);
    }

    #[test]
    fn an_adaptive_release_carries_its_hold_and_its_congestion_signal() {
        let member: Arc<str> = "m".into();
        let ending = |held_us, overloaded| Ending {
            held: Some(Duration::from_micros(held_us)),
            overloaded,
        };
        assert_eq!(&*released(&member, ending(1500, false), true), "@1500:m");
        assert_eq!(&*released(&member, ending(7, true), true), "!@7:m");
        assert_eq!(&*released(&member, Ending::default(), true), "m");
        // A fixed limit's process sends no hold time (the script times it, if the limit adapts).
        assert_eq!(&*released(&member, ending(1500, false), false), "m");
        assert_eq!(&*released(&member, ending(1500, true), false), "!m");
    }
}
