//! Key names: the `{name}` hash tag that keeps every key of one semaphore or rate limiter in
//! one Redis Cluster slot, and the slot tag Redis Cluster would hash a key by.

/// The part of `key` Redis Cluster hashes to pick its slot: the first `{...}` if not empty,
/// else the whole key.
pub(super) fn slot_tag(key: &str) -> &str {
    key.find('{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.find('}')
                .filter(|&close| close > 0)
                .map(|close| &rest[..close])
        })
        .unwrap_or(key)
}

/// `{name}`: a hash tag that keeps every key of the semaphore in one Cluster slot, whatever the
/// name. `%`, `{` and `}` are percent-encoded, so no name can end the tag early (`}` first would
/// make it empty, and Redis would hash each key whole) or share keys with another name.
pub(super) fn hash_tag(name: &str) -> String {
    let mut tag = String::with_capacity(name.len() + 2);
    tag.push('{');
    for c in name.chars() {
        match c {
            '%' => tag.push_str("%25"),
            '{' => tag.push_str("%7B"),
            '}' => tag.push_str("%7D"),
            c => tag.push(c),
        }
    }
    tag.push('}');
    tag
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_tags_follow_redis_cluster_rules() {
        assert_eq!(slot_tag("dlimit:{api}:holders"), "api");
        assert_eq!(slot_tag("dlimit:{api}:rate"), slot_tag("dlimit:{api}:meta"));
        // The first `{` and the first `}` after it; an empty tag hashes the whole key.
        assert_eq!(slot_tag("a{b}c{d}"), "b");
        assert_eq!(slot_tag("x{}y{z}"), "x{}y{z}");
        assert_eq!(slot_tag("no-braces"), "no-braces");
        assert_eq!(slot_tag("open{only"), "open{only");
        // A prefix with braces of its own decides the slot, as Redis would.
        assert_eq!(slot_tag("app{1}:{api}:rate"), "1");
        // Names are encoded, so a hostile name cannot end the tag early.
        assert_eq!(slot_tag(&format!("dlimit:{}:rate", hash_tag("}x"))), "%7Dx");
    }
}
