//! What a semaphore does when its backend cannot be reached, and how its outages are logged.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::Error;
use crate::sync::lock;

/// What [`Semaphore`](crate::Semaphore) answers when its backend fails (Redis unreachable,
/// too slow, restarting). Chosen per semaphore with
/// [`SemaphoreBuilder::on_outage`](crate::SemaphoreBuilder::on_outage); every request decided
/// this way is counted in [`Semaphore::outage_decisions`](crate::Semaphore::outage_decisions)
/// and logged through `tracing` (target `tower_distributed_limit::outage`): each at DEBUG, and
/// at WARN the outage's start, a summary of its decisions every 10 s while it lasts, and its
/// end.
///
/// Only backend failures trigger the policy: a full semaphore still waits or times out as
/// usual. Once the backend answers again, requests go back to it by themselves.
///
/// # Examples
///
/// ```
/// use tower_distributed_limit::{MemoryBackend, OutagePolicy, Semaphore};
///
/// // 30 connections shared by ~4 instances: during an outage each instance allows 7 itself.
/// let sem = Semaphore::builder("legacy-db")
///     .limit(30)
///     .on_outage(OutagePolicy::Local { limit: 7 })
///     .build(MemoryBackend::new())
///     .unwrap();
/// # let _ = sem;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OutagePolicy {
    /// Refuse: the request gets the backend's [`Error::Backend`](crate::Error::Backend). Safe
    /// for a resource that must never see more than the limit. The default.
    #[default]
    FailClosed,
    /// Let every request through without a limit, with a [`Permit`](crate::Permit) that
    /// [`is_degraded`](crate::Permit::is_degraded). For a limit that protects little compared
    /// with the cost of refusing traffic.
    FailOpen,
    /// Limit in this process alone, to `limit` at once: e.g. the global limit divided by the
    /// expected number of instances.
    Local {
        /// Permits this process may hand out while the backend is down.
        limit: u32,
    },
}

impl OutagePolicy {
    /// How many permits this process may hand out during an outage, if any.
    pub(crate) fn local_limit(self) -> Option<u32> {
        match self {
            OutagePolicy::FailClosed => None,
            OutagePolicy::FailOpen => Some(u32::MAX),
            OutagePolicy::Local { limit } => Some(limit),
        }
    }
}

/// How often an outage that lasts is summed up in the log.
const SUMMARY_EVERY: Duration = Duration::from_secs(10);

/// The `tracing` target of the outage policy's decisions.
const TARGET: &str = "tower_distributed_limit::outage";

/// The log of one limiter's outages: its start and its end at WARN, a summary of the policy's
/// decisions every [`SUMMARY_EVERY`] while it lasts (on the next decision), and each decision
/// at DEBUG, so the log grows with the outage's length, not with the traffic.
pub(crate) struct OutageLog {
    /// `"semaphore"` or `"rate limiter"`, and its name.
    kind: &'static str,
    name: String,
    policy: OutagePolicy,
    /// In an outage: lets the calls the backend answers skip the lock.
    failing: AtomicBool,
    spell: Mutex<Spell>,
}

impl OutageLog {
    pub(crate) fn new(kind: &'static str, name: &str, policy: OutagePolicy) -> Self {
        OutageLog {
            kind,
            name: name.to_owned(),
            policy,
            failing: AtomicBool::new(false),
            spell: Mutex::default(),
        }
    }

    /// The backend failed with `error` and the policy let the call through (or to the
    /// in-process limit), or refused it.
    pub(crate) fn decided(&self, error: &Error, admitted: bool) {
        let (kind, name, policy) = (self.kind, &self.name, self.policy);
        tracing::debug!(target: TARGET, kind, limiter = %name, ?policy, admitted, %error,
            "the backend failed: the outage policy decided the call");
        let report = lock(&self.spell).decided(Instant::now(), admitted);
        self.failing.store(true, Ordering::Relaxed);
        match report {
            Some(Report::Started) => tracing::warn!(target: TARGET, kind, limiter = %name,
                ?policy, %error,
                "{kind} {name:?}: its backend failed, so the outage policy decides every call \
                 until it answers (summed up every {SUMMARY_EVERY:?}; each call at DEBUG)"),
            Some(Report::Lasting {
                counts,
                over,
                total,
            }) => tracing::warn!(target: TARGET,
                kind, limiter = %name, ?policy, %error, admitted = counts.admitted,
                refused = counts.refused,
                "{kind} {name:?}: its backend still fails; the outage policy decided {} calls in \
                 the last {over:.0?} ({} let through or limited in process, {} refused), {} since it \
                 failed",
                counts.total(), counts.admitted, counts.refused, total.total()),
            None => {}
        }
    }

    /// The backend answered a call: an outage, if any, is over.
    pub(crate) fn answered(&self) {
        if !self.failing.load(Ordering::Relaxed) {
            return;
        }
        let Some((total, lasted)) = lock(&self.spell).ended(Instant::now()) else {
            return;
        };
        self.failing.store(false, Ordering::Relaxed);
        let (kind, name) = (self.kind, &self.name);
        tracing::warn!(target: TARGET, kind, limiter = %name, admitted = total.admitted,
            refused = total.refused,
            "{kind} {name:?}: its backend answers again after {lasted:.1?}; the outage policy \
             decided {} calls meanwhile ({} let through or limited in process, {} refused)",
            total.total(), total.admitted, total.refused);
    }
}

/// An outage as the log keeps it: when it started, its decisions, and those since the last
/// summary.
#[derive(Default)]
struct Spell {
    /// When the outage started and was last summed up; `None` while the backend answers.
    started: Option<Instant>,
    summed_up: Option<Instant>,
    total: Counts,
    recent: Counts,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Counts {
    admitted: u64,
    refused: u64,
}

impl Counts {
    fn total(self) -> u64 {
        self.admitted + self.refused
    }
}

/// What a decision makes the log say.
#[derive(Debug, PartialEq, Eq)]
enum Report {
    Started,
    /// The decisions `over` the last summary's span, and since the outage started.
    Lasting {
        counts: Counts,
        over: Duration,
        total: Counts,
    },
}

impl Spell {
    fn decided(&mut self, now: Instant, admitted: bool) -> Option<Report> {
        let count = |counts: &mut Counts| match admitted {
            true => counts.admitted += 1,
            false => counts.refused += 1,
        };
        count(&mut self.total);
        count(&mut self.recent);
        let Some(summed_up) = self.summed_up else {
            self.started = Some(now);
            self.summed_up = Some(now);
            return Some(Report::Started);
        };
        let over = now.saturating_duration_since(summed_up);
        if over < SUMMARY_EVERY {
            return None;
        }
        self.summed_up = Some(now);
        Some(Report::Lasting {
            counts: std::mem::take(&mut self.recent),
            over,
            total: self.total,
        })
    }

    /// The outage ended: its decisions and how long it lasted.
    fn ended(&mut self, now: Instant) -> Option<(Counts, Duration)> {
        let started = self.started.take()?;
        let total = std::mem::take(&mut self.total);
        *self = Spell::default();
        Some((total, now.saturating_duration_since(started)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_is_told_at_its_start_every_summary_and_its_end_whatever_the_calls() {
        let mut spell = Spell::default();
        let start = Instant::now();
        assert_eq!(spell.decided(start, true), Some(Report::Started));
        for i in 1..1000 {
            let at = start + SUMMARY_EVERY.mul_f64(f64::from(i) / 1000.0);
            assert_eq!(spell.decided(at, i % 2 == 0), None, "call {i}");
        }
        let at = start + SUMMARY_EVERY;
        assert_eq!(
            spell.decided(at, false),
            Some(Report::Lasting {
                counts: Counts {
                    admitted: 500,
                    refused: 501
                },
                over: SUMMARY_EVERY,
                total: Counts {
                    admitted: 500,
                    refused: 501
                },
            })
        );
        assert_eq!(spell.decided(at + Duration::from_secs(1), true), None);
        let total = Counts {
            admitted: 501,
            refused: 501,
        };
        assert_eq!(
            spell.ended(at + Duration::from_secs(2)),
            Some((total, SUMMARY_EVERY + Duration::from_secs(2)))
        );
        assert_eq!(spell.ended(at + Duration::from_secs(3)), None, "told once");
        // The next outage starts anew.
        assert_eq!(
            spell.decided(at + Duration::from_secs(4), false),
            Some(Report::Started)
        );
    }
}
