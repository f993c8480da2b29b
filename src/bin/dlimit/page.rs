//! The live page: `page.html` around a live part rendered here, so the page reads without
//! JavaScript; its script only fetches the live part again (`/live`) every second and draws
//! the sparklines. Every name, process and message is HTML-escaped here, and shown with
//! control characters escaped as in the terminal, so a name is one line of text.

use std::fmt::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use tower_distributed_limit::Snapshot;

use crate::Failure;
use crate::fleet::{self, Fleet, RateState};
use crate::text::{duration, html, terminal};

const TEMPLATE: &str = include_str!("page.html");

/// Where the live part goes in the template.
const LIVE: &str = "<!--LIVE-->";

/// Everything the page shows, read in one go.
pub struct View {
    pub semaphores: Vec<(String, Snapshot)>,
    pub rates: Vec<RateState>,
    /// When no semaphore is found: what to check (the prefix may be wrong).
    pub hint: Option<String>,
}

impl View {
    pub async fn read(fleet: &Fleet) -> Result<View, Failure> {
        let semaphores = fleet.semaphores().await?;
        let rates = fleet.rate_limiters().await?;
        let hint = match semaphores.is_empty() {
            true => Some(fleet.prefix_hint().await?),
            false => None,
        };
        Ok(View {
            semaphores,
            rates,
            hint,
        })
    }
}

/// The whole page around a live part.
pub fn page(live: &str) -> String {
    TEMPLATE.replacen(LIVE, live, 1)
}

/// The live part: a header, then the tables, or why they cannot be read.
pub fn live(fleet: &Fleet, view: Result<&View, &Failure>) -> String {
    let mut out = String::new();
    let (class, state) = match view {
        Ok(_) => ("", format!("live, as of {} UTC", clock())),
        Err(_) => ("stale", format!("Redis unreachable at {} UTC", clock())),
    };
    // Writing to a String cannot fail.
    let _ = write!(
        out,
        "<header class=\"{class}\"><h1>dlimit</h1><span class=\"where\">prefix <code>{}</code> \
         at <code>{}</code></span><span class=\"state\">{state}</span></header><main>",
        html(&terminal(fleet.prefix())),
        html(&fleet.shown_url()),
    );
    match view {
        Ok(view) => tables(&mut out, fleet, view),
        Err(failure) => {
            let _ = write!(out, "<p class=\"error\">{}</p>", html(failure.message()));
        }
    }
    out.push_str(
        "<footer>The same as JSON: <a href=\"api/semaphores\">/api/semaphores</a>, \
         <a href=\"api/rate-limiters\">/api/rate-limiters</a>; the fleet's gauges for \
         Prometheus: <a href=\"metrics\">/metrics</a>.</footer></main>",
    );
    out
}

fn tables(out: &mut String, fleet: &Fleet, view: &View) {
    let held: u32 = view.semaphores.iter().map(|(_, snap)| snap.used).sum();
    let waiting: u32 = view.semaphores.iter().map(|(_, snap)| snap.waiting).sum();
    let holders: usize = view.semaphores.iter().map(|(_, s)| s.holders.len()).sum();
    let _ = write!(
        out,
        "<div class=\"summary\"><span><b>{}</b>semaphores</span><span><b>{held}</b>permits \
         held</span><span><b>{holders}</b>holders</span><span><b>{waiting}</b>waiting</span>\
         <span><b>{}</b>rate limiters</span></div>",
        view.semaphores.len(),
        view.rates.len()
    );

    out.push_str(
        "<h2>Semaphores<small class=\"legend\"><i style=\"background:#2f8f5b\"></i>used\
         <i style=\"background:#6b7684\"></i>limit, over the last 2 minutes</small></h2>\
         <div class=\"scroll\"><table><thead><tr><th>Semaphore</th><th class=\"n\">Used</th>\
         <th class=\"n\">Limit</th><th></th><th class=\"n\">Waiting</th>\
         <th class=\"n\">Holders</th><th>Limit set by</th><th>History</th></tr></thead><tbody>",
    );
    if let Some(hint) = &view.hint {
        let _ = write!(
            out,
            "<tr><td class=\"empty\" colspan=\"8\">No semaphore in use under the prefix \
             <code>{}</code>. {}</td></tr>",
            html(&terminal(fleet.prefix())),
            html(hint)
        );
    }
    for (name, snap) in &view.semaphores {
        let limit = fleet::limit(snap);
        let fill = limit.map_or(0, |limit| {
            (u64::from(snap.used) * 100 / u64::from(limit.max(1))).min(100)
        });
        let level = match fill {
            90.. => "full",
            70..90 => "warn",
            _ => "",
        };
        let _ = write!(
            out,
            "<tr data-semaphore=\"{}\" data-used=\"{}\" data-limit=\"{}\">\
             <td class=\"name\">{}</td><td class=\"n used\">{}</td><td class=\"n limit\">{}</td>\
             <td class=\"usage\"><div class=\"bar {level}\"><i style=\"width:{fill}%\"></i></div></td>\
             <td class=\"n{}\">{}</td><td class=\"n\">{}</td><td>{}</td><td class=\"spark\"></td></tr>",
            html(name),
            snap.used,
            limit.unwrap_or(0),
            html(&terminal(name)),
            snap.used,
            limit.map_or("-".into(), |limit| limit.to_string()),
            if snap.waiting > 0 { " waiting" } else { "" },
            snap.waiting,
            snap.holders.len(),
            if snap.pinned {
                "<span class=\"badge pinned\" title=\"set with dlimit set-limit\">operator (pinned)</span>"
            } else {
                "<span class=\"badge\">configuration</span>"
            },
        );
        // A rolling deploy shows: more than one protocol version, or one not served beside
        // this build's.
        let (protocols, warning) = fleet::protocols(snap);
        if snap.protocols.len() > 1 || warning.is_some() {
            let _ = write!(
                out,
                "<tr class=\"versions\"><td></td><td colspan=\"7\"><span class=\"badge{}\" \
                 title=\"{}\">protocol versions: {}</span></td></tr>",
                if warning.is_some() { " warn" } else { "" },
                html(
                    warning
                        .as_deref()
                        .unwrap_or("processes of two builds share it: a rolling deploy")
                ),
                html(&protocols),
            );
        }
    }
    out.push_str("</tbody></table></div>");

    out.push_str(
        "<h2>Holders<small>longest-held first</small></h2><div class=\"scroll\"><table><thead>\
         <tr><th>Semaphore</th><th>Holder</th><th>Process</th><th class=\"n\">Weight</th>\
         <th class=\"n\">Held for</th><th class=\"n\">Lease left</th><th>Pool</th></tr></thead>\
         <tbody>",
    );
    if holders == 0 {
        out.push_str("<tr><td class=\"empty\" colspan=\"7\">Nobody holds a permit.</td></tr>");
    }
    for (name, snap) in &view.semaphores {
        for holder in &snap.holders {
            let process = holder.process.as_str();
            let _ = write!(
                out,
                "<tr><td class=\"name\">{}</td><td class=\"mono\">{}</td>\
                 <td class=\"mono process\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td>\
                 <td class=\"n\">{}</td><td>{}</td></tr>",
                html(&terminal(name)),
                html(&terminal(&holder.id)),
                if process.is_empty() {
                    "-".into()
                } else {
                    html(&terminal(process))
                },
                holder.weight,
                duration(holder.held_for),
                duration(holder.lease_remaining),
                if holder.prefetched { "prefetched" } else { "-" },
            );
        }
    }
    out.push_str("</tbody></table></div>");

    out.push_str(
        "<h2>Rate limiters<small>what Redis holds of each: how far its theoretical arrival \
         time runs ahead of the server's clock, the time it needs to be full again</small></h2>\
         <div class=\"scroll\"><table><thead><tr><th>Rate limiter</th>\
         <th class=\"n\">Ahead of now</th><th class=\"n\">Key expires in</th></tr></thead><tbody>",
    );
    if view.rates.is_empty() {
        out.push_str(
            "<tr><td class=\"empty\" colspan=\"3\">No rate limiter has spent anything lately \
             (an idle one keeps no key).</td></tr>",
        );
    }
    for rate in &view.rates {
        let _ = write!(
            out,
            "<tr data-rate-limiter=\"{}\"><td class=\"name\">{}</td><td class=\"n\">{}</td>\
             <td class=\"n\">{}</td></tr>",
            html(&rate.name),
            html(&terminal(&rate.name)),
            duration(rate.ahead),
            rate.ttl.map_or("-".into(), duration),
        );
    }
    out.push_str("</tbody></table></div>");
}

/// The time of day in UTC, `HH:MM:SS`.
fn clock() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    format!(
        "{:02}:{:02}:{:02}",
        secs / 3600 % 24,
        secs / 60 % 60,
        secs % 60
    )
}
