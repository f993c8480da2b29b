//! The semaphore script's replies read into the crate's types: each operation's answer
//! (docs/protocol.md, "Calls"), with what it also tells of the semaphore (`News`: the limit in
//! force, the server's clock, whether anyone waits) handed back for the semaphore to heed, and
//! the script's error replies explained. Only reading lives here, no state, so every shape is
//! checked by the fixtures below without a server; its codes are `protocol.rs`'s names. A reply
//! of any other shape is an error that says so (`unexpected`), never a panic.

use std::fmt::Write;
use std::time::Duration;

use redis::Value;
use tokio::time::Instant;

use super::protocol::{
    FULL, GRANTED, HOLDS, NEWER, QUEUED, RATE_LIMITED, TOO_HEAVY, UNKNOWN, WAITS,
};
use crate::backend::store::Attempt;
use crate::class::Classes;
use crate::snapshot::{Holder, ProtocolInUse, Snapshot};
use crate::waitlist::{ClockReading, Status};
use crate::{Error, RateDecision};

/// What a reply tells of the semaphore besides its answer, as far as it was read: the limit in
/// force, the server's clock (µs), whether anyone waits.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(super) struct News {
    pub(super) limit: Option<i64>,
    pub(super) now_us: Option<i64>,
    pub(super) crowded: Option<bool>,
}

/// A release's reply: whether anyone waits, and, when someone does, how soon this process's
/// waiters check the line (a grant the release made to a frozen process ends there unclaimed).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Released {
    pub(super) crowded: bool,
    pub(super) check_in: Option<Duration>,
}

/// The answers of an acquire call for `members` members: one each, in order.
pub(super) fn answers(reply: &Value, members: usize) -> Result<&[Value], Error> {
    match reply {
        Value::Array(answers) if answers.len() == members => Ok(answers),
        _ => Err(unexpected(reply)),
    }
}

/// One member's answer to an acquire call sent at `sent`, and what it told of the semaphore on
/// the way (also when the rest of it is not understood).
pub(super) fn attempt(reply: &Value, sent: Instant) -> (News, Result<Attempt, Error>) {
    let numbers = integers(reply);
    let mut news = News {
        // Every answer carries the limit in force but a heavy one's (which is no news).
        limit: match numbers.as_deref() {
            Some(&[GRANTED, _, _, _, limit, ..]) => Some(limit),
            Some(&[FULL | QUEUED, _, _, limit, ..]) => Some(limit),
            Some(&[RATE_LIMITED, _, limit, ..]) => Some(limit),
            _ => None,
        },
        ..News::default()
    };
    let attempt = match numbers.as_deref() {
        Some(&[TOO_HEAVY, limit]) => u32::try_from(limit)
            .map(|limit| Attempt::TooHeavy { limit })
            .map_err(|_| unexpected(reply)),
        Some(&[GRANTED, token, left_us, now_us, _, crowded, ref rate @ ..]) => {
            news.now_us = Some(now_us);
            news.crowded = Some(crowded == 1);
            granted(reply, token, left_us, rate)
        }
        Some(&[QUEUED, retry_ms, now_us, _]) => {
            news.now_us = Some(now_us);
            news.crowded = Some(true);
            u64::try_from(now_us)
                .map(|server_us| Attempt::Queued {
                    retry_in: millis(retry_ms),
                    clock: ClockReading {
                        local: sent,
                        server_us,
                    },
                })
                .map_err(|_| unexpected(reply))
        }
        Some(&[FULL, _, now_us, _]) => {
            news.now_us = Some(now_us);
            Ok(Attempt::Full)
        }
        Some(&[RATE_LIMITED, retry_us, _]) => micros(retry_us)
            .map(|retry_after| Attempt::RateLimited { retry_after })
            .ok_or_else(|| unexpected(reply)),
        _ => Err(unexpected(reply)),
    };
    (news, attempt)
}

/// A grant: its token, the time left of its lease, and the rate it spent when one went with it
/// (`[remaining, reset µs]`, or nothing).
fn granted(reply: &Value, token: i64, left_us: i64, rate: &[i64]) -> Result<Attempt, Error> {
    let rate = match *rate {
        [] => None,
        [remaining, reset_us] => Some(RateDecision {
            allowed: true,
            remaining: u32::try_from(remaining.max(0)).unwrap_or(u32::MAX),
            retry_after: None,
            reset_after: micros(reset_us).ok_or_else(|| unexpected(reply))?,
            degraded: false,
        }),
        _ => return Err(unexpected(reply)),
    };
    Ok(Attempt::Granted {
        token: token_of(token).ok_or_else(|| unexpected(reply))?,
        remaining: micros(left_us).ok_or_else(|| unexpected(reply))?,
        rate,
    })
}

/// A release's reply: `{removed, anyone waits, ms until the earliest lease ends (0 when nobody
/// waits)}`.
pub(super) fn released(reply: &Value) -> Result<Released, Error> {
    match integers(reply).as_deref() {
        Some(&[_, crowded, retry_ms]) => Ok(Released {
            crowded: crowded == 1,
            check_in: (retry_ms > 0).then(|| millis(retry_ms)),
        }),
        _ => Err(unexpected(reply)),
    }
}

/// A renewal's reply for `members` members: `{now µs, anyone waits, then per member µs left of
/// its new lease, or 0}`; the time left of each (none: no longer held).
pub(super) fn renewed(
    reply: &Value,
    members: usize,
) -> Result<(News, Vec<Option<Duration>>), Error> {
    match integers(reply).as_deref() {
        Some([now_us, crowded, left @ ..]) if left.len() == members => {
            let news = News {
                now_us: Some(*now_us),
                crowded: Some(*crowded == 1),
                ..News::default()
            };
            Ok((news, left.iter().copied().map(micros).collect()))
        }
        _ => Err(unexpected(reply)),
    }
}

/// `used`'s reply: `{weight held, the limit in force}`; the weight held.
pub(super) fn used(reply: &Value) -> Result<(News, u32), Error> {
    match integers(reply).as_deref() {
        Some(&[used, limit]) => {
            let news = News {
                limit: Some(limit),
                ..News::default()
            };
            Ok((news, u32::try_from(used.max(0)).unwrap_or(u32::MAX)))
        }
        _ => Err(unexpected(reply)),
    }
}

/// How many numbers a touch answers per member: its status, token and µs left.
const PER_TOUCHED: usize = 3;

/// A touch's reply for `members` members: `{retry ms, then per member HOLDS token left µs |
/// WAITS 0 0 | UNKNOWN 0 0}`; each member's status, and how soon to touch again.
pub(super) fn touched(reply: &Value, members: usize) -> Result<(Vec<Status>, Duration), Error> {
    let numbers = integers(reply).ok_or_else(|| unexpected(reply))?;
    let Some((&retry_ms, rest)) = numbers.split_first() else {
        return Err(unexpected(reply));
    };
    if rest.len() != members * PER_TOUCHED {
        return Err(unexpected(reply));
    }
    let statuses = rest
        .chunks_exact(PER_TOUCHED)
        .map(|status| match *status {
            [HOLDS, token, left_us] => Ok(match (token_of(token), micros(left_us)) {
                (Some(token), Some(remaining)) => Status::Granted { token, remaining },
                _ => Status::Unknown,
            }),
            [WAITS, ..] => Ok(Status::Queued),
            [UNKNOWN, ..] => Ok(Status::Unknown),
            _ => Err(unexpected(reply)),
        })
        .collect::<Result<_, _>>()?;
    Ok((statuses, millis(retry_ms)))
}

/// `set_limit`'s and `unset_limit`'s reply: `1`.
pub(super) fn done(reply: &Value) -> Result<(), Error> {
    match reply {
        Value::Int(1) => Ok(()),
        other => Err(unexpected(other)),
    }
}

/// `evict`'s reply: `1` if the holder was removed, else `0`.
pub(super) fn evicted(reply: &Value) -> Result<bool, Error> {
    match reply {
        Value::Int(evicted) => Ok(*evicted == 1),
        other => Err(unexpected(other)),
    }
}

/// A snapshot's reply (see [`parse_snapshot`]).
pub(super) fn snapshot(reply: &Value) -> Result<Snapshot, Error> {
    parse_snapshot(reply).ok_or_else(|| unexpected(reply))
}

/// `{limit, used, waiting, now ms, pinned, waiting per level ("<n0>,...,<n7>"), tenants'
/// waiting ("<hex>:<n>,..."), the shares in force, versions ("<version>:<processes>,..."),
/// weight held per level}, then per holder: member, deadline ms, granted ms, process name`.
fn parse_snapshot(reply: &Value) -> Option<Snapshot> {
    let Value::Array(items) = reply else {
        return None;
    };
    let int = |value: &Value| -> Option<i64> {
        match value {
            Value::Int(n) => Some(*n),
            Value::BulkString(text) => std::str::from_utf8(text).ok()?.parse().ok(),
            _ => None,
        }
    };
    let (head, rest) = items.split_at_checked(10)?;
    let [
        limit,
        used,
        waiting,
        now,
        pinned,
        waiting_per_level,
        tenants_waiting,
        shares,
        versions,
        weights,
    ] = head
    else {
        return None;
    };
    let per_level = |value: &Value| -> Option<[u32; 8]> {
        let mut counts = [0u32; 8];
        for (level, n) in text(value)?.split(',').enumerate().take(8) {
            counts[level] = n.parse().ok()?;
        }
        Some(counts)
    };
    let waiting_per_level = per_level(waiting_per_level)?;
    let weights = per_level(weights)?;
    let tenants = text(tenants_waiting)?
        .split(',')
        .filter(|entry| !entry.is_empty())
        .map(|entry| {
            let (tenant, n) = entry.split_once(':')?;
            Some((u64::from_str_radix(tenant, 16).ok()?, n.parse().ok()?))
        })
        .collect::<Option<Vec<_>>>()?;
    let count = |value: &Value| u32::try_from(int(value)?.max(0)).ok();
    let now = int(now)?;
    let millis = |ms: i64| Duration::from_millis(u64::try_from(ms.max(0)).unwrap_or(0));
    let mut holders = rest
        .chunks_exact(4)
        .map(|holder| {
            let Value::BulkString(member) = &holder[0] else {
                return None;
            };
            let member = std::str::from_utf8(member).ok()?;
            let (deadline, granted) = (int(&holder[1])?, int(&holder[2])?);
            let Value::BulkString(process) = &holder[3] else {
                return None;
            };
            let held_for = if granted > 0 {
                millis(now - granted)
            } else {
                Duration::ZERO
            };
            let process = String::from_utf8_lossy(process).into_owned();
            Holder::of(member, held_for, millis(deadline - now), process)
        })
        .collect::<Option<Vec<_>>>()?;
    holders.sort_by_key(|holder| std::cmp::Reverse(holder.held_for));
    let mut snapshot = Snapshot {
        limit: count(limit)?,
        used: count(used)?,
        waiting: count(waiting)?,
        pinned: int(pinned)? == 1,
        holders,
        classes: Vec::new(),
        tenants_waiting: Vec::new(),
        protocols: text(versions)?
            .split(',')
            .filter(|entry| !entry.is_empty())
            .map(|entry| {
                let (version, n) = entry.split_once(':')?;
                Some(ProtocolInUse::new(version.parse().ok()?, n.parse().ok()?))
            })
            .collect::<Option<Vec<_>>>()?,
    };
    snapshot.complete(
        &Classes::decode(text(shares)?),
        weights,
        waiting_per_level,
        tenants,
    );
    Some(snapshot)
}

/// A failed call's error, where the semaphore's `keys` explain it better: kept by a newer
/// protocol (the script refused and wrote nothing; a configuration error, so no outage
/// policy admits past it: this process must be upgraded), or one of them of another type.
pub(super) fn explained(e: Error, keys: &[String]) -> Error {
    let text = e.to_string();
    if text.contains(NEWER) {
        return Error::config(format!("a newer build shares this semaphore: {text}"));
    }
    if text.contains("command not allowed when used memory") {
        // (The script form on a full server, or a grant refused there: see script.rs.)
        return Error::backend(
            format!(
                "{text}: Redis is out of memory (maxmemory), so no permit is granted until \
                 memory is freed; releases and renewals still go through. Free memory or \
                 raise maxmemory"
            ),
            None,
        );
    }
    match e {
        Error::Backend(mut e) if e.message.contains("holds a value of another type") => {
            let _ = write!(e.message, " (this semaphore's keys: {})", keys.join(", "));
            Error::Backend(e)
        }
        e => e,
    }
}

/// A reply's bulk string as text.
fn text(value: &Value) -> Option<&str> {
    match value {
        Value::BulkString(text) => std::str::from_utf8(text).ok(),
        _ => None,
    }
}

/// A fencing token: positive.
fn token_of(token: i64) -> Option<u64> {
    u64::try_from(token).ok().filter(|&token| token > 0)
}

/// Time left of a lease: positive.
fn micros(us: i64) -> Option<Duration> {
    u64::try_from(us)
        .ok()
        .filter(|&us| us > 0)
        .map(Duration::from_micros)
}

/// A retry hint: at least a millisecond.
fn millis(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0).max(1))
}

/// A reply of integers only, as a list.
fn integers(reply: &Value) -> Option<Vec<i64>> {
    match reply {
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::Int(n) => Some(*n),
                _ => None,
            })
            .collect(),
        _ => None,
    }
}

/// A reply of a shape this version does not read.
fn unexpected(reply: &Value) -> Error {
    Error::backend(
        format!(
            "the semaphore script answered {reply:?}, which this version does not understand; \
             is another program or version using the same key prefix?"
        ),
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ints(numbers: &[i64]) -> Value {
        Value::Array(numbers.iter().map(|&n| Value::Int(n)).collect())
    }

    fn bulk(text: &str) -> Value {
        Value::BulkString(text.as_bytes().to_vec())
    }

    fn is_unexpected(result: Result<impl std::fmt::Debug, Error>) -> bool {
        matches!(result, Err(Error::Backend(e)) if e.message.contains("does not understand"))
    }

    #[test]
    fn a_grant_is_read_with_its_token_lease_and_rate() {
        let sent = Instant::now();
        let (news, answer) = attempt(&ints(&[GRANTED, 7, 30_000_000, 1_000, 20, 1]), sent);
        assert_eq!(
            answer.unwrap(),
            Attempt::Granted {
                token: 7,
                remaining: Duration::from_secs(30),
                rate: None
            }
        );
        assert_eq!(
            news,
            News {
                limit: Some(20),
                now_us: Some(1_000),
                crowded: Some(true)
            }
        );
        let (_, answer) = attempt(&ints(&[GRANTED, 8, 1_000, 5, 20, 0, 3, 2_000]), sent);
        let Ok(Attempt::Granted {
            rate: Some(rate), ..
        }) = answer
        else {
            panic!("a grant with its rate: {answer:?}");
        };
        assert_eq!(
            (rate.allowed, rate.remaining, rate.reset_after),
            (true, 3, Duration::from_millis(2))
        );
    }

    #[test]
    fn a_queued_answer_carries_the_servers_clock_and_says_someone_waits() {
        let sent = Instant::now();
        let (news, answer) = attempt(&ints(&[QUEUED, 250, 9_000_000, 10]), sent);
        assert_eq!(
            answer.unwrap(),
            Attempt::Queued {
                retry_in: Duration::from_millis(250),
                clock: ClockReading {
                    local: sent,
                    server_us: 9_000_000
                },
            }
        );
        assert_eq!(
            news,
            News {
                limit: Some(10),
                now_us: Some(9_000_000),
                crowded: Some(true)
            }
        );
        // A retry hint of 0 still waits a millisecond.
        let (_, answer) = attempt(&ints(&[QUEUED, 0, 1, 10]), sent);
        let Ok(Attempt::Queued { retry_in, .. }) = answer else {
            panic!("queued: {answer:?}");
        };
        assert_eq!(retry_in, Duration::from_millis(1));
    }

    #[test]
    fn full_too_heavy_and_rate_limited_answers_are_read() {
        let sent = Instant::now();
        let (news, full) = attempt(&ints(&[FULL, 100, 5, 3]), sent);
        assert_eq!(full.unwrap(), Attempt::Full);
        assert_eq!(
            (news.limit, news.now_us, news.crowded),
            (Some(3), Some(5), None)
        );
        let (news, heavy) = attempt(&ints(&[TOO_HEAVY, 4]), sent);
        assert_eq!(heavy.unwrap(), Attempt::TooHeavy { limit: 4 });
        assert_eq!(news, News::default(), "a heavy answer's limit is no news");
        let (news, limited) = attempt(&ints(&[RATE_LIMITED, 1_500, 8]), sent);
        assert_eq!(
            limited.unwrap(),
            Attempt::RateLimited {
                retry_after: Duration::from_micros(1_500)
            }
        );
        assert_eq!(news.limit, Some(8));
    }

    #[test]
    fn a_refusal_of_a_newer_protocol_is_a_configuration_error() {
        let line = b"-ERR dlimit: protocol 3 keeps dlimit:{x}:meta, and this build speaks \
                     protocol 2 (and 1): upgrade this process; nothing was written\r\n";
        let reply = redis::parse_redis_value(line).unwrap();
        assert!(matches!(reply, Value::ServerError(_)), "{reply:?}");
        let e = super::super::errors::redis_error(
            reply.extract_error().unwrap_err(),
            "acquire",
            "redis://x",
        );
        let keys = ["dlimit:{x}:holders".to_owned()];
        match explained(e, &keys) {
            Error::Config(text) => {
                assert!(
                    text.starts_with("a newer build shares this semaphore"),
                    "{text}"
                );
                assert!(text.contains("protocol 3 keeps"), "{text}");
            }
            other => panic!("not a configuration error: {other:?}"),
        }
    }

    #[test]
    fn a_key_of_another_type_is_named_among_the_semaphores_keys() {
        let e = Error::backend(
            "a key of this semaphore holds a value of another type",
            None,
        );
        let keys = ["p{x}:holders".to_owned(), "p{x}:meta".to_owned()];
        let Error::Backend(e) = explained(e, &keys) else {
            panic!("still a backend error");
        };
        assert!(
            e.message
                .ends_with("(this semaphore's keys: p{x}:holders, p{x}:meta)")
        );
    }

    #[test]
    fn a_malformed_reply_is_an_error_not_a_panic() {
        let sent = Instant::now();
        let malformed = [
            Value::Nil,
            Value::Int(1),
            ints(&[]),
            ints(&[GRANTED]),
            ints(&[GRANTED, 0, 1_000, 5, 20, 1]),
            ints(&[GRANTED, 7, -1, 5, 20, 1]),
            ints(&[GRANTED, 7, 1_000, 5, 20, 1, 3]),
            ints(&[QUEUED, 250, -5, 10]),
            ints(&[TOO_HEAVY, -4]),
            ints(&[RATE_LIMITED, 0, 8]),
            ints(&[99, 0, 0, 0]),
            Value::Array(vec![Value::Int(GRANTED), bulk("7")]),
        ];
        for reply in &malformed {
            let (_, answer) = attempt(reply, sent);
            assert!(is_unexpected(answer), "{reply:?}");
        }
        // What a partly read answer told still counts (the limit of a grant without a token).
        let (news, _) = attempt(&ints(&[GRANTED, 0, 1_000, 5, 20, 1]), sent);
        assert_eq!(news.limit, Some(20));

        assert!(is_unexpected(answers(&ints(&[1, 2]), 3)));
        assert!(is_unexpected(released(&ints(&[1, 1]))));
        assert!(is_unexpected(renewed(&ints(&[5, 0, 1]), 2)));
        assert!(is_unexpected(used(&bulk("3"))));
        assert!(is_unexpected(touched(&ints(&[10, HOLDS, 1]), 1)));
        assert!(is_unexpected(touched(&ints(&[10, 9, 0, 0]), 1)));
        assert!(is_unexpected(touched(&ints(&[]), 0)));
        assert!(is_unexpected(done(&Value::Int(0))));
        assert!(is_unexpected(evicted(&bulk("1"))));
        assert!(is_unexpected(snapshot(&ints(&[1, 2, 3]))));
        assert!(is_unexpected(snapshot(&Value::Nil)));
    }

    #[test]
    fn releases_renewals_touches_and_reads_are_read() {
        assert_eq!(
            released(&ints(&[1, 1, 40])).unwrap(),
            Released {
                crowded: true,
                check_in: Some(Duration::from_millis(40))
            }
        );
        assert_eq!(released(&ints(&[0, 0, 0])).unwrap().check_in, None);
        let (news, left) = renewed(&ints(&[7, 0, 2_000, 0]), 2).unwrap();
        assert_eq!((news.now_us, news.crowded), (Some(7), Some(false)));
        assert_eq!(left, [Some(Duration::from_millis(2)), None]);
        let (news, held) = used(&ints(&[-1, 12])).unwrap();
        assert_eq!((news.limit, held), (Some(12), 0));
        let touch = ints(&[
            30, HOLDS, 4, 1_000, WAITS, 0, 0, UNKNOWN, 0, 0, HOLDS, 0, 1_000,
        ]);
        let (statuses, retry) = touched(&touch, 4).unwrap();
        assert_eq!(
            statuses,
            [
                Status::Granted {
                    token: 4,
                    remaining: Duration::from_millis(1)
                },
                Status::Queued,
                Status::Unknown,
                Status::Unknown,
            ]
        );
        assert_eq!(retry, Duration::from_millis(30));
        assert!(done(&Value::Int(1)).is_ok());
        assert!(!evicted(&Value::Int(0)).unwrap());
    }

    #[test]
    fn a_snapshot_is_read_with_its_holders_longest_held_first() {
        let reply = Value::Array(vec![
            Value::Int(10),
            Value::Int(3),
            Value::Int(1),
            Value::Int(50_000),
            Value::Int(0),
            bulk("0,0,0,0,1,0,0,0"),
            bulk(""),
            bulk(""),
            bulk("2:1"),
            bulk("0,0,0,0,3,0,0,0"),
            bulk("aaaaaaaa01:1:30000"),
            Value::Int(60_000),
            Value::Int(45_000),
            bulk("web-1"),
            bulk("aaaaaaaa02:2:30000"),
            Value::Int(70_000),
            Value::Int(40_000),
            bulk("web-1"),
        ]);
        let snapshot = snapshot(&reply).unwrap();
        assert_eq!(
            (
                snapshot.limit,
                snapshot.used,
                snapshot.waiting,
                snapshot.pinned
            ),
            (10, 3, 1, false)
        );
        let held: Vec<Duration> = snapshot.holders.iter().map(|h| h.held_for).collect();
        assert_eq!(held, [Duration::from_secs(10), Duration::from_secs(5)]);
        assert_eq!(snapshot.protocols, [ProtocolInUse::new(2, 1)]);
    }
}
