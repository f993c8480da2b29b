//! One node's connection, as every connection of the crate sets it up: its pushes (grant
//! announcements, lost connections) sent on, bounded calls and one attempt per reconnect.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, ConnectionInfo, PushInfo, RedisResult};

/// Where pushes go: grant announcements and lost connections.
pub(in crate::backend) type Pushes = Arc<dyn Fn(PushInfo) + Send + Sync>;

/// Root certificates to trust for TLS (`rediss://`): redis-rs's type with the `tls` feature;
/// without it, a type with no value, so no TLS code is compiled and none can be asked for.
#[cfg(feature = "tls")]
pub(super) type Certificates = redis::TlsCertificates;
#[cfg(not(feature = "tls"))]
#[derive(Clone)]
pub(super) enum Certificates {}

/// A client for `info`, trusting `certificates` for TLS (`None`: the system's CAs).
pub(super) fn client(
    info: ConnectionInfo,
    certificates: Option<Certificates>,
) -> RedisResult<Client> {
    match certificates {
        #[cfg(feature = "tls")]
        Some(certificates) => Client::build_with_tls(info, certificates),
        #[cfg(not(feature = "tls"))]
        Some(none) => match none {},
        None => Client::open(info),
    }
}

/// The timeouts and TLS roots of a connection to one node.
#[derive(Clone)]
pub(super) struct NodeSettings {
    pub(super) call_timeout: Duration,
    pub(super) connect_timeout: Duration,
    /// Root certificates for TLS (`rediss://`), or `None` for the system's.
    pub(super) certificates: Option<Certificates>,
}

/// A connection manager for one node, sending its pushes to `pushes`.
pub(in crate::backend) async fn manager(
    client: Client,
    pushes: &Pushes,
    call_timeout: Duration,
    connect_timeout: Duration,
) -> RedisResult<ConnectionManager> {
    ConnectionManager::new_with_config(
        client,
        manager_config(pushes, call_timeout, connect_timeout),
    )
    .await
}

/// How every connection manager of the crate is set up: pushes to `pushes`, subscriptions
/// restored after a reconnect, bounded calls, and a single bounded attempt per reconnect.
pub(in crate::backend) fn manager_config(
    pushes: &Pushes,
    call_timeout: Duration,
    connect_timeout: Duration,
) -> ConnectionManagerConfig {
    let pushes = pushes.clone();
    ConnectionManagerConfig::new()
        .set_push_sender(move |push: PushInfo| {
            pushes(push);
            Ok::<(), std::convert::Infallible>(())
        })
        .set_automatic_resubscription()
        .set_response_timeout(Some(call_timeout))
        .set_connection_timeout(Some(connect_timeout))
        // One attempt per reconnect: while a server is down, the backend's probe retries
        // (`health`), and no call waits behind a series of attempts.
        .set_number_of_retries(0)
}
