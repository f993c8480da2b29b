//! Classes inside one limit: a request's [`Priority`], and the [`Share`] of the limit a class
//! is given ([`Classes`], a semaphore's setting).

use std::fmt;

use crate::Error;

/// How urgent a request is: the line serves a higher class first, and inside a class in
/// arrival order. Eight levels, 0 (lowest) to 7; [`NORMAL`](Self::NORMAL) is the default.
///
/// # Examples
///
/// ```
/// use tower_distributed_limit::Priority;
///
/// assert!(Priority::CRITICAL > Priority::NORMAL && Priority::NORMAL > Priority::BATCH);
/// assert_eq!(Priority::default(), Priority::NORMAL);
/// assert_eq!(Priority::new(9), Priority::new(7)); // levels above 7 are 7
/// assert_eq!(Priority::CRITICAL.to_string(), "critical");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Priority(u8);

impl Priority {
    /// Interactive traffic that must keep its slots through any spike.
    pub const CRITICAL: Priority = Priority(6);
    /// The default.
    pub const NORMAL: Priority = Priority(4);
    /// Background work: served when no higher class waits.
    pub const BATCH: Priority = Priority(2);
    /// The highest level.
    pub const MAX: u8 = 7;

    /// The class of `level` (0 ..= 7; a higher level is served first; above 7 counts as 7).
    pub const fn new(level: u8) -> Self {
        Priority(if level > Self::MAX { Self::MAX } else { level })
    }

    /// Its level, 0 ..= 7.
    pub const fn level(self) -> u8 {
        self.0
    }
}

impl Default for Priority {
    fn default() -> Self {
        Priority::NORMAL
    }
}

/// `critical`, `normal`, `batch`, or `level-<n>`: the `class` label of metrics.
impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Priority::CRITICAL => f.write_str("critical"),
            Priority::NORMAL => f.write_str("normal"),
            Priority::BATCH => f.write_str("batch"),
            Priority(level) => write!(f, "level-{level}"),
        }
    }
}

/// What part of the limit a class is given, with
/// [`SemaphoreBuilder::class`](crate::SemaphoreBuilder::class). A class without one shares the
/// pool with every other class.
///
/// # Examples
///
/// ```
/// use tower_distributed_limit::{MemoryBackend, Priority, Semaphore, Share};
///
/// let sem = Semaphore::builder("gpu")
///     .limit(100)
///     .class(Priority::CRITICAL, Share::reserved(30)) // 30 slots no other class may take
///     .class(Priority::BATCH, Share::at_most(60))     // BATCH never holds more than 60
///     .build(MemoryBackend::new())?;
/// # let _ = sem;
/// # Ok::<(), tower_distributed_limit::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share(ShareKind);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ShareKind {
    Reserved(u32),
    AtMost(u32),
}

impl Share {
    /// `n` permits only this class may take; it may hold more from the shared pool.
    pub const fn reserved(n: u32) -> Self {
        Share(ShareKind::Reserved(n))
    }

    /// This class never holds more than `n` permits at once.
    pub const fn at_most(n: u32) -> Self {
        Share(ShareKind::AtMost(n))
    }
}

/// Whether a request fits now, as [`Classes::room`] finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Room {
    Fits,
    /// Its class holds all it may (`at_most`): the other classes are not held up by it.
    Capped,
    /// Its tenant holds all it may (`per_tenant`): its class's other tenants are not held up.
    TenantCapped,
    /// The pool the reservations leave is full: lower classes wait behind it (but for their
    /// own reservations).
    Full,
}

/// The classes of one semaphore: what each level reserves and may hold at most. Public only in
/// name, so the sealed `Open` trait can take it; nothing outside the crate can reach it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Classes {
    reserved: [u32; 8],
    at_most: [Option<u32>; 8],
    /// What each tenant may hold (`SemaphoreBuilder::per_tenant`); checked at build.
    per_tenant: Option<Share>,
}

impl Classes {
    pub(crate) fn set(&mut self, priority: Priority, share: Share) {
        let level = usize::from(priority.level());
        match share.0 {
            ShareKind::Reserved(n) => self.reserved[level] = n,
            ShareKind::AtMost(n) => self.at_most[level] = Some(n),
        }
    }

    pub(crate) fn set_tenant(&mut self, share: Share) {
        self.per_tenant = Some(share);
    }

    /// Whether any class or tenant has a share (else every class shares the whole limit).
    pub(crate) fn any(&self) -> bool {
        self.reserved.iter().any(|&n| n > 0)
            || self.at_most.iter().any(Option::is_some)
            || self.per_tenant.is_some()
    }

    /// The most one tenant may hold at once.
    pub(crate) fn tenant_cap(&self) -> Option<u32> {
        match self.per_tenant?.0 {
            ShareKind::AtMost(n) => Some(n),
            ShareKind::Reserved(_) => None,
        }
    }

    pub(crate) fn reserved(&self, priority: Priority) -> u32 {
        self.reserved[usize::from(priority.level())]
    }

    pub(crate) fn at_most(&self, priority: Priority) -> Option<u32> {
        self.at_most[usize::from(priority.level())]
    }

    /// Every reservation together.
    pub(crate) fn reserved_total(&self) -> u64 {
        self.reserved.iter().map(|&n| u64::from(n)).sum()
    }

    /// The most a request of `priority` (of a tenant, if `tenant`) may ever hold under
    /// `limit`: its class's cap, its tenant's, and the limit less what the other classes
    /// reserve.
    pub(crate) fn most(&self, priority: Priority, tenant: bool, limit: u32) -> u32 {
        let others = self.reserved_total() - u64::from(self.reserved(priority));
        let pool = u64::from(limit).saturating_sub(others);
        let mut most = u32::try_from(pool).unwrap_or(u32::MAX);
        if let Some(cap) = self.at_most(priority) {
            most = most.min(cap);
        }
        match self.tenant_cap() {
            Some(cap) if tenant => most.min(cap),
            _ => most,
        }
    }

    /// Whether one request of `priority` holding `weight` fits beside what is held: `used`
    /// in all, `held[level]` by each class, and `tenant` by its tenant (if it has one).
    pub(crate) fn room(
        &self,
        priority: Priority,
        weight: u32,
        used: u32,
        held: &[u32; 8],
        tenant: Option<u32>,
        limit: u32,
    ) -> Room {
        if let (Some(held), Some(cap)) = (tenant, self.tenant_cap())
            && u64::from(held) + u64::from(weight) > u64::from(cap)
        {
            return Room::TenantCapped;
        }
        let level = usize::from(priority.level());
        let mine = u64::from(held[level]) + u64::from(weight);
        if self.at_most[level].is_some_and(|cap| mine > u64::from(cap)) {
            return Room::Capped;
        }
        // What the other classes reserve and do not hold yet stays free for them.
        let kept: u64 = (0..8)
            .filter(|&other| other != level)
            .map(|other| u64::from(self.reserved[other].saturating_sub(held[other])))
            .sum();
        if u64::from(used) + u64::from(weight) + kept <= u64::from(limit) {
            Room::Fits
        } else {
            Room::Full
        }
    }

    /// Whether `weight` more stays inside the class's own reservation.
    pub(crate) fn within_reservation(
        &self,
        priority: Priority,
        weight: u32,
        held: &[u32; 8],
    ) -> bool {
        let level = usize::from(priority.level());
        u64::from(held[level]) + u64::from(weight) <= u64::from(self.reserved[level])
    }

    /// Checks the shares against `limit` (`semaphore` names it in the error).
    pub(crate) fn check(&self, semaphore: &str, limit: u32) -> Result<(), Error> {
        if self.reserved_total() > u64::from(limit) {
            return Err(Error::config(format!(
                "semaphore {semaphore:?}: its classes reserve {} permits, more than its limit \
                 {limit}; reserve at most the limit",
                self.reserved_total()
            )));
        }
        match self.per_tenant.map(|share| share.0) {
            Some(ShareKind::Reserved(_)) => {
                return Err(Error::config(format!(
                    "semaphore {semaphore:?}: a tenant cannot reserve permits (tenants are \
                     request data, without bound); give per_tenant a Share::at_most"
                )));
            }
            Some(ShareKind::AtMost(0)) => {
                return Err(Error::config(format!(
                    "semaphore {semaphore:?}: each tenant may hold at most 0 permits, which \
                     admits none; give per_tenant at least 1"
                )));
            }
            _ => {}
        }
        for level in 0..=Priority::MAX {
            let priority = Priority::new(level);
            if self.at_most(priority) == Some(0) {
                return Err(Error::config(format!(
                    "semaphore {semaphore:?}: class {priority} may hold at most 0 permits, which \
                     admits none of it; give it at least 1"
                )));
            }
            if self
                .at_most(priority)
                .is_some_and(|cap| cap < self.reserved(priority))
            {
                return Err(Error::config(format!(
                    "semaphore {semaphore:?}: class {priority} reserves more than it may hold; \
                     make its at_most at least its reservation"
                )));
            }
        }
        Ok(())
    }

    /// The shares as the Redis script reads them: `<level>r<n>` and `<level>m<n>`, then
    /// `tm<n>` for the per-tenant cap, joined by commas (empty without shares).
    pub(crate) fn encode(&self) -> String {
        let mut parts = Vec::new();
        for level in 0..8 {
            if self.reserved[level] > 0 {
                parts.push(format!("{level}r{}", self.reserved[level]));
            }
            if let Some(cap) = self.at_most[level] {
                parts.push(format!("{level}m{cap}"));
            }
        }
        if let Some(cap) = self.tenant_cap() {
            parts.push(format!("tm{cap}"));
        }
        parts.join(",")
    }

    /// The shares [`encode`](Self::encode) wrote (as stored with a semaphore); parts it does
    /// not know are skipped.
    pub(crate) fn decode(text: &str) -> Self {
        let mut classes = Classes::default();
        for part in text.split(',') {
            // Bytes: a stored text is not trusted to split at a character boundary.
            let (head, n) = part.as_bytes().split_at(part.len().min(2));
            let n = std::str::from_utf8(n).ok().and_then(|n| n.parse().ok());
            let (Some(n), [level, kind]) = (n, head) else {
                continue;
            };
            let share = match kind {
                b'r' => Share::reserved(n),
                b'm' => Share::at_most(n),
                _ => continue,
            };
            match level {
                b't' => classes.set_tenant(share),
                b'0'..=b'7' => classes.set(Priority::new(level - b'0'), share),
                _ => {}
            }
        }
        classes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu() -> Classes {
        let mut classes = Classes::default();
        classes.set(Priority::CRITICAL, Share::reserved(30));
        classes.set(Priority::BATCH, Share::at_most(60));
        classes
    }

    #[test]
    fn a_reservation_is_never_lent_and_a_cap_never_passed() {
        let classes = gpu();
        let mut held = [0; 8];
        // (class, weight, used, BATCH holds, what it finds): 70 free for everyone else while
        // CRITICAL holds nothing; BATCH at its cap holds up nobody else.
        let cases = [
            (Priority::NORMAL, 70, 0, 0, Room::Fits),
            (Priority::NORMAL, 71, 0, 0, Room::Full),
            (Priority::CRITICAL, 100, 0, 0, Room::Fits),
            (Priority::BATCH, 1, 60, 60, Room::Capped),
            (Priority::NORMAL, 10, 60, 60, Room::Fits),
            (Priority::NORMAL, 11, 60, 60, Room::Full),
        ];
        for (class, weight, used, batch, room) in cases {
            held[usize::from(Priority::BATCH.level())] = batch;
            assert_eq!(
                classes.room(class, weight, used, &held, None, 100),
                room,
                "{class} {weight}"
            );
        }
        assert!(classes.within_reservation(Priority::CRITICAL, 30, &held));
        assert!(!classes.within_reservation(Priority::CRITICAL, 31, &held));
        assert_eq!(classes.most(Priority::BATCH, false, 100), 60);
        assert_eq!(classes.most(Priority::NORMAL, false, 100), 70);
        assert_eq!(classes.encode(), "2m60,6r30");
    }

    #[test]
    fn a_tenant_never_passes_its_cap_and_holds_up_nobody() {
        let mut classes = gpu();
        classes.set_tenant(Share::at_most(10));
        let held = [0; 8];
        let room = |tenant, weight| classes.room(Priority::NORMAL, weight, 0, &held, tenant, 100);
        assert_eq!(room(Some(9), 1), Room::Fits);
        assert_eq!(room(Some(10), 1), Room::TenantCapped);
        // Without a tenant, the cap does not apply.
        assert_eq!(room(None, 20), Room::Fits);
        assert_eq!(classes.most(Priority::NORMAL, true, 100), 10);
        assert_eq!(classes.most(Priority::NORMAL, false, 100), 70);
        assert_eq!(classes.encode(), "2m60,6r30,tm10");
        assert_eq!(Classes::decode(&classes.encode()), classes);
        assert_eq!(Classes::decode("junk,9r1,,6x2,a€"), Classes::default());
        classes.set_tenant(Share::reserved(1));
        assert!(classes.check("gpu", 100).is_err());
        classes.set_tenant(Share::at_most(0));
        assert!(classes.check("gpu", 100).is_err());
    }

    #[test]
    fn shares_that_cannot_hold_are_refused() {
        assert!(gpu().check("gpu", 30).is_ok());
        assert!(matches!(gpu().check("gpu", 29), Err(Error::Config(_))));
        let mut zero = Classes::default();
        zero.set(Priority::BATCH, Share::at_most(0));
        assert!(zero.check("gpu", 10).is_err());
        let mut under = gpu();
        under.set(Priority::CRITICAL, Share::at_most(10));
        assert!(under.check("gpu", 100).is_err());
    }
}
