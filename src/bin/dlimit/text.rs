//! How names and times are written out: escaped for each place they are printed (a name may
//! hold anything, newlines and `<` included), durations for people, and the names close to a
//! mistyped one.

use std::fmt::Write;
use std::time::Duration;

/// How many close names a refusal suggests.
const SUGGESTIONS: usize = 5;

/// `s` on one terminal line: control and other unprintable characters and `\` escaped as
/// Rust's `escape_debug` does (`\n`, `\u{1b}`), so one name is one row and cannot move the
/// cursor. Quotes stay as they are: nothing is quoted.
pub fn terminal(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c == '"' || c == '\'' {
            out.push(c);
        } else {
            out.extend(c.escape_debug());
        }
    }
    out
}

/// `s` as HTML text or a quoted attribute value.
pub fn html(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `s` as a label value in the Prometheus text format (inside the double quotes).
pub fn label(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// `28 ms`, `41.2 s`, `3 m 12 s`, `2 h 05 m`, `3 d 04 h`: precise where it is short,
/// readable where it is long. Under a second in milliseconds: a rate limiter's spent burst or a
/// claim window is often a few of them, which tenths of a second would show as `0.0 s`.
pub fn duration(d: Duration) -> String {
    let secs = d.as_secs();
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = match secs {
        0 => write!(out, "{} ms", d.as_millis()),
        1..60 => write!(out, "{:.1} s", d.as_secs_f64()),
        60..3600 => write!(out, "{} m {:02} s", secs / 60, secs % 60),
        3600..86400 => write!(out, "{} h {:02} m", secs / 3600, secs % 3600 / 60),
        _ => write!(out, "{} d {:02} h", secs / 86400, secs % 86400 / 3600),
    };
    out
}

/// The names among `known` that `name` may have been meant as, closest first, at most
/// [`SUGGESTIONS`]: a few edits away (case aside), or sharing a good part of their start.
pub fn close_names<'a>(name: &str, known: &'a [String]) -> Vec<&'a str> {
    let wanted: Vec<char> = name.to_lowercase().chars().collect();
    let mut close: Vec<(usize, &str)> = known
        .iter()
        .filter_map(|candidate| {
            let other: Vec<char> = candidate.to_lowercase().chars().collect();
            let distance = edit_distance(&wanted, &other);
            let shared = wanted
                .iter()
                .zip(&other)
                .take_while(|(a, b)| a == b)
                .count();
            let shorter = wanted.len().min(other.len());
            let near = distance <= (wanted.len() / 3).max(1);
            let same_start = shared >= 3 && shared * 2 >= shorter;
            (near || same_start).then_some((distance, candidate.as_str()))
        })
        .collect();
    close.sort();
    close.truncate(SUGGESTIONS);
    close.into_iter().map(|(_, name)| name).collect()
}

/// Levenshtein's distance: the fewest insertions, deletions and substitutions from `a` to `b`.
fn edit_distance(a: &[char], b: &[char]) -> usize {
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = if ca == cb {
                diagonal
            } else {
                1 + diagonal.min(above).min(row[j])
            };
            diagonal = above;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_one_line_one_cell_one_label() {
        assert_eq!(
            terminal("a\nb\t\u{1b}[2J\\\"q\""),
            "a\\nb\\t\\u{1b}[2J\\\\\"q\""
        );
        assert_eq!(terminal("café <b>"), "café <b>");
        assert_eq!(
            html("<b a='x'>&\"</b>"),
            "&lt;b a=&#39;x&#39;&gt;&amp;&quot;&lt;/b&gt;"
        );
        assert_eq!(label("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
    }

    #[test]
    fn durations_read_at_a_glance() {
        assert_eq!(duration(Duration::from_micros(28_600)), "28 ms");
        assert_eq!(duration(Duration::from_millis(41_230)), "41.2 s");
        assert_eq!(duration(Duration::from_secs(192)), "3 m 12 s");
        assert_eq!(duration(Duration::from_secs(7500)), "2 h 05 m");
        assert_eq!(
            duration(Duration::from_secs(3 * 86400 + 4 * 3600)),
            "3 d 04 h"
        );
    }

    #[test]
    fn close_names_are_typos_and_siblings_closest_first() {
        let known: Vec<String> = ["llm-api", "llm-apis", "db", "tenants:acme", "tenants:zed"]
            .map(String::from)
            .to_vec();
        assert_eq!(close_names("llm-apj", &known), ["llm-api", "llm-apis"]);
        assert_eq!(close_names("LLM-API", &known), ["llm-api", "llm-apis"]);
        assert_eq!(
            close_names("tenants:acne", &known),
            ["tenants:acme", "tenants:zed"]
        );
        assert!(close_names("payments", &known).is_empty());
        let many: Vec<String> = (0..9).map(|i| format!("api-{i}")).collect();
        assert_eq!(close_names("api-x", &many).len(), 5);
    }
}
