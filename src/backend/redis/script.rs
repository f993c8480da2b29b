//! The one script-call path every Redis operation takes ([`invoke`]): the health gate, the
//! script by SHA (its source on `NOSCRIPT`), `WAIT` in the same pipeline, and the retries of a
//! call that may be sent again.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use redis::{Cmd, ErrorKind, RedisResult, Script, ServerErrorKind, Value};
use tokio::time::Instant;

use super::connection::Conn;
use super::errors::{is_transient, redis_error};
use super::{CALLS, Connection, Replicas};
use crate::Error;
use crate::backend::health;

/// A Lua script, sent by SHA once the server knows it.
pub(super) struct Lua {
    source: &'static str,
    script: OnceLock<Script>,
}

impl Lua {
    /// The script of `source`, hashed at its first call.
    pub(super) const fn new(source: &'static str) -> Self {
        Lua {
            source,
            script: OnceLock::new(),
        }
    }

    fn sha(&self) -> &str {
        self.script
            .get_or_init(|| Script::new(self.source))
            .get_hash()
    }
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
    let result = send(lua, &mut conn, op, until, replicas, args).await;
    if let Err(e) = &result {
        health::failed(shared, e);
    }
    result.map_err(|e| redis_error(e, op, shared.health.label()))
}

/// What one call of [`send`] has been through so far: each kind of retry is bounded, and the
/// script is told when it may have run already.
struct Retries {
    /// The server lacked the script: its whole source goes from now on (`EVAL`).
    source: bool,
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
    lua: &Lua,
    conn: &mut Conn,
    op: &'static str,
    until: Instant,
    replicas: Option<Replicas>,
    args: impl Fn(&mut Cmd, bool),
) -> RedisResult<(Value, Option<i64>)> {
    let mut tried = Retries {
        source: false,
        repeat: false,
        dropped: false,
        moved: false,
        pushes: 0,
        pause: Duration::from_millis(10),
    };
    loop {
        let mut command = if tried.source {
            let mut command = redis::cmd("EVAL");
            command.arg(lua.source);
            command
        } else {
            let mut command = redis::cmd("EVALSHA");
            command.arg(lua.sha());
            command
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
            // Nothing ran, so `repeat` stays as it was.
            Err(e) if !tried.source && e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                tried.source = true;
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
