//! An adaptive limit: the limit every process admits by, found from how long permits are held,
//! and changed by the store that grants them, in the same atomic step as the releases that
//! carry the samples.
//!
//! The algorithm is a gradient, as in Netflix's Gradient2 and Envoy's adaptive concurrency
//! filter, run once per window of releases (at least [`WINDOW`] and [`MIN_SAMPLES`]):
//!
//! ```text
//! latency   = the window's mean hold time
//! no_load   = min(latency, no_load + (latency - no_load) * DRIFT)   // may drift up, slowly
//! gradient  = clamp(TOLERANCE * no_load / latency, 0.5, 1)
//! target    = limit * gradient + sqrt(limit) / 3                     // probe headroom
//!             (a whole sqrt(limit) while gradient = 1: nothing queues downstream)
//!           | limit * BACKOFF                      if a hold was marked overloaded
//!           | min(target, limit)                   if in flight stayed under half the limit
//! limit     = clamp(limit * (1 - SMOOTHING) + target * SMOOTHING, min, max)
//! ```
//!
//! When the limit is above what the downstream can serve at once, its requests queue there,
//! `latency / no_load` is about `limit / capacity`, and the target is about `TOLERANCE ×
//! capacity` plus the headroom; below it, latency stays at the no-load level and the limit grows
//! by the headroom each window. The Redis script (`lua/semaphore/adapt.lua`) runs the same
//! steps on the server's clock; this file is the in-process copy, and the one unit-tested.

use std::time::Duration;

use crate::Error;

/// The shortest window of samples the limit is recomputed from.
pub(crate) const WINDOW: Duration = Duration::from_millis(100);
/// The fewest samples a window needs before the limit is recomputed.
pub(crate) const MIN_SAMPLES: u32 = 10;
/// How far a window's target moves the limit.
const SMOOTHING: f64 = 0.5;
/// How much slower than the no-load latency a window may be before the limit comes down.
const TOLERANCE: f64 = 1.05;
/// How fast the no-load latency follows a window slower than it (per window): slowly, so a
/// downstream that became slower for good is learnt in a minute or so, while an overload the
/// limit is correcting moves it little.
const DRIFT: f64 = 0.001;
/// The multiplicative decrease on a window with an overloaded hold.
const BACKOFF: f64 = 0.9;
/// How often the no-load latency is measured again, with the limit lowered ([`Probe`]).
pub(crate) const PROBE_EVERY: u64 = 30_000;
/// The limit while probing, as a share of the limit before.
const PROBE_SHARE: f64 = 0.5;
/// Windows a probe lasts; the first (holds admitted before it) is not measured.
const PROBE_WINDOWS: u32 = 3;
/// How far one probe may raise the no-load latency (a probe that still saw queueing, the limit
/// being over twice the capacity, must not pass it for the no-load).
const PROBE_RAISE: f64 = 1.25;

/// How a semaphore's limit adapts: the limit in force is found from the hold times of its
/// permits across every process, within `min ..= max`, starting at `initial`. Pass it to
/// [`SemaphoreBuilder::adaptive`](crate::SemaphoreBuilder::adaptive) instead of a fixed limit.
///
/// A permit's hold time (grant to release) is its latency sample;
/// [`Permit::mark_overloaded`](crate::Permit::mark_overloaded) marks a hold whose request was dropped or
/// timed out downstream, which lowers the limit by a tenth. The limit is stored and changed
/// with the semaphore's state, by the same atomic call that takes the release, so every
/// process admits by the same limit at every instant and the fleet's in-flight never exceeds
/// it; lowering it takes nothing from the current holders (new grants wait until the used
/// weight fits under it).
///
/// The algorithm, its constants and its anchors are in the crate's `docs/adaptive.md`.
///
/// # Examples
///
/// ```
/// use tower_distributed_limit::{AdaptiveLimit, MemoryBackend, Semaphore};
///
/// let sem = Semaphore::builder("db")
///     .adaptive(AdaptiveLimit::new().initial(20).min(2).max(500))
///     .build(MemoryBackend::new())?;
/// assert_eq!(sem.limit(), 20); // the initial limit, until samples move it
/// # Ok::<(), tower_distributed_limit::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdaptiveLimit {
    pub(crate) initial: u32,
    pub(crate) min: u32,
    pub(crate) max: u32,
}

impl Default for AdaptiveLimit {
    fn default() -> Self {
        Self::new()
    }
}

impl AdaptiveLimit {
    /// Starts at 20, within 1 ..= 1000.
    pub fn new() -> Self {
        AdaptiveLimit {
            initial: 20,
            min: 1,
            max: 1000,
        }
    }

    /// The limit before any sample (default 20), within `min ..= max`.
    pub fn initial(mut self, limit: u32) -> Self {
        self.initial = limit;
        self
    }

    /// The lowest the limit goes (default 1, at least 1).
    pub fn min(mut self, limit: u32) -> Self {
        self.min = limit;
        self
    }

    /// The highest the limit goes (default 1000).
    pub fn max(mut self, limit: u32) -> Self {
        self.max = limit;
        self
    }

    /// Checks `1 <= min <= initial <= max` for the semaphore `name`.
    pub(crate) fn check(&self, name: &str) -> Result<(), Error> {
        let AdaptiveLimit { initial, min, max } = *self;
        if min == 0 || min > max || initial < min || initial > max {
            return Err(Error::config(format!(
                "semaphore {name:?}: adaptive limit initial {initial}, min {min}, max {max}; it \
                 needs 1 <= min <= initial <= max"
            )));
        }
        Ok(())
    }
}

/// The adaptive state of one semaphore in a store: the limit (unrounded), the no-load latency,
/// and the window being collected.
#[derive(Debug, Clone)]
pub(crate) struct Gradient {
    bounds: AdaptiveLimit,
    limit: f64,
    /// The no-load latency (ms), once a window was seen.
    no_load: Option<f64>,
    window: Window,
    /// When the next probe starts (ms on the store's clock), once a window was seen.
    next_probe: Option<u64>,
    probe: Option<Probe>,
}

/// A probe under way: the limit lowered to [`PROBE_SHARE`] of `saved` for [`PROBE_WINDOWS`]
/// windows, so nothing queues downstream and the windows' latency is the no-load latency as
/// it is now (a minimum seen once may have been luck, or the downstream got slower).
#[derive(Debug, Clone)]
struct Probe {
    saved: f64,
    windows: u32,
    lowest: f64,
}

#[derive(Debug, Clone, Default)]
struct Window {
    /// When the window started (ms on the store's clock), once it has a sample.
    start: Option<u64>,
    samples: u32,
    /// Sum of the hold times (ms).
    total: f64,
    /// The most in flight (weight held) seen at a release.
    peak: u32,
    overloaded: bool,
}

impl Gradient {
    pub(crate) fn new(bounds: AdaptiveLimit) -> Self {
        Gradient {
            bounds,
            limit: f64::from(bounds.initial),
            no_load: None,
            window: Window::default(),
            next_probe: None,
            probe: None,
        }
    }

    /// The limit in force.
    pub(crate) fn limit(&self) -> u32 {
        // In min ..= max (both u32) by construction, so the cast is exact.
        self.limit.round() as u32
    }

    /// `count` releases at `now_ms` (holds that ended in a prefetch are told together;
    /// else one): each permit was held `mean_ms` on average, `in_flight` was held just before
    /// (their own weight included), and whether a request was overloaded. Closes the window
    /// when it is long and full enough; returns the limit in force.
    pub(crate) fn samples(
        &mut self,
        now_ms: u64,
        count: u32,
        mean_ms: f64,
        in_flight: u32,
        overloaded: bool,
    ) -> u32 {
        let window = &mut self.window;
        let start = *window.start.get_or_insert(now_ms);
        window.samples += count;
        window.total += mean_ms.max(0.0) * f64::from(count);
        window.peak = window.peak.max(in_flight);
        window.overloaded |= overloaded;
        if now_ms.saturating_sub(start) >= WINDOW.as_millis() as u64
            && window.samples >= MIN_SAMPLES
        {
            let window = std::mem::take(&mut self.window);
            self.close(&window, now_ms);
        }
        self.limit()
    }

    fn close(&mut self, window: &Window, now_ms: u64) {
        let latency = (window.total / f64::from(window.samples)).max(0.001);
        if let Some(probe) = &mut self.probe {
            probe.windows += 1;
            if probe.windows > 1 {
                probe.lowest = probe.lowest.min(latency);
            }
            if probe.windows >= PROBE_WINDOWS {
                let before = self.no_load.unwrap_or(probe.lowest);
                self.no_load = Some(probe.lowest.min(before * PROBE_RAISE));
                self.limit = probe.saved;
                self.probe = None;
                self.next_probe = Some(now_ms + PROBE_EVERY);
            }
            return;
        }
        let no_load = match self.no_load {
            Some(no_load) if latency > no_load => no_load + (latency - no_load) * DRIFT,
            _ => latency,
        };
        self.no_load = Some(no_load);
        let limit = self.limit;
        let target = if window.overloaded {
            limit * BACKOFF
        } else {
            let gradient = (TOLERANCE * no_load / latency).clamp(0.5, 1.0);
            // No queueing seen: probe with a whole √limit (fast growth after the downstream
            // got room); queueing: a third of it (where the limit settles above capacity).
            let headroom = if gradient < 1.0 {
                limit.sqrt() / 3.0
            } else {
                limit.sqrt()
            };
            let target = limit * gradient + headroom;
            if f64::from(window.peak) < limit / 2.0 {
                target.min(limit)
            } else {
                target
            }
        };
        let next = limit * (1.0 - SMOOTHING) + target * SMOOTHING;
        self.limit = next.clamp(f64::from(self.bounds.min), f64::from(self.bounds.max));
        let probe_at = *self.next_probe.get_or_insert(now_ms + PROBE_EVERY);
        // Only a busy limit is probed: under half of it in flight, nothing queues, and the
        // windows measure the no-load latency as they are.
        if now_ms >= probe_at && f64::from(window.peak) >= limit / 2.0 {
            self.probe = Some(Probe {
                saved: self.limit,
                windows: 0,
                lowest: f64::INFINITY,
            });
            self.limit = (self.limit * PROBE_SHARE).max(f64::from(self.bounds.min));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Windows of `samples` holds of `held_ms` each at `in_flight`, one window every
    /// [`WINDOW`]; the limit after them.
    fn run(g: &mut Gradient, now: &mut u64, windows: u32, held_ms: impl Fn(u32) -> f64) -> u32 {
        for _ in 0..windows {
            let limit = g.limit();
            for _ in 0..MIN_SAMPLES {
                g.samples(*now, 1, held_ms(limit), limit, false);
            }
            *now += WINDOW.as_millis() as u64;
        }
        g.limit()
    }

    /// A downstream that serves `capacity` at once in 10 ms and shares its workers beyond.
    fn downstream(capacity: u32) -> impl Fn(u32) -> f64 {
        move |in_flight| 10.0 * (f64::from(in_flight) / f64::from(capacity)).max(1.0)
    }

    #[test]
    fn the_limit_finds_the_capacity_from_above_and_below() {
        let mut g = Gradient::new(AdaptiveLimit::new().initial(20).min(2).max(500));
        let mut now = 0;
        let found = run(&mut g, &mut now, 100, downstream(40));
        assert!((40..=48).contains(&found), "{found} for a capacity of 40");
        let found = run(&mut g, &mut now, 100, downstream(120));
        assert!(
            (120..=138).contains(&found),
            "{found} for a capacity of 120"
        );
        let found = run(&mut g, &mut now, 100, downstream(40));
        assert!((40..=48).contains(&found), "{found} back at 40");
    }

    /// A no-load latency learnt too low (one lucky window) holds the limit under the capacity
    /// only until the probes have measured it again.
    #[test]
    fn a_no_load_learnt_too_low_is_measured_again() {
        let mut g = Gradient::new(AdaptiveLimit::new().initial(40).min(2).max(500));
        let mut now = 0;
        run(&mut g, &mut now, 1, |_| 6.0);
        let sunk = run(&mut g, &mut now, 50, downstream(40));
        assert!(
            sunk < 30,
            "{sunk}: under the capacity while the no-load is wrong"
        );
        run(&mut g, &mut now, 400, downstream(40));
        while g.probe.is_some() {
            run(&mut g, &mut now, 1, downstream(40));
        }
        let found = g.limit();
        assert!(
            (38..=48).contains(&found),
            "{found} for a capacity of 40, probed"
        );
    }

    /// A probe lowers the limit to half for three windows, every 30 s, then puts it back.
    #[test]
    fn a_probe_halves_the_limit_for_three_windows() {
        let mut g = Gradient::new(AdaptiveLimit::new().initial(40).min(2).max(500));
        let mut now = 0;
        let windows = (PROBE_EVERY / WINDOW.as_millis() as u64) as u32;
        let before = run(&mut g, &mut now, windows, downstream(40));
        let mut seen = Vec::new();
        for _ in 0..5 {
            seen.push(run(&mut g, &mut now, 1, downstream(40)));
        }
        let probing = seen.iter().filter(|&&l| l <= before / 2 + 1).count();
        assert_eq!(probing, 3, "{before} then {seen:?}");
        assert!(seen[4] >= before - 2, "{before} then {seen:?}: put back");
    }

    #[test]
    fn an_overloaded_hold_lowers_the_limit_by_a_tenth_per_window() {
        let mut g = Gradient::new(AdaptiveLimit::new().initial(100).min(2).max(500));
        let mut now = 0;
        for _ in 0..MIN_SAMPLES {
            g.samples(now, 1, 10.0, 100, false);
        }
        now += WINDOW.as_millis() as u64;
        g.samples(now, 1, 10.0, 100, true);
        // Half-way (smoothing) to 90 % of 100.
        assert_eq!(g.limit(), 95);
    }

    #[test]
    fn min_and_max_hold_under_any_sample() {
        let bounds = AdaptiveLimit::new().initial(10).min(5).max(12);
        let mut g = Gradient::new(bounds);
        let mut now = 0;
        assert_eq!(run(&mut g, &mut now, 50, |_| 10.0), 12, "capped by max");
        assert_eq!(run(&mut g, &mut now, 50, |_| 1e12), 5, "floored by min");
        for _ in 0..50 {
            g.samples(now, 1, f64::NAN.max(0.0), 12, true);
            now += 1000;
        }
        assert_eq!(g.limit(), 5);
    }

    #[test]
    fn a_limit_far_from_reached_does_not_grow() {
        let mut g = Gradient::new(AdaptiveLimit::new().initial(50).min(2).max(500));
        let mut now = 0;
        for _ in 0..50 {
            for _ in 0..MIN_SAMPLES {
                g.samples(now, 1, 10.0, 5, false);
            }
            now += WINDOW.as_millis() as u64;
        }
        assert_eq!(g.limit(), 50);
    }

    #[test]
    fn a_window_closes_only_when_long_and_full_enough() {
        let mut g = Gradient::new(AdaptiveLimit::new().initial(50).min(2).max(500));
        for i in 0..1000 {
            g.samples(i / 100, 1, 1000.0, 50, true);
        }
        assert_eq!(g.limit(), 50, "every sample within the first 10 ms");
        for _ in 0..MIN_SAMPLES - 1 {
            g.samples(5000, 1, 10.0, 50, false);
        }
        assert!(
            g.limit() < 50,
            "long enough and full: closed, with its overload"
        );
    }

    #[test]
    fn bad_bounds_are_config_errors() {
        for bounds in [
            AdaptiveLimit::new().min(0),
            AdaptiveLimit::new().min(30).max(20),
            AdaptiveLimit::new().initial(5).min(10),
            AdaptiveLimit::new().initial(2000),
        ] {
            assert!(
                matches!(bounds.check("db"), Err(Error::Config(_))),
                "{bounds:?}"
            );
        }
        assert!(AdaptiveLimit::new().check("db").is_ok());
    }
}
