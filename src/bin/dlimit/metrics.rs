//! `/metrics`: the fleet's gauges in the Prometheus text format, read from the store at each
//! scrape, so one scrape shows every process's use of each semaphore (the per-process
//! `dlimit_*` metrics of the library show one process each).

use std::fmt::Write;

use tower_distributed_limit::Snapshot;

use crate::Failure;
use crate::fleet::{self, Fleet};
use crate::text::label;

/// One family: its name, help and each series' labelled value.
struct Family {
    name: &'static str,
    help: &'static str,
    series: Vec<(String, f64)>,
}

pub async fn scrape(fleet: &Fleet) -> Result<String, Failure> {
    let semaphores = fleet.semaphores().await?;
    let rates = fleet.rate_limiters().await?;
    let families = [
        per_semaphore(
            &semaphores,
            "dlimit_fleet_semaphore_used",
            "Weight held across every process (permits).",
            |snap| Some(f64::from(snap.used)),
        ),
        per_semaphore(
            &semaphores,
            "dlimit_fleet_semaphore_limit",
            "The limit every process admits by (permits).",
            |snap| fleet::limit(snap).map(f64::from),
        ),
        per_semaphore(
            &semaphores,
            "dlimit_fleet_semaphore_waiting",
            "Callers waiting in line across every process.",
            |snap| Some(f64::from(snap.waiting)),
        ),
        per_semaphore(
            &semaphores,
            "dlimit_fleet_semaphore_holders",
            "Live holders (permits of any weight) across every process.",
            |snap| Some(snap.holders.len() as f64),
        ),
        per_semaphore(
            &semaphores,
            "dlimit_fleet_semaphore_pinned",
            "1 while an operator pinned the limit (dlimit set-limit), else 0.",
            |snap| Some(if snap.pinned { 1.0 } else { 0.0 }),
        ),
        Family {
            name: "dlimit_fleet_rate_limiter_ahead_seconds",
            help: "How far the rate limiter's theoretical arrival time runs ahead of the \
                   Redis clock: the time until it is full again.",
            series: rates
                .iter()
                .map(|rate| {
                    let labels = format!("rate_limiter=\"{}\"", label(&rate.name));
                    (labels, rate.ahead.as_secs_f64())
                })
                .collect(),
        },
    ];
    let mut out = String::new();
    for family in families {
        // Writing to a String cannot fail.
        let _ = writeln!(out, "# HELP {} {}", family.name, family.help);
        let _ = writeln!(out, "# TYPE {} gauge", family.name);
        for (labels, value) in family.series {
            let _ = writeln!(out, "{}{{{labels}}} {value}", family.name);
        }
    }
    Ok(out)
}

fn per_semaphore(
    semaphores: &[(String, Snapshot)],
    name: &'static str,
    help: &'static str,
    value: fn(&Snapshot) -> Option<f64>,
) -> Family {
    Family {
        name,
        help,
        series: semaphores
            .iter()
            .filter_map(|(semaphore, snap)| {
                Some((format!("semaphore=\"{}\"", label(semaphore)), value(snap)?))
            })
            .collect(),
    }
}
