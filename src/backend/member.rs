//! A member: one acquisition as every backend stores it, and its text both ways. Written by
//! [`Member::asking`] (`<id>[:c<level>][:t<16 hex>][:p]:<weight>:<lease ms>`, the id beginning
//! with this process's tag, [`process_tag`]) and read back by [`Member::read`] (for a
//! snapshot's holders); `docs/protocol.md` has the layout. It knows no backend and no
//! snapshot: both use it.

use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use crate::{Ask, Priority};

/// One acquisition's identity in a backend: `"<random id>:<weight>:<lease ms>"`, with
/// `:c<level>` after the id for a class other than [`Priority::NORMAL`], then `:t<16 hex>`
/// for a tenant, then `:p` for a slot a prefetching process may keep in its pool, so any
/// process that admits it from the line knows its class, tenant, weight and lease (and an
/// operator which holders are prefetched). Equal when the text is.
#[derive(Clone, Debug)]
pub(crate) struct Member {
    pub(crate) text: Arc<str>,
    pub(crate) weight: u32,
    pub(crate) lease: Duration,
    pub(crate) priority: Priority,
    pub(crate) tenant: Option<u64>,
    /// Its slot may go to this process's prefetch (`:p` in the text).
    pub(crate) prefetched: bool,
}

/// The random id's length: 128 bits in hex.
const ID_LEN: usize = 32;

/// The id's first hex digits: this process's tag (32 random bits drawn once), so a backend can
/// tell which process a member belongs to (Redis announces a grant on that process's channel
/// only). The other 96 bits are drawn per member.
pub(crate) const TAG_LEN: usize = 8;

/// This process's tag, as the first [`TAG_LEN`] hex digits of every member id.
pub(crate) fn process_tag() -> u32 {
    static TAG: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *TAG.get_or_init(|| fastrand::u32(..))
}

impl Member {
    /// A fresh holder of `weight` in [`Priority::NORMAL`].
    #[cfg(test)]
    pub(crate) fn new(weight: u32, lease: Duration) -> Self {
        Self::asking(&Ask::new().weight(weight), lease, false)
    }

    /// A fresh holder id, never reused (this process's tag, then 96 random bits), for `ask`;
    /// `prefetched`: its slot may go to this process's prefetch.
    pub(crate) fn asking(ask: &Ask, lease: Duration, prefetched: bool) -> Self {
        let (weight, priority) = (ask.get_weight(), ask.get_priority());
        use std::fmt::Write;
        const HEX: &[u8; 16] = b"0123456789abcdef";
        // By hand: `{:032x}` of a u128 is a measurable share of an in-process acquire.
        let tag_bits = 4 * TAG_LEN as u32;
        let id = (u128::from(process_tag()) << (128 - tag_bits)) | (fastrand::u128(..) >> tag_bits);
        let mut text = String::with_capacity(ID_LEN + 16);
        text.extend(
            (0..ID_LEN)
                .rev()
                .map(|digit| HEX[(id >> (4 * digit)) as usize & 0xf] as char),
        );
        // Writing to a String cannot fail.
        if priority != Priority::NORMAL {
            let _ = write!(text, ":c{}", priority.level());
        }
        if let Some(tenant) = ask.get_tenant() {
            let _ = write!(text, ":t{tenant:016x}");
        }
        if prefetched {
            text.push_str(":p");
        }
        let _ = write!(text, ":{weight}:{}", lease.as_millis());
        Member {
            text: text.into(),
            weight,
            lease,
            priority,
            tenant: ask.get_tenant(),
            prefetched,
        }
    }

    /// A member's text read back (from a backend's snapshot); `None` for a text no process
    /// of this crate writes.
    pub(crate) fn read(text: &str) -> Option<Read<'_>> {
        let (head, _lease) = text.rsplit_once(':')?;
        let (head, weight) = head.rsplit_once(':')?;
        let mut parts = head.split(':');
        let id = parts.next()?;
        let mut read = Read {
            id,
            class: Priority::NORMAL,
            weight: weight.parse().ok()?,
            prefetched: false,
        };
        for part in parts {
            if let Some(level) = part.strip_prefix('c') {
                read.class = Priority::new(level.parse().ok()?);
            }
            read.prefetched |= part == "p";
        }
        Some(read)
    }

    /// The random id alone.
    pub(crate) fn id(&self) -> &str {
        &self.text[..ID_LEN]
    }
}

/// What a member's text says of it ([`Member::read`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Read<'a> {
    pub(crate) id: &'a str,
    pub(crate) class: Priority,
    pub(crate) weight: u32,
    /// Its slot may sit in a prefetching process's pool.
    pub(crate) prefetched: bool,
}

impl PartialEq for Member {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Eq for Member {}

impl Hash for Member {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.text.hash(state);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_is_its_hex_id_weight_and_lease() {
        let member = Member::new(3, Duration::from_millis(1500));
        let (id, rest) = member.text.split_at(ID_LEN);
        assert!(
            id.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        assert_eq!(rest, ":3:1500");
        assert_eq!(member.id(), id);
        assert_eq!(id[..TAG_LEN], format!("{:08x}", process_tag()));
        assert_ne!(Member::new(3, Duration::from_millis(1500)), member);
        fn read(text: &str, class: Priority, weight: u32, prefetched: bool) -> Option<Read<'_>> {
            Some(Read {
                id: &text[..ID_LEN],
                class,
                weight,
                prefetched,
            })
        }
        let batch = Ask::new().weight(2).priority(Priority::BATCH);
        let member = Member::asking(&batch, Duration::from_millis(900), false);
        assert_eq!(&member.text[ID_LEN..], ":c2:2:900");
        assert_eq!(
            Member::read(&member.text),
            read(&member.text, Priority::BATCH, 2, false)
        );
        let plain = Member::new(3, Duration::from_millis(9));
        assert_eq!(
            Member::read(&plain.text),
            read(&plain.text, Priority::NORMAL, 3, false)
        );
        let tenant = Ask::new().priority(Priority::BATCH).tenant("acme");
        let member = Member::asking(&tenant, Duration::from_millis(900), false);
        let hex = format!(
            ":c2:t{:016x}:1:900",
            tenant.get_tenant().unwrap_or_default()
        );
        assert_eq!(&member.text[ID_LEN..], hex);
        assert_eq!(
            Member::read(&member.text),
            read(&member.text, Priority::BATCH, 1, false)
        );
        let prefetched = Member::asking(&Ask::new(), Duration::from_millis(900), true);
        assert_eq!(&prefetched.text[ID_LEN..], ":p:1:900");
        assert_eq!(
            Member::read(&prefetched.text),
            read(&prefetched.text, Priority::NORMAL, 1, true)
        );
        assert_eq!(Member::read("junk"), None);
    }
}
