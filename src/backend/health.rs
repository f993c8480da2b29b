//! Whether a Redis server answers, so that an outage costs a request microseconds, not a
//! timeout.
//!
//! Each server the crate talks to (a `RedisBackend`'s node, Cluster or Sentinel master; each
//! node of a quorum) is up or down. A call refused, dropped for good, or past the call timeout
//! marks it down ([`failed`]); while it is down every call fails at once ([`refuse_while_down`]), so the
//! outage policy decides in microseconds, and **one** background probe per server tries to
//! reach it again with a jittered back-off capped at [`MAX_PAUSE`]. Requests never wait behind
//! a connect attempt, and never more than one attempt per server is in flight (the probe is
//! the only caller while the server is down). A full semaphore is an answer, not a failure.
//!
//! The probe is a task on the runtime of the call that saw the failure. A runtime that goes
//! away drops it (its guard frees the role), and a task not seen for a whole attempt plus a
//! pause (a runtime no longer driven) is replaced by the next call that finds the server down.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use redis::RedisError;

use tokio::sync::Notify;

use super::redis::{access_problem, short};
use crate::Error;
use crate::sync::lock;

/// The longest pause between two probes: a server that is back is used again within about
/// this much.
pub(in crate::backend) const MAX_PAUSE: Duration = Duration::from_secs(1);

/// The first pause after a failure: the one just seen is fresh, so asking at once would only
/// repeat it.
const FIRST_PAUSE: Duration = Duration::from_millis(50);

/// The `tracing` target of the up/down transitions.
const TARGET: &str = "tower_distributed_limit::backend";

/// How long a refusal of the user's permissions by a server that is up (`NOPERM`) is reported
/// by [`BackendStatus`] after it was last seen: no call tells when the ACL was fixed.
const DENIAL_SHOWN: Duration = Duration::from_secs(60);

/// What a readiness probe needs to know of a backend's server, from
/// [`RedisBackend::status`](crate::RedisBackend::status).
///
/// # Examples
///
/// ```no_run
/// use tower_distributed_limit::{BackendStatus, RedisBackend};
///
/// # fn ready(redis: &RedisBackend) -> bool {
/// match redis.status() {
///     BackendStatus::Up => true,
///     // The outage policy decides meanwhile; a probe reconnects by itself.
///     BackendStatus::Down { .. } => true,
///     // A configuration error: not ready until the credentials or the ACL are fixed.
///     BackendStatus::Denied { reason } => {
///         eprintln!("{reason}");
///         false
///     }
///     _ => false,
/// }
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendStatus {
    /// The server answers.
    Up,
    /// The server cannot be reached (refused, dropped, too slow, not reached yet): calls fail
    /// at once and the outage policy decides; a background probe reconnects by itself.
    Down {
        /// The last failure, in a few words.
        reason: String,
    },
    /// The server refused this process's credentials, or (within the last minute) its user's
    /// ACL permissions: calls fail with [`Error::AccessDenied`], whatever the outage policy,
    /// until the configuration is fixed.
    Denied {
        /// What was refused and what to change.
        reason: String,
    },
}

/// A server that can be probed: its [`Health`], and one attempt to reach it.
pub(in crate::backend) trait Reconnect: Send + Sync + 'static {
    fn health(&self) -> &Health;
    /// One attempt to reach the server (connect if need be, then a round trip). The probe
    /// bounds it by [`Health`]'s attempt bound.
    fn attempt(&self) -> impl Future<Output = Result<(), RedisError>> + Send + '_;
    /// The server answers again: whatever was lost meanwhile is to be checked.
    fn reconnected(&self);
    /// The server was just marked down: whoever waits on it is to be told `why` (the outage
    /// policy decides them at once).
    fn went_down(&self, why: String) {
        let _ = why;
    }
}

/// Up or down, and who probes.
pub(in crate::backend) struct Health {
    down: AtomicBool,
    /// What the server is, for messages and metrics (its address).
    label: String,
    /// The longest one probe attempt may take.
    bound: Duration,
    state: Mutex<State>,
    /// Wakes the probe from its pause: news that the server may answer now (Sentinel named
    /// a new master).
    kick: Arc<Notify>,
    #[cfg(feature = "metrics")]
    metrics: Metrics,
}

struct State {
    since: Instant,
    /// The last failure, in a few words.
    reason: String,
    /// The probe running now: its number and when it was last seen.
    probe: Option<(u64, Instant)>,
    probes: u64,
    /// The server was never reached yet (a lazy start): its first success is no recovery.
    never_up: bool,
    /// The server refused the credentials or the permissions: what to change, and when it
    /// was last seen.
    denied: Option<(String, Instant)>,
}

#[cfg(feature = "metrics")]
struct Metrics {
    up: metrics::Gauge,
    fast_failed: metrics::Counter,
    denied: metrics::Gauge,
}

impl Health {
    /// A server called `label`, down until it is first reached ([`Health::started`] or a
    /// probe); one probe attempt takes at most `bound`.
    pub(in crate::backend) fn new(label: String, bound: Duration) -> Self {
        #[cfg(feature = "metrics")]
        let metrics = {
            describe();
            let backend = metrics::SharedString::from(label.clone());
            Metrics {
                up: metrics::gauge!("dlimit_backend_up", "backend" => backend.clone()),
                denied: metrics::gauge!("dlimit_backend_denied", "backend" => backend.clone()),
                fast_failed: metrics::counter!("dlimit_backend_fast_failures_total", "backend" => backend),
            }
        };
        Health {
            down: AtomicBool::new(true),
            label,
            bound,
            state: Mutex::new(State {
                since: Instant::now(),
                reason: "not reached yet".into(),
                probe: None,
                probes: 0,
                never_up: true,
                denied: None,
            }),
            kick: Arc::default(),
            #[cfg(feature = "metrics")]
            metrics,
        }
    }

    /// What wakes the probe from its pause at once, with its back-off reset: for news that the
    /// server may answer now.
    pub(in crate::backend) fn kicker(&self) -> Arc<Notify> {
        self.kick.clone()
    }

    pub(in crate::backend) fn is_up(&self) -> bool {
        !self.down.load(Ordering::Acquire)
    }

    pub(in crate::backend) fn label(&self) -> &str {
        &self.label
    }

    /// Up, down, or refusing this process's credentials or permissions.
    pub(in crate::backend) fn status(&self) -> BackendStatus {
        let state = lock(&self.state);
        let up = self.is_up();
        match &state.denied {
            Some((reason, seen)) if !up || seen.elapsed() < DENIAL_SHOWN => BackendStatus::Denied {
                reason: reason.clone(),
            },
            _ if up => BackendStatus::Up,
            _ => BackendStatus::Down {
                reason: state.reason.clone(),
            },
        }
    }

    /// The server refused the credentials or permissions (`problem`: what to change): logged
    /// at ERROR once, until it accepts them again.
    fn deny(&self, problem: &str) {
        let mut state = lock(&self.state);
        let first = state.denied.is_none();
        let reason = format!(
            "Redis at {} refused this process's credentials or permissions: {problem}. Calls \
             fail with this error (no outage policy admits them) until it is fixed",
            self.label
        );
        if first {
            tracing::error!(target: TARGET, backend = %self.label, %reason,
                "Redis refused this process's credentials or permissions: a configuration error, not an outage");
            #[cfg(feature = "metrics")]
            self.metrics.denied.increment(1.0);
        }
        state.denied = Some((reason, Instant::now()));
    }

    /// Forgets a refusal: the server accepted the credentials (a probe reached it), or is down.
    fn accepted(&self, state: &mut State) {
        if state.denied.take().is_some() {
            tracing::info!(target: TARGET, backend = %self.label, "Redis no longer refuses this process's credentials");
            #[cfg(feature = "metrics")]
            self.metrics.denied.decrement(1.0);
        }
    }

    /// Why calls fail at once now, for the error they get.
    fn refusal(&self) -> Error {
        #[cfg(feature = "metrics")]
        self.metrics.fast_failed.increment(1);
        let state = lock(&self.state);
        if let Some((reason, _)) = &state.denied {
            return Error::access_denied(reason.clone());
        }
        Error::backend(
            format!(
                "Redis at {} is down ({}, {:.1?} ago), so the call was refused at once; a \
                 background probe reconnects by itself",
                self.label,
                state.reason,
                state.since.elapsed()
            ),
            None,
        )
    }

    /// Marks the server down for `reason`; logged once per transition. Whether it was up.
    fn mark_down(&self, reason: String) -> bool {
        let mut state = lock(&self.state);
        if self.down.swap(true, Ordering::AcqRel) {
            state.reason = reason;
            return false;
        }
        tracing::warn!(target: TARGET, backend = %self.label, %reason,
            "Redis is down: calls fail at once (the outage policy decides) while a probe reconnects");
        #[cfg(feature = "metrics")]
        self.metrics.up.decrement(1.0);
        // An outage, whatever was refused before: the policy decides until the probe hears
        // the server refuse again.
        self.accepted(&mut state);
        state.since = Instant::now();
        state.reason = reason;
        true
    }

    /// The first connection attempt (not a probe's) reached the server.
    pub(in crate::backend) fn started(&self) {
        lock(&self.state).never_up = false;
        if self.down.swap(false, Ordering::AcqRel) {
            #[cfg(feature = "metrics")]
            self.metrics.up.increment(1.0);
        }
    }

    /// Probe `id` reached the server. Whether this is a recovery (not a lazy first start).
    fn mark_up(&self, id: u64) -> bool {
        let mut state = lock(&self.state);
        if state.probe.is_some_and(|(running, _)| running == id) {
            state.probe = None;
        }
        self.accepted(&mut state);
        if !self.down.swap(false, Ordering::AcqRel) {
            return false;
        }
        #[cfg(feature = "metrics")]
        self.metrics.up.increment(1.0);
        let recovered = !std::mem::replace(&mut state.never_up, false);
        if recovered {
            tracing::warn!(target: TARGET, backend = %self.label, down_for = ?state.since.elapsed(),
                "Redis answers again; calls go to it");
        } else {
            tracing::info!(target: TARGET, backend = %self.label, "Redis reached");
        }
        recovered
    }

    /// Claims the probe role when nobody holds it (or its holder was not seen for a whole
    /// attempt and pause): the new probe's number.
    fn claim_probe(&self) -> Option<u64> {
        let mut state = lock(&self.state);
        let stale = self.bound + MAX_PAUSE * 2;
        if state.probe.is_some_and(|(_, seen)| seen.elapsed() < stale) {
            return None;
        }
        state.probes += 1;
        let id = state.probes;
        state.probe = Some((id, Instant::now()));
        Some(id)
    }

    /// Probe `id` is alive; `false` when it was replaced and should stop.
    fn beat(&self, id: u64) -> bool {
        let mut state = lock(&self.state);
        match &mut state.probe {
            Some((running, seen)) if *running == id => {
                *seen = Instant::now();
                true
            }
            _ => false,
        }
    }

    fn note(&self, reason: String) {
        lock(&self.state).reason = reason;
    }

    fn release_probe(&self, id: u64) {
        let mut state = lock(&self.state);
        if state.probe.is_some_and(|(running, _)| running == id) {
            state.probe = None;
        }
    }
}

/// A backend that goes away while up (or refused) takes its share of `dlimit_backend_up` (or
/// `dlimit_backend_denied`) with it.
#[cfg(feature = "metrics")]
impl Drop for Health {
    fn drop(&mut self) {
        if self.is_up() {
            self.metrics.up.decrement(1.0);
        }
        if lock(&self.state).denied.is_some() {
            self.metrics.denied.decrement(1.0);
        }
    }
}

/// Lets a call through when the server is up; when it is down, refuses at once (and makes
/// sure a probe is running).
pub(in crate::backend) fn refuse_while_down<T: Reconnect>(server: &Arc<T>) -> Result<(), Error> {
    let health = server.health();
    if health.is_up() {
        return Ok(());
    }
    probe(server, Duration::ZERO);
    Err(health.refusal())
}

/// A call failed with `e`: when that means the server is unreachable (refused, dropped,
/// timed out), it is marked down and probed.
pub(in crate::backend) fn failed<T: Reconnect>(server: &Arc<T>, e: &RedisError) {
    if let Some(problem) = access_problem(e) {
        server.health().deny(&problem);
    } else if is_outage(e) {
        down(server, short(e));
    }
}

/// A call got no answer within its own bound (no `RedisError` to tell).
pub(in crate::backend) fn timed_out<T: Reconnect>(server: &Arc<T>, bound: Duration) {
    down(server, format!("no answer within {bound:?}"));
}

/// Marks the server down for `reason` and probes it; on the transition, those waiting on it
/// are told.
fn down<T: Reconnect>(server: &Arc<T>, reason: String) {
    let health = server.health();
    if health.mark_down(reason) {
        let why = format!(
            "Redis at {} went down ({}) while this caller waited in line, so it left the line \
             for the outage policy to decide; a background probe reconnects by itself",
            health.label,
            lock(&health.state).reason
        );
        server.went_down(why);
    }
    probe(server, FIRST_PAUSE);
}

/// Starts a server that was never reached: down, with a probe trying now.
pub(in crate::backend) fn start<T: Reconnect>(server: &Arc<T>) {
    probe(server, Duration::ZERO);
}

/// An error that says the server cannot be reached now.
pub(in crate::backend) fn is_outage(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() || e.is_timeout()
}

/// Spawns the probe unless one runs, on the current tokio runtime (none: the next call that
/// finds the server down tries again).
fn probe<T: Reconnect>(server: &Arc<T>, first: Duration) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let Some(id) = server.health().claim_probe() else {
        return;
    };
    let guard = ProbeGuard {
        server: Arc::downgrade(server),
        id,
    };
    runtime.spawn(run(guard, first));
}

/// Frees the probe role when the task ends, finished or dropped with its runtime.
struct ProbeGuard<T: Reconnect> {
    server: Weak<T>,
    id: u64,
}

impl<T: Reconnect> Drop for ProbeGuard<T> {
    fn drop(&mut self) {
        if let Some(server) = self.server.upgrade() {
            server.health().release_probe(self.id);
        }
    }
}

async fn run<T: Reconnect>(guard: ProbeGuard<T>, first: Duration) {
    let Some(kick) = guard
        .server
        .upgrade()
        .map(|server| server.health().kicker())
    else {
        return;
    };
    let (mut pause, mut kicked) = (first, false);
    loop {
        if !pause.is_zero() {
            tokio::select! {
                _ = tokio::time::sleep(pause.mul_f64(0.5 + fastrand::f64() / 2.0)) => {}
                _ = kick.notified() => (pause, kicked) = (Duration::ZERO, true),
            }
        }
        pause = (pause * 2).clamp(FIRST_PAUSE, MAX_PAUSE);
        let Some(server) = guard.server.upgrade() else {
            return;
        };
        let health = server.health();
        if !health.beat(guard.id) {
            return;
        }
        // News that the server may answer now (a new Sentinel master) ends a hopeless attempt
        // on the old one, and the next starts at once; that one runs to its end, so news that
        // keeps coming cannot spin the probe.
        let attempt = tokio::time::timeout(health.bound, server.attempt());
        let attempt = if kicked {
            kicked = false;
            attempt.await
        } else {
            tokio::select! {
                attempt = attempt => attempt,
                _ = kick.notified() => {
                    (pause, kicked) = (Duration::ZERO, true);
                    continue;
                }
            }
        };
        match attempt {
            Ok(Ok(())) => {
                if health.mark_up(guard.id) {
                    server.reconnected();
                }
                return;
            }
            Ok(Err(e)) => {
                if let Some(problem) = access_problem(&e) {
                    health.deny(&problem);
                }
                health.note(short(&e));
            }
            Err(_) => health.note(format!("no answer within {:?}", health.bound)),
        }
    }
}

#[cfg(feature = "metrics")]
fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        describe_gauge!(
            "dlimit_backend_up",
            Unit::Count,
            "1 while the Redis server (label backend) answers, 0 while it is down (summed over this process's backends connected to it)"
        );
        describe_gauge!(
            "dlimit_backend_denied",
            Unit::Count,
            "1 while the Redis server (label backend) refuses this process's credentials or permissions, a configuration error, not an outage (summed over this process's backends connected to it)"
        );
        describe_counter!(
            "dlimit_backend_fast_failures_total",
            Unit::Count,
            "calls refused at once because their Redis server was down"
        );
    });
}
