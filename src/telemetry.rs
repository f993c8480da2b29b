//! What the crate reports through the [`metrics`](https://docs.rs/metrics) facade (feature
//! `metrics`, on by default; no exporter is chosen here). Every metric of a semaphore carries the
//! label `semaphore`: the semaphore's name, or a partition set's name for its per-key
//! semaphores, so the number of series stays bounded whatever the requests carry. The two
//! backend metrics (registered in `backend/health.rs`) carry `backend`, a server's address.
//!
//! | name | kind | labels / meaning |
//! |---|---|---|
//! | `dlimit_acquire_total` | counter | `result` = `acquired` \| `timeout` \| `rejected` \| `backend_error` \| `degraded` \| `too_many_waiters`; `class` = the request's class (`critical`, `normal`, `batch`, `level-<n>`: eight at most, never a tenant) |
//! | `dlimit_acquire_wait_seconds` | histogram | time from asking to holding (acquired ones); `class` as above |
//! | `dlimit_permit_hold_seconds` | histogram | time from granted to released |
//! | `dlimit_permits_held` | gauge | weight this process holds now |
//! | `dlimit_waiters` | gauge | this process's waiters now |
//! | `dlimit_lease_lost_total` | counter | permits whose lease was lost |
//! | `dlimit_backend_errors_total` | counter | `op` = the backend operation |
//! | `dlimit_backend_up` | gauge | label `backend` (the server's address), not `semaphore`: 1 while this process's backend to it is up, 0 while down (summed over the process's backends to that server) |
//! | `dlimit_backend_fast_failures_total` | counter | label `backend`: calls refused at once because their server was down |
//! | `dlimit_rate_decisions_total` | counter | label `limiter` (its name; never a partition key), `result` = `allowed` \| `limited` \| `degraded` (decided by the outage policy) \| `backend_error` (refused by it) |
//! | `dlimit_rate_remaining` | gauge | label `limiter`: what its last decision on the limiter itself (not a partition key's) left |
//! | `dlimit_rate_retry_after_seconds` | histogram | label `limiter`: the wait each refusal asked for |
//!
//! Without the feature, or without a recorder installed, each report costs next to nothing.

use std::time::Duration;

use crate::Priority;
use crate::backend::RateDecision;

/// The reports of one semaphore (cheap to clone). Its metric handles are registered once,
/// with the recorder installed when the semaphore is built: install a recorder before building
/// semaphores.
#[derive(Clone, Debug)]
pub(crate) struct Telemetry {
    #[cfg(feature = "metrics")]
    handles: std::sync::Arc<Handles>,
}

#[cfg(feature = "metrics")]
#[derive(Debug)]
struct Handles {
    semaphore: metrics::SharedString,
    /// Each class's, by level, registered when the class is first seen (NORMAL at once).
    classes: [std::sync::OnceLock<ClassHandles>; 8],
    hold: metrics::Histogram,
    held: metrics::Gauge,
    waiters: metrics::Gauge,
    limit: metrics::Gauge,
    lease_lost: metrics::Counter,
    /// `dlimit_backend_errors_total`, one per operation, in `OPS` order.
    backend_errors: [metrics::Counter; 4],
}

/// The metrics of one class of a semaphore.
#[cfg(feature = "metrics")]
#[derive(Debug)]
struct ClassHandles {
    /// `dlimit_acquire_total`, one per result, in `Outcome` order.
    acquired: [metrics::Counter; 6],
    wait: metrics::Histogram,
}

#[cfg(feature = "metrics")]
impl Handles {
    fn class(&self, class: Priority) -> &ClassHandles {
        self.classes[usize::from(class.level())].get_or_init(|| {
            let (semaphore, class) = (self.semaphore.clone(), class.to_string());
            ClassHandles {
                acquired: OUTCOMES.map(|result| {
                    metrics::counter!("dlimit_acquire_total", "semaphore" => semaphore.clone(), "result" => result, "class" => class.clone())
                }),
                wait: metrics::histogram!("dlimit_acquire_wait_seconds", "semaphore" => semaphore.clone(), "class" => class.clone()),
            }
        })
    }
}

/// The backend operations `dlimit_backend_errors_total` tells apart.
#[cfg(feature = "metrics")]
const OPS: [&str; 4] = ["acquire", "release", "renew", "used"];

/// The reports of one rate limiter (cheap to clone), registered like a semaphore's.
#[derive(Clone, Debug)]
pub(crate) struct RateTelemetry {
    #[cfg(feature = "metrics")]
    handles: std::sync::Arc<RateHandles>,
}

#[cfg(feature = "metrics")]
#[derive(Debug)]
struct RateHandles {
    /// `dlimit_rate_decisions_total`, one per result, in `RATE_RESULTS` order.
    decisions: [metrics::Counter; 4],
    remaining: metrics::Gauge,
    retry_after: metrics::Histogram,
}

#[cfg(feature = "metrics")]
const RATE_RESULTS: [&str; 4] = ["allowed", "limited", "degraded", "backend_error"];

impl RateTelemetry {
    /// Reports for the rate limiter called `name`.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn new(name: &str) -> Self {
        #[cfg(feature = "metrics")]
        {
            describe();
            let limiter = metrics::SharedString::from(name.to_owned());
            let label = || limiter.clone();
            RateTelemetry {
                handles: std::sync::Arc::new(RateHandles {
                    decisions: RATE_RESULTS.map(|result| {
                        metrics::counter!("dlimit_rate_decisions_total", "limiter" => label(), "result" => result)
                    }),
                    remaining: metrics::gauge!("dlimit_rate_remaining", "limiter" => label()),
                    retry_after: metrics::histogram!("dlimit_rate_retry_after_seconds", "limiter" => label()),
                }),
            }
        }
        #[cfg(not(feature = "metrics"))]
        RateTelemetry {}
    }

    /// A decision: on the limiter itself (`keyed` false) it also sets the remaining gauge.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn decided(&self, decision: &RateDecision, keyed: bool) {
        #[cfg(feature = "metrics")]
        {
            let result = match (decision.degraded, decision.allowed) {
                (true, _) => 2,
                (false, true) => 0,
                (false, false) => 1,
            };
            self.handles.decisions[result].increment(1);
            if let Some(after) = decision.retry_after {
                self.handles.retry_after.record(after.as_secs_f64());
            }
            if !keyed {
                self.handles.remaining.set(f64::from(decision.remaining));
            }
        }
    }

    /// The backend failed and the outage policy refused.
    pub(crate) fn backend_error(&self) {
        #[cfg(feature = "metrics")]
        self.handles.decisions[3].increment(1);
    }
}

/// How an acquisition ended, as `dlimit_acquire_total` counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Acquired,
    Degraded,
    Timeout,
    Rejected,
    BackendError,
    TooManyWaiters,
}

impl Outcome {
    /// Its word in `dlimit_acquire_total` and in the acquire span.
    pub(crate) fn as_str(self) -> &'static str {
        OUTCOMES[self as usize]
    }
}

const OUTCOMES: [&str; 6] = [
    "acquired",
    "degraded",
    "timeout",
    "rejected",
    "backend_error",
    "too_many_waiters",
];

/// A backend operation whose failures are counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    Acquire,
    Release,
    Renew,
    Used,
}

impl Telemetry {
    /// Reports for the semaphore (or partition set) called `label`.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn new(label: &str) -> Self {
        #[cfg(feature = "metrics")]
        {
            describe();
            let semaphore = metrics::SharedString::from(label.to_owned());
            let label = || semaphore.clone();
            let handles = Handles {
                semaphore: label(),
                classes: Default::default(),
                    hold: metrics::histogram!("dlimit_permit_hold_seconds", "semaphore" => label()),
                    held: metrics::gauge!("dlimit_permits_held", "semaphore" => label()),
                    waiters: metrics::gauge!("dlimit_waiters", "semaphore" => label()),
                    limit: metrics::gauge!("dlimit_limit", "semaphore" => label()),
                    lease_lost: metrics::counter!("dlimit_lease_lost_total", "semaphore" => label()),
                    backend_errors: OPS.map(|op| {
                        metrics::counter!("dlimit_backend_errors_total", "semaphore" => label(), "op" => op)
                    }),
            };
            handles.class(Priority::NORMAL);
            Telemetry {
                handles: std::sync::Arc::new(handles),
            }
        }
        #[cfg(not(feature = "metrics"))]
        Telemetry {}
    }

    /// An acquire or try_acquire of `class` ended; `wait` counts for the acquired ones.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn acquire(&self, class: Priority, outcome: Outcome, wait: Duration) {
        #[cfg(feature = "metrics")]
        {
            let handles = self.handles.class(class);
            handles.acquired[outcome as usize].increment(1);
            if matches!(outcome, Outcome::Acquired | Outcome::Degraded) {
                handles.wait.record(wait.as_secs_f64());
            }
        }
    }

    /// A permit of `weight` was granted (`true`) or given back after `held` (`false`).
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn holding(&self, weight: u32, granted: bool, held: Duration) {
        #[cfg(feature = "metrics")]
        if granted {
            self.handles.held.increment(f64::from(weight));
        } else {
            self.handles.held.decrement(f64::from(weight));
            self.handles.hold.record(held.as_secs_f64());
        }
    }

    /// A waiter joined (`true`) or left (`false`).
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn waiting(&self, joined: bool) {
        #[cfg(feature = "metrics")]
        if joined {
            self.handles.waiters.increment(1.0);
        } else {
            self.handles.waiters.decrement(1.0);
        }
    }

    /// The limit in force, as the last reply said (it moves when the limit adapts).
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn limit(&self, limit: u32) {
        #[cfg(feature = "metrics")]
        self.handles.limit.set(f64::from(limit));
    }

    /// A permit's lease was lost.
    pub(crate) fn lease_lost(&self) {
        #[cfg(feature = "metrics")]
        self.handles.lease_lost.increment(1);
    }

    /// A backend call `op` failed.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn backend_error(&self, op: Op) {
        #[cfg(feature = "metrics")]
        self.handles.backend_errors[op as usize].increment(1);
    }
}

/// Describes every metric once, with its unit, for the recorder installed at the time.
#[cfg(feature = "metrics")]
fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        describe_counter!(
            "dlimit_acquire_total",
            Unit::Count,
            "acquisitions by result: acquired, timeout, rejected, backend_error, degraded, too_many_waiters"
        );
        describe_histogram!(
            "dlimit_acquire_wait_seconds",
            Unit::Seconds,
            "time from asking for a permit to holding it"
        );
        describe_histogram!(
            "dlimit_permit_hold_seconds",
            Unit::Seconds,
            "time from a permit's grant to its release"
        );
        describe_gauge!(
            "dlimit_permits_held",
            Unit::Count,
            "weight of the permits this process holds"
        );
        describe_gauge!("dlimit_waiters", Unit::Count, "this process's waiters");
        describe_gauge!(
            "dlimit_limit",
            Unit::Count,
            "the limit in force for every process, as this process last heard (an adaptive \
             limit moves)"
        );
        describe_counter!(
            "dlimit_lease_lost_total",
            Unit::Count,
            "permits whose lease was lost"
        );
        describe_counter!(
            "dlimit_backend_errors_total",
            Unit::Count,
            "failed backend calls, by operation"
        );
        describe_counter!(
            "dlimit_rate_decisions_total",
            Unit::Count,
            "rate limit decisions by result: allowed, limited, degraded, backend_error"
        );
        describe_gauge!(
            "dlimit_rate_remaining",
            Unit::Count,
            "what the rate limiter's last decision left (requests of cost 1)"
        );
        describe_histogram!(
            "dlimit_rate_retry_after_seconds",
            Unit::Seconds,
            "the wait each rate limit refusal asked for"
        );
    });
}
