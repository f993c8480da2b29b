//! What a Redis failure means, in words that say what to do: a first connection that failed
//! ([`connect_error`]), a call that failed ([`redis_error`]), and which failures pass by
//! themselves, so a call is asked again ([`is_transient`]).

use redis::{ErrorKind, RedisError, ServerErrorKind};

use super::connection::{Nodes, Target};
use crate::Error;

/// A server state that passes by itself: loading its data set after a restart (`LOADING`),
/// running a long script (`BUSY`), a cluster slot moving (`TRYAGAIN`), no master (`MASTERDOWN`).
pub(super) fn is_transient(e: &RedisError) -> bool {
    matches!(e.retry_method(), redis::RetryMethod::WaitAndRetry)
        || e.code() == Some("BUSY")
        // A replica, or a master demoted meanwhile: through Sentinel, the next attempt asks
        // the sentinels for the master first.
        || e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly)
}

/// A first connection that failed: what failed, and what to check.
pub(super) fn connect_error(e: RedisError, target: &Target, label: &str) -> Error {
    let text = short(&e);
    // Only where the message leaves the Redis text out is the error kept as the source: its
    // own chain repeats the text.
    let mut source = None;
    let message = if let Nodes::Sentinel(_, master) = &target.nodes {
        format!(
            "cannot reach the master {master:?} through the sentinels ({text}); check the \
             sentinel URLs, that they monitor a master of that name, and that it is up"
        )
    } else if let Some(problem) = access_problem(&e) {
        return Error::access_denied(format!("cannot connect to Redis at {label}: {problem}"));
    } else if target.tls && text.contains("certificate") {
        format!(
            "cannot open a TLS connection to Redis at {label}: the server's certificate is not \
             trusted ({text}); add the CA that signed it with \
             RedisBackendBuilder::add_root_certificate_pem, and check the host name it was \
             issued for"
        )
    } else if target.tls {
        format!(
            "cannot open a TLS connection to Redis at {label} ({text}); check that the server \
             is up and speaks TLS on this port (a plain-TCP port never answers the handshake)"
        )
    } else if e.is_connection_refusal() {
        source = Some(Box::new(e) as _);
        format!(
            "cannot connect to Redis at {label}: connection refused; check that the server is \
             up and the URL's host and port are right (connect_lazy starts without it)"
        )
    } else {
        format!(
            "cannot connect to Redis at {label} ({text}); check that the server is up and \
             reachable (connect_lazy starts without it)"
        )
    };
    Error::backend(message, source)
}

/// Credentials or permissions the server refused, in words that say what to change.
/// The error's text without what the client library repeats of its cause.
pub(in crate::backend) fn short(e: &RedisError) -> String {
    let text = e.to_string();
    text.lines().next().unwrap_or_default().to_owned()
}

pub(in crate::backend) fn access_problem(e: &RedisError) -> Option<String> {
    let code = e.code();
    if let Some(refused) = server_detail(e).and_then(|detail| refused_in_script(code, &detail)) {
        return Some(refused);
    }
    if e.kind() == ErrorKind::AuthenticationFailed || matches!(code, Some("NOAUTH" | "WRONGPASS")) {
        Some(
            "authentication failed (no password, or a wrong one); put the credentials in the \
             URL (redis://:password@host:port, or redis://user:password@host:port with ACLs) or \
             in the ConnectionInfo given to the builder"
                .to_owned(),
        )
    } else if e.kind() == ErrorKind::Server(ServerErrorKind::NoPerm) {
        Some(
            "the Redis user lacks a permission (ACL NOPERM); allow it EVAL, EVALSHA, PUBLISH, \
             SUBSCRIBE, WAIT and PING (SPUBLISH/SSUBSCRIBE on a Cluster) on the keys and \
             channels under the key prefix, and FCALL and FUNCTION LOAD for the faster calls \
             of Redis 7"
                .to_owned(),
        )
    } else {
        None
    }
}

/// A command the scripts run, refused by the user's ACL inside a script (`code` and `detail`:
/// the server's error code and its words after it), in words that name every command to
/// allow. Three wordings: Redis 7.0's, which names neither the command nor the key (`ERR The
/// user executing the script can't run this command or subcommand script: ...`), later
/// Redis's (`NOPERM User app has no permissions to run the 'zadd' command script: ...`) and
/// Valkey's (`ERR ACL failure in script: User app has no permissions to run the 'zadd'
/// command script: ...`).
fn refused_in_script(code: Option<&str>, detail: &str) -> Option<String> {
    let named = match code {
        Some("ERR") if detail.starts_with(SCRIPT_REFUSED) => None,
        Some("ERR") if detail.starts_with(ACL_FAILURE_IN_SCRIPT) => command_named(detail),
        Some("NOPERM") if detail.contains(" script: ") => command_named(detail),
        _ => return None,
    };
    let refused = match named {
        Some(command) => format!(
            "the Redis user may not run {} inside this crate's scripts (EVAL, FCALL), or not on \
             one of its keys (ACL)",
            command.to_uppercase()
        ),
        None => "the Redis user may not run a command this crate's scripts run inside EVAL, or \
                 not on one of its keys (ACL)"
            .to_owned(),
    };
    Some(format!(
        "{refused}; besides EVAL and EVALSHA allow it ZADD, ZREM, ZRANGE, ZRANGEBYSCORE, \
         ZRANGEBYLEX, ZREMRANGEBYSCORE, ZCARD, ZCOUNT, ZSCORE, ZSCAN, HGET, HMGET, HSET, HDEL, \
         HSCAN, GET, SET, DEL, EXISTS, PEXPIREAT, PERSIST, TIME, INFO and PUBLISH (SPUBLISH on a \
         Cluster) on the keys and channels under the key prefix"
    ))
}

/// The command in "... no permissions to run the 'zadd' command ...".
fn command_named(detail: &str) -> Option<&str> {
    let (_, rest) = detail.split_once("permissions to run the '")?;
    Some(rest.split_once('\'')?.0).filter(|command| !command.is_empty())
}

/// The server's words after the error code, also of a call pipelined with `WAIT` (redis-rs
/// keeps those only in the pipeline's errors).
pub(super) fn server_detail(e: &RedisError) -> Option<String> {
    e.detail().map(str::to_owned).or_else(|| {
        let errors = e.clone().into_server_errors()?;
        errors.first()?.1.details().map(str::to_owned)
    })
}

/// How Redis 7.0 begins the error of a command refused inside a script: "...can't run this
/// command or subcommand" or "...can't access at least one of the keys".
const SCRIPT_REFUSED: &str = "The user executing the script can't";

/// How Valkey begins it, after `ERR`.
const ACL_FAILURE_IN_SCRIPT: &str = "ACL failure in script:";

/// Says what a Redis failure of `what` on the server `label` means and what to do; the
/// Redis error stays the [`source`](std::error::Error::source) where the message leaves its
/// text out, so no text is repeated down the chain.
pub(super) fn redis_error(e: RedisError, what: &str, label: &str) -> Error {
    let message = if let Some(problem) = access_problem(&e) {
        // The server's words add nothing here, and its error's chain repeats them.
        return Error::access_denied(format!("Redis at {label} refused `{what}`: {problem}"));
    } else if e.is_timeout() {
        format!(
            "Redis at {label} did not answer `{what}` within the call timeout; it may be \
             overloaded, paused or unreachable. Calls fail at once until it answers again"
        )
    } else if e.is_connection_refusal() {
        format!(
            "Redis at {label} refused the connection for `{what}`; check that the server is up. \
             The connection is re-established by itself once it is"
        )
    } else if e.is_io_error() || e.is_connection_dropped() {
        format!(
            "lost the connection to Redis at {label} during `{what}`; it is re-established by \
             itself once the server answers"
        )
    } else if e.code() == Some("WRONGTYPE") {
        "a key of this semaphore holds a value of another type; something else writes under \
         the key prefix: choose another RedisBackend::key_prefix or delete the key"
            .to_owned()
    } else {
        return Error::backend(
            format!("Redis at {label} rejected `{what}`: {}", short(&e)),
            None,
        );
    };
    Error::backend(message, Some(Box::new(e) as _))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `refused_in_script` of a whole error line, as the server sends it.
    fn refused(line: &str) -> Option<String> {
        let (code, detail) = line.split_once(' ').unwrap();
        refused_in_script(Some(code), detail)
    }

    #[test]
    fn a_command_refused_inside_a_script_is_read_in_every_wording() {
        let redis_7_0 = "ERR The user executing the script can't run this command or \
                         subcommand script: 7481e4c697ac13b3e651713dddc08c74870df83c, on \
                         @user_script:1.";
        let redis = "NOPERM User app has no permissions to run the 'zadd' command script: \
                     7481e4c697ac13b3e651713dddc08c74870df83c, on @user_script:1.";
        let valkey = "ERR ACL failure in script: User app has no permissions to run the 'zadd' \
                      command script: 7481e4c697ac13b3e651713dddc08c74870df83c, on \
                      @user_script:1.";
        for line in [redis_7_0, redis, valkey] {
            let text = refused(line).unwrap_or_else(|| panic!("not read: {line}"));
            // Every command to allow, named.
            for command in ["EVALSHA", "ZADD", "HSET", "PUBLISH"] {
                assert!(text.contains(command), "{text}");
            }
        }
        for line in [redis, valkey] {
            let text = refused(line).unwrap();
            assert!(
                text.starts_with("the Redis user may not run ZADD inside"),
                "{text}"
            );
        }
    }

    #[test]
    fn a_command_refused_outside_a_script_is_not_read_as_inside_one() {
        // EVALSHA itself refused: the NOPERM branch names the calls' own commands.
        assert_eq!(
            refused("NOPERM User app has no permissions to run the 'evalsha' command"),
            None
        );
        assert_eq!(refused("ERR unknown command 'FCALL'"), None);
        assert_eq!(refused("ERR Error running script: ACL failure"), None);
    }
}
