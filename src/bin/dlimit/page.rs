//! The live page: `page.html` around a live part rendered here, so the page reads without
//! JavaScript; its script only fetches the live part again (`/live`) every second and draws
//! the sparklines. Every name, process and message is HTML-escaped here, and shown with
//! control characters escaped as in the terminal, so a name is one line of text.

use std::collections::{HashMap, HashSet};
use std::fmt::Write;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tower_distributed_limit::{Priority, Snapshot};

use crate::Failure;
use crate::fleet::{self, Fleet, RateState};
use crate::text::{duration, html, terminal};

const TEMPLATE: &str = include_str!("page.html");

/// Where the live part goes in the template.
const LIVE: &str = "<!--LIVE-->";

/// How long a rate limiter stays listed after its key was last seen. A limiter under its rate
/// keeps a key only for about one request's interval after each request (it is full again
/// then), so most reads miss a busy one: the page lists what it saw lately instead.
const REMEMBERED: Duration = Duration::from_secs(300);

/// The rate limiters `serve` has seen, and when; shared by every viewer, so two never disagree.
#[derive(Default)]
pub struct Sightings {
    seen: Mutex<HashMap<String, Instant>>,
}

impl Sightings {
    /// Notes the limiters read now and returns every one seen within [`REMEMBERED`], by
    /// name, with its state now (`None` when its key is gone: full again) and how long ago
    /// its key was last seen.
    fn note(&self, now: Vec<RateState>) -> Vec<RateRow> {
        let at = Instant::now();
        // A poisoned lock only means a viewer panicked while noting: its map is still whole.
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for rate in &now {
            seen.insert(rate.name.clone(), at);
        }
        seen.retain(|_, last| at.duration_since(*last) <= REMEMBERED);
        let mut now: HashMap<String, RateState> = now
            .into_iter()
            .map(|rate| (rate.name.clone(), rate))
            .collect();
        let mut rows: Vec<RateRow> = seen
            .iter()
            .map(|(name, last)| RateRow {
                name: name.clone(),
                state: now.remove(name),
                seen_ago: at.duration_since(*last),
            })
            .collect();
        rows.sort_by(|a, b| a.name.cmp(&b.name));
        rows
    }
}

/// A rate limiter as the page lists it.
struct RateRow {
    name: String,
    state: Option<RateState>,
    seen_ago: Duration,
}

/// Everything the page shows, read in one go.
pub struct View {
    pub semaphores: Vec<(String, Snapshot)>,
    rates: Vec<RateRow>,
    /// The holders whose grant is provisional, in its claim window ([`Fleet::provisional`]).
    provisional: HashSet<String>,
    /// When no semaphore is found: what to check (the prefix may be wrong).
    pub hint: Option<String>,
}

impl View {
    pub async fn read(fleet: &Fleet, sightings: &Sightings) -> Result<View, Failure> {
        let semaphores = fleet.semaphores().await?;
        let rates = sightings.note(fleet.rate_limiters().await?);
        let names: Vec<&str> = (semaphores.iter())
            .filter(|(_, snap)| !snap.holders.is_empty())
            .map(|(name, _)| name.as_str())
            .collect();
        let provisional = fleet.provisional(&names).await?;
        let hint = match semaphores.is_empty() {
            true => Some(fleet.prefix_hint().await?),
            false => None,
        };
        Ok(View {
            semaphores,
            rates,
            provisional,
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
         <span title=\"whose key was seen in the last {}\"><b>{}</b>rate limiters active lately\
         </span></div>",
        view.semaphores.len(),
        duration(REMEMBERED),
        view.rates.len()
    );
    semaphores(out, fleet, view);
    classes(out, view);
    tenants(out, view);
    holder_rows(out, view, holders);
    rate_rows(out, view);
}

fn semaphores(out: &mut String, fleet: &Fleet, view: &View) {
    out.push_str(
        "<h2>Semaphores<small class=\"legend\"><i style=\"background:#2f8f5b\"></i>used\
         <i style=\"background:#6b7684\"></i>limit, over the last 2 minutes (since the page \
         opened)</small></h2>\
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
}

/// Each class's part of each semaphore that has more than its normal class with no share.
fn classes(out: &mut String, view: &View) {
    out.push_str(
        "<h2>Classes<small>each class's use of its semaphore and its share of the limit \
         (<code>SemaphoreBuilder::class</code>); a request's class is its \
         <code>Ask::class</code></small></h2><div class=\"scroll\"><table><thead><tr>\
         <th>Semaphore</th><th>Class</th><th class=\"n\">Used</th><th class=\"n\">Waiting</th>\
         <th class=\"n\">Reserved</th><th class=\"n\">At most</th></tr></thead><tbody>",
    );
    let mut any = false;
    for (name, snap) in &view.semaphores {
        let shared = snap.classes.iter().any(|class| {
            class.class != Priority::NORMAL || class.reserved > 0 || class.at_most.is_some()
        });
        if !shared {
            continue;
        }
        any = true;
        for class in &snap.classes {
            let _ = write!(
                out,
                "<tr data-class=\"{}\"><td class=\"name\">{}</td><td>{}</td>\
                 <td class=\"n\">{}</td><td class=\"n{}\">{}</td><td class=\"n\">{}</td>\
                 <td class=\"n\">{}</td></tr>",
                class.class,
                html(&terminal(name)),
                class.class,
                class.used,
                if class.waiting > 0 { " waiting" } else { "" },
                class.waiting,
                class.reserved,
                class.at_most.map_or("-".into(), |most| most.to_string()),
            );
        }
    }
    if !any {
        out.push_str(
            "<tr><td class=\"empty\" colspan=\"6\">Every holder and waiter is of the normal \
             class, and no class has a share.</td></tr>",
        );
    }
    out.push_str("</tbody></table></div>");
}

/// The tenants with the most requests waiting, per semaphore.
fn tenants(out: &mut String, view: &View) {
    out.push_str(
        "<h2>Tenants waiting<small>most first; a tenant is shown by its id, never its name \
         (which is not stored): <code>Ask::new().tenant(key).get_tenant()</code> of a key, in hex, \
         is the id to look for</small></h2><div class=\"scroll\"><table><thead><tr>\
         <th>Semaphore</th><th>Tenant id</th><th class=\"n\">Waiting</th></tr></thead><tbody>",
    );
    let mut any = false;
    for (name, snap) in &view.semaphores {
        for tenant in &snap.tenants_waiting {
            any = true;
            let _ = write!(
                out,
                "<tr data-tenant=\"{:016x}\"><td class=\"name\">{}</td>\
                 <td class=\"mono\">{:016x}</td><td class=\"n waiting\">{}</td></tr>",
                tenant.tenant,
                html(&terminal(name)),
                tenant.tenant,
                tenant.waiting,
            );
        }
    }
    if !any {
        out.push_str("<tr><td class=\"empty\" colspan=\"3\">No tenant's requests wait.</td></tr>");
    }
    out.push_str("</tbody></table></div>");
}

/// What a provisional holder's short lease is.
const CLAIM_WINDOW: &str = "granted from the line, provisional until its process claims it with \
    its next call (then for its full lease); unclaimed, the slot goes to the next in line when \
    the window ends (SemaphoreBuilder::claim_window)";

/// What the Pool column says.
const POOL: &str = "the slot sits in its process's prefetch (SemaphoreBuilder::prefetch): \
    held ahead of need, on hand there or handed to a request, given back once anyone waits";

fn holder_rows(out: &mut String, view: &View, holders: usize) {
    let _ = write!(
        out,
        "<h2>Holders<small>longest-held first. Lease left marked <i>claim window</i>: {}. \
         Pool <i>prefetched</i>: {}.</small></h2><div class=\"scroll\"><table><thead>\
         <tr><th>Semaphore</th><th>Holder</th><th>Process</th><th class=\"n\">Weight</th>\
         <th class=\"n\">Held for</th><th class=\"n\">Lease left</th>\
         <th title=\"{}\">Pool</th></tr></thead><tbody>",
        html(CLAIM_WINDOW),
        html(POOL),
        html(POOL),
    );
    if holders == 0 {
        out.push_str("<tr><td class=\"empty\" colspan=\"7\">Nobody holds a permit.</td></tr>");
    }
    for (name, snap) in &view.semaphores {
        for holder in &snap.holders {
            let process = holder.process.as_str();
            let claim = match view.provisional.contains(&holder.id) {
                true => format!(
                    " <span class=\"badge claim\" title=\"{}\">claim window</span>",
                    html(CLAIM_WINDOW)
                ),
                false => String::new(),
            };
            let _ = write!(
                out,
                "<tr><td class=\"name\">{}</td><td class=\"mono\">{}</td>\
                 <td class=\"mono process\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td>\
                 <td class=\"n\">{}{claim}</td><td>{}</td></tr>",
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
                if holder.prefetched {
                    format!("<span title=\"{}\">prefetched</span>", html(POOL))
                } else {
                    "-".into()
                },
            );
        }
    }
    out.push_str("</tbody></table></div>");
}

fn rate_rows(out: &mut String, view: &View) {
    let _ = write!(
        out,
        "<h2>Rate limiters<small>Ahead of now: how much of its burst is spent, as time (zero \
         when full; its burst times its interval when it refuses); its key expires when it is \
         full again. Its rate and burst are the services' configuration, not stored in Redis, \
         and its allowed and refused counts are in the services' metrics \
         (<code>dlimit_rate_decisions_total</code>). One under its rate keeps a key only \
         briefly after each request: each is listed for {} after its key was last seen.\
         </small></h2><div class=\"scroll\"><table><thead><tr><th>Rate limiter</th>\
         <th class=\"n\">Ahead of now</th><th class=\"n\">Key expires in</th>\
         <th class=\"n\">Key last seen</th></tr></thead><tbody>",
        duration(REMEMBERED)
    );
    if view.rates.is_empty() {
        let _ = write!(
            out,
            "<tr><td class=\"empty\" colspan=\"4\">No rate limiter's key seen in the last {}. \
             A limiter under its rate keeps its key only for about one request's interval after \
             each request, so a lightly used one can fall between two reads: its traffic is in \
             the services' metrics.</td></tr>",
            duration(REMEMBERED)
        );
    }
    for rate in &view.rates {
        let (ahead, ttl) = match &rate.state {
            Some(state) => (
                duration(state.ahead),
                state.ttl.map_or("-".into(), duration),
            ),
            None => ("full".into(), "(no key)".into()),
        };
        let _ = write!(
            out,
            "<tr data-rate-limiter=\"{}\"><td class=\"name\">{}</td><td class=\"n\">{ahead}</td>\
             <td class=\"n\">{ttl}</td><td class=\"n\">{}</td></tr>",
            html(&rate.name),
            html(&terminal(&rate.name)),
            match rate.state {
                Some(_) => "now".into(),
                None => format!("{} ago", duration(rate.seen_ago)),
            },
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
