//! The one script-call path every Redis operation takes ([`invoke`]): the health gate, the
//! semaphore's library as a function (`FCALL`, loaded on `Function not found`) where the
//! server allows it, else the script by SHA (its source on `NOSCRIPT`), `WAIT` in the same
//! pipeline, and the retries of a call that may be sent again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use redis::{Cmd, ErrorKind, RedisError, RedisResult, Script, ServerErrorKind, Value};
use tokio::time::Instant;

use super::connection::Conn;
use super::errors::{is_transient, redis_error, server_detail};
use super::{CALLS, Connection, Replicas};
use crate::Error;
use crate::backend::health;

/// A Lua script, sent by SHA once the server knows it; or a library, made a function.
pub(super) struct Lua {
    source: &'static str,
    /// `source` is a library: definitions and `run(keys, argv)`, which does the call.
    library: bool,
    prepared: OnceLock<Prepared>,
}

/// What a [`Lua`] sends, made at its first call.
struct Prepared {
    /// The script `EVAL` runs: a library's is its script form (`as_script`).
    text: String,
    script: Script,
    /// A library's function: its name (`dlimit_` and the script's SHA, so versions that share
    /// a server keep theirs apart) and what `FUNCTION LOAD` registers it with.
    function: Option<(String, String)>,
    /// The name the same function goes by for calls that grant (`acquire`): registered
    /// without `allow-oom`, so a server out of memory refuses them.
    granting: String,
}

impl Lua {
    /// The script of `source`.
    pub(super) const fn new(source: &'static str) -> Self {
        Lua {
            source,
            library: false,
            prepared: OnceLock::new(),
        }
    }

    /// The library of `source`: its definitions are made once per server (`FUNCTION LOAD`),
    /// not on every call as a script's are, where Redis 7 and the user's ACL allow it.
    pub(super) const fn library(source: &'static str) -> Self {
        Lua {
            source,
            library: true,
            prepared: OnceLock::new(),
        }
    }

    fn prepared(&self) -> &Prepared {
        self.prepared.get_or_init(|| {
            if !self.library {
                return Prepared {
                    text: self.source.to_owned(),
                    script: Script::new(self.source),
                    function: None,
                    granting: String::new(),
                };
            }
            // The library is a constant of the build, whose markers a unit test checks.
            let text = as_script(self.source).unwrap_or_else(|missing| {
                debug_assert!(false, "the library's script form: {missing}");
                tracing::error!(
                    missing,
                    "the semaphore library's script form could not be made; sent unoptimised"
                );
                as_plain_script(self.source)
            });
            let script = Script::new(&text);
            let name = format!("dlimit_{}", &script.get_hash()[..16]);
            let granting = format!("{name}_grant");
            // `allow-oom`: a release, a renewal or a touch must go through on a full server;
            // a call that grants (and may queue) is refused there, so a limiter never grows a
            // Redis that is out of memory.
            let library = format!(
                "#!lua name={name}\n{}redis.register_function{{function_name = '{name}', \
                 callback = run, flags = {{'allow-oom'}}}}\n\
                 redis.register_function{{function_name = '{granting}', callback = run}}\n",
                self.source
            );
            Prepared {
                text,
                script,
                function: Some((name, library)),
                granting,
            }
        })
    }
}

#[cfg(test)]
impl Lua {
    /// The source, and the script `EVAL` runs of it.
    ///
    /// A library's every marker found and used (see [`as_script`]).
    pub(super) fn texts(&self) -> (&'static str, &str) {
        let text = &self.prepared().text;
        if self.library {
            assert_eq!(as_script(self.source).as_ref(), Ok(text));
        }
        (self.source, text)
    }
}

/// The lines of a library [`as_script`] rewrites, each a marker it must find: where `run`
/// starts and ends, where each `step_*` function starts and ends, and the locals `run` sets.
const RUN_START: &str = "local function run(keys, argv)";
const RUN_END: &str = "end -- run";
const STEP_START: (&str, &str) = ("local function step_", "()");
const STEP_END: &str = "end -- step_";
const KEYS_LOCAL: &str = "local KEYS, ARGV";

/// A library (lua/semaphore/) as the script `EVAL` runs: the same definitions, each part's
/// `step_*` body where it stands (in a `do` block) rather than in a function (the library's
/// `run` calls them in the order of the parts), then the reply. A script makes every function anew on each call,
/// with its upvalues: the bodies inlined spare about a third of its instructions.
///
/// Every marker must be where the rewrite expects it (`run` once, after `KEYS_LOCAL` once;
/// each step's start followed by its own end, outside `run`; at least one step), else the
/// error names what is missing: a text left half rewritten would run wrong.
fn as_script(library: &str) -> Result<String, String> {
    let mut text = String::with_capacity(library.len() + 32);
    let (mut runs, mut keys_locals, mut steps) = (0, 0, 0);
    let mut in_run = false;
    // The step whose body is being read, by name.
    let mut step: Option<&str> = None;
    for line in library.lines() {
        if line == RUN_START {
            if runs > 0 || keys_locals != 1 || step.is_some() {
                return Err(format!("`{RUN_START}` not once, after `{KEYS_LOCAL}`"));
            }
            runs += 1;
            in_run = true;
        }
        let opened = line
            .strip_prefix(STEP_START.0)
            .and_then(|rest| rest.strip_suffix(STEP_START.1));
        let closed = line.strip_prefix(STEP_END);
        if let Some(name) = opened {
            if in_run || step.is_some() {
                return Err(format!("`{line}` inside `run` or another step"));
            }
            step = Some(name);
        }
        if let Some(name) = closed {
            if step != Some(name) {
                return Err(format!("`{line}` ends no step that started"));
            }
            step = None;
            steps += 1;
        }
        let kept = !(in_run || opened.is_some() || closed.is_some());
        if line == RUN_END {
            if !in_run {
                return Err(format!("`{RUN_END}` before `{RUN_START}`"));
            }
            in_run = false;
        }
        if line == KEYS_LOCAL {
            keys_locals += 1;
            // (EVAL's keys and arguments are globals.)
            text.push_str("local KEYS, ARGV = KEYS, ARGV\n");
        } else if opened.is_some() || closed.is_some() {
            // Each body in a block of its own, as in its function: its locals end with it. (A
            // script is one function, and Lua 5.1 allows a function 200 locals at once: the
            // bodies' locals left open had used every one.)
            text.push_str(if opened.is_some() { "do\n" } else { "end\n" });
        } else if kept {
            text.push_str(line);
            text.push('\n');
        }
    }
    if let Some(name) = step {
        return Err(format!("`{STEP_END}{name}` missing"));
    }
    if in_run || runs != 1 {
        return Err(format!("`{RUN_START}` ... `{RUN_END}` missing"));
    }
    if steps == 0 {
        return Err(format!("no `{}...{}`", STEP_START.0, STEP_START.1));
    }
    text.push_str("return reply\n");
    Ok(text)
}

/// The script form of a library whose markers [`as_script`] did not find: the library as it
/// is, then the call of its `run` (its functions made anew on every call: slower, the same
/// answers).
fn as_plain_script(library: &str) -> String {
    let mut text = String::with_capacity(library.len() + 64);
    for line in library.lines() {
        if line == KEYS_LOCAL {
            text.push_str("local KEYS, ARGV = KEYS, ARGV\n");
        } else {
            text.push_str(line);
            text.push('\n');
        }
    }
    text.push_str("return run(KEYS, ARGV)\n");
    text
}

/// One call of `lua` on `conn`, its keys and arguments written by `args` (told whether this is
/// a repeat), with `WAIT` for `replicas` in the same pipeline; the reply, and how many replicas
/// acknowledged.
///
/// The call goes by SHA, and with the whole source (`EVAL`, which also caches it) when the
/// server does not know the script: routed by key like the call itself, so on a cluster it
/// never waits for the other nodes, as `SCRIPT LOAD` to every node would. A call whose
/// connection dropped is sent once more (the connection manager reconnects on that error, one
/// attempt). A server that is loading its data or busy with a script is asked again after a
/// jittered pause, until `until`.
///
/// A server known to be down is not asked at all: the call fails at once (see `health`), and
/// a call that finds it unreachable marks it down.
pub(super) async fn invoke(
    lua: &Lua,
    shared: &Arc<Connection>,
    op: &'static str,
    until: Instant,
    replicas: Option<Replicas>,
    args: impl Fn(&mut Cmd, bool),
) -> Result<(Value, Option<i64>), Error> {
    let mut conn = shared.conn()?;
    let call = Call {
        lua,
        functions_refused: &shared.functions_refused,
        op,
        until,
        replicas,
    };
    let result = send(&call, &mut conn, args).await;
    if let Err(e) = &result {
        health::failed(shared, e);
    }
    result.map_err(|e| redis_error(e, op, shared.health.label()))
}

/// One call of [`send`]: what it runs, and how.
struct Call<'a> {
    lua: &'a Lua,
    /// The server or the user's ACL has no functions (Redis before 7, `FCALL` or `FUNCTION
    /// LOAD` not allowed): scripts only, from then on.
    functions_refused: &'a AtomicBool,
    op: &'static str,
    until: Instant,
    replicas: Option<Replicas>,
}

/// How a call is sent.
#[derive(Clone, Copy, PartialEq)]
enum Way {
    /// `FCALL` of the library's function.
    Function,
    /// `EVALSHA`.
    Sha,
    /// `EVAL` of the whole source (the server lacked the script).
    Source,
}

/// What one call of [`send`] has been through so far: each kind of retry is bounded, and the
/// script is told when it may have run already.
struct Retries {
    /// How this attempt goes.
    way: Way,
    /// The library was loaded once: a second `Function not found` sends the script instead.
    loaded: bool,
    /// A call was sent that may have run: the script rechecks instead of adding again.
    repeat: bool,
    /// The connection dropped once: a second drop is the answer.
    dropped: bool,
    /// Through Sentinel, the master moved once after too few replicas acknowledged.
    moved: bool,
    /// Pushes handed back in place of the reply (at most three are taken for one).
    pushes: u8,
    /// The next pause before asking a loading or busy server again.
    pause: Duration,
}

/// [`invoke`]'s retries on one connection.
async fn send(
    call: &Call<'_>,
    conn: &mut Conn,
    args: impl Fn(&mut Cmd, bool),
) -> RedisResult<(Value, Option<i64>)> {
    let Call {
        lua,
        op,
        until,
        replicas,
        ..
    } = *call;
    let prepared = lua.prepared();
    let functions = prepared
        .function
        .as_ref()
        .filter(|_| !call.functions_refused.load(Ordering::Relaxed));
    let mut tried = Retries {
        way: if functions.is_some() {
            Way::Function
        } else {
            Way::Sha
        },
        loaded: false,
        repeat: false,
        dropped: false,
        moved: false,
        pushes: 0,
        pause: Duration::from_millis(10),
    };
    loop {
        let mut command = match (tried.way, functions) {
            (Way::Function, Some((name, _))) => {
                let mut command = redis::cmd("FCALL");
                command.arg(if op == "acquire" {
                    &prepared.granting
                } else {
                    name
                });
                command
            }
            (Way::Function | Way::Sha, _) => {
                let mut command = redis::cmd("EVALSHA");
                command.arg(prepared.script.get_hash());
                command
            }
            (Way::Source, _) => {
                let mut command = redis::cmd("EVAL");
                command.arg(&prepared.text);
                command
            }
        };
        args(&mut command, tried.repeat);
        tracing::trace!(target: CALLS, op, repeat = tried.repeat, "script call");
        let result = match replicas {
            None => command.query_async(conn).await.map(|reply| (reply, None)),
            Some(Replicas { count, timeout }) => {
                let mut pipe = redis::pipe();
                pipe.add_command(command)
                    .cmd("WAIT")
                    .arg(count)
                    .arg(timeout.as_millis() as u64);
                pipe.query_async::<(Value, i64)>(conn)
                    .await
                    .map(|(reply, acked)| (reply, Some(acked)))
            }
        };
        match result {
            // A push in place of the reply: redis-rs's cluster client can hand back the
            // server's `sunsubscribe` of a moving slot as the answer to a call in flight. The
            // call itself may have run; every operation is safe to send again.
            Ok((Value::Push { .. }, _)) if tried.pushes < 3 => {
                tried.pushes += 1;
                tried.repeat = true;
            }
            // Too few replicas acknowledged: on Sentinel, the master may have been deposed
            // (its replicas follow the new one). If the sentinels name another, ask it.
            Ok((_, Some(acked)))
                if replicas.is_some_and(|r| acked < i64::from(r.count))
                    && !tried.moved
                    && conn.master_moved().await =>
            {
                tried.moved = true;
                tried.repeat = true;
            }
            // Nothing ran, so `repeat` stays as it was (here and in the next two).
            Err(e) if tried.way == Way::Function && !functions_allowed(&e) => {
                tracing::debug!(op, error = %e, "no functions on this server; scripts from now on");
                call.functions_refused.store(true, Ordering::Relaxed);
                tried.way = Way::Sha;
            }
            Err(e) if tried.way == Way::Function && function_missing(&e) => {
                let loaded = match (first_key(&args), functions) {
                    (Some(key), Some((_, library))) if !tried.loaded => {
                        conn.load_library(library, &key).await
                    }
                    _ => Ok(()),
                };
                match loaded {
                    Ok(()) if !tried.loaded => tried.loaded = true,
                    Ok(()) => tried.way = Way::Sha,
                    Err(e) => {
                        tracing::debug!(op, error = %e, "cannot load the library; a script instead");
                        // Refused or rejected by the server (an ACL, a Lua it cannot compile):
                        // scripts from now on. Lost on the way: only this call.
                        // (Refused as out of memory: loaded at a later call, once there is room.)
                        if !(e.is_io_error()
                            || e.is_connection_dropped()
                            || e.is_timeout()
                            || is_transient(&e)
                            || e.code() == Some("OOM"))
                        {
                            call.functions_refused.store(true, Ordering::Relaxed);
                        }
                        tried.way = Way::Sha;
                    }
                }
            }
            Err(e)
                if tried.way != Way::Source
                    && e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) =>
            {
                tried.way = Way::Source;
            }
            Err(e) if e.is_connection_dropped() && !tried.dropped => {
                tried.dropped = true;
                tried.repeat = true;
            }
            Err(e) if is_transient(&e) && Instant::now() + tried.pause < until => {
                tracing::debug!(op, error = %e, "Redis is loading or busy; asking again");
                tokio::time::sleep(tried.pause.mul_f64(0.5 + fastrand::f64())).await;
                tried.pause = (tried.pause * 2).min(Duration::from_millis(200));
                tried.repeat = true;
            }
            other => return other,
        }
    }
}

/// Whether `e`, the answer to `FCALL` or `FUNCTION LOAD`, leaves functions possible: not a
/// server without them (before Redis 7: an unknown command) nor a user the ACL refuses them.
fn functions_allowed(e: &RedisError) -> bool {
    e.kind() != ErrorKind::Server(ServerErrorKind::NoPerm)
        && !(e.code() == Some("ERR")
            && server_detail(e).is_some_and(|detail| detail.starts_with("unknown command")))
}

/// Whether `e` says the server lacks the function (never loaded, flushed, or a server that
/// came back empty).
fn function_missing(e: &RedisError) -> bool {
    e.code() == Some("ERR")
        && server_detail(e).is_some_and(|detail| detail.starts_with("Function not found"))
}

/// The first key `args` writes: where a missing library is loaded.
fn first_key(args: &impl Fn(&mut Cmd, bool)) -> Option<Vec<u8>> {
    let mut command = Cmd::new();
    args(&mut command, false);
    // (The key count, then the keys.)
    match command.args_iter().nth(1)? {
        redis::Arg::Simple(key) => Some(key.to_vec()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A library with every marker `as_script` rewrites.
    const LIBRARY: &str = "\
local KEYS, ARGV
local x
local function step_a()
  x = 1
end -- step_a
local function helper()
  return x
end
local function step_b()
  x = x + 1
end -- step_b
local function run(keys, argv)
  KEYS, ARGV = keys, argv
  step_a()
  step_b()
  return reply
end -- run
";

    #[test]
    fn every_marker_is_found_and_used() {
        let script = as_script(LIBRARY).unwrap();
        assert_eq!(
            script,
            "\
local KEYS, ARGV = KEYS, ARGV
local x
do
  x = 1
end
local function helper()
  return x
end
do
  x = x + 1
end
return reply
"
        );
    }

    #[test]
    fn a_missing_or_misplaced_marker_is_an_error_not_a_text_left_as_is() {
        let broken = [
            ("local KEYS, ARGV\n", ""),
            ("local function run(keys, argv)\n", ""),
            ("end -- run\n", ""),
            ("end -- step_a\n", ""),
            ("end -- step_b\n", "end -- step_c\n"),
            ("local function step_b()\n", ""),
        ];
        for (marker, instead) in broken {
            let library = LIBRARY.replacen(marker, instead, 1);
            assert!(as_script(&library).is_err(), "{marker:?} missing, not seen");
        }
        let no_steps = "local KEYS, ARGV\nlocal function run(keys, argv)\nend -- run\n";
        assert!(as_script(no_steps).is_err());
        let twice = format!("{LIBRARY}local function run(keys, argv)\nend -- run\n");
        assert!(as_script(&twice).is_err());
    }

    #[test]
    fn a_library_not_rewritten_is_sent_whole_with_the_call_of_its_run() {
        let script = as_plain_script(LIBRARY);
        assert!(script.starts_with("local KEYS, ARGV = KEYS, ARGV\nlocal x\n"));
        assert!(script.contains("local function run(keys, argv)\n"));
        assert!(script.ends_with("end -- run\nreturn run(KEYS, ARGV)\n"));
    }
}
