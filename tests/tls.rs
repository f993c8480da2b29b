//! `rediss://`: a real redis-server speaking TLS with a certificate from a private CA made at
//! test time, trusted through `add_root_certificate_pem`; and the ways it goes wrong (an
//! untrusted certificate, a plain-TCP server behind `rediss://`), each a clear error within
//! the connect timeout.

mod support;

use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use tokio::time::Instant;
use tower_distributed_limit::{Error, RedisBackend, Semaphore};

use support::{Redis, RedisProcess};

/// A CA, and a server certificate for 127.0.0.1 signed by it.
struct Pki {
    ca_pem: String,
    cert_pem: String,
    key_pem: String,
}

fn pki(common_name: &str) -> Pki {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, common_name);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let server_key = KeyPair::generate().unwrap();
    let server = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
        .unwrap()
        .signed_by(&server_key, &issuer)
        .unwrap();
    Pki {
        ca_pem: ca_cert.pem(),
        cert_pem: server.pem(),
        key_pem: server_key.serialize_pem(),
    }
}

/// A redis-server that speaks only TLS, with `pki`'s server certificate.
async fn tls_redis(pki: &Pki) -> RedisProcess {
    RedisProcess::start(|port, dir| {
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path.to_str().unwrap().to_owned()
        };
        vec![
            "--port".into(),
            "0".into(),
            "--tls-port".into(),
            port.to_string(),
            "--tls-cert-file".into(),
            write("server.crt", &pki.cert_pem),
            "--tls-key-file".into(),
            write("server.key", &pki.key_pem),
            "--tls-ca-cert-file".into(),
            write("ca.crt", &pki.ca_pem),
            "--tls-auth-clients".into(),
            "no".into(),
        ]
    })
    .await
}

fn tls_url(redis: &RedisProcess) -> String {
    format!("rediss://127.0.0.1:{}", redis.port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_server_with_a_private_ca_shares_a_limit() {
    let pki = pki("dlimit test CA");
    let redis = tls_redis(&pki).await;
    let connect = || {
        RedisBackend::builder(tls_url(&redis).as_str())
            .add_root_certificate_pem(&pki.ca_pem)
            .connect()
    };
    let a = Semaphore::builder("tls")
        .limit(1)
        .acquire_timeout(Duration::from_secs(5))
        .build(connect().await.expect("TLS with the private CA"))
        .unwrap();
    let b = Semaphore::builder("tls")
        .limit(1)
        .build(connect().await.unwrap())
        .unwrap();
    let held = a.acquire().await.unwrap();
    assert!(
        b.try_acquire().await.unwrap().is_none(),
        "one limit over TLS"
    );
    // A waiter over TLS is woken by the grant announced on the same TLS connection.
    let waiter = tokio::spawn(async move { b.acquire().await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(held);
    let permit = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter is served")
        .unwrap()
        .unwrap();
    assert!(!permit.is_lost());
}

/// The server's certificate comes from a CA we were not told to trust.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_certificate_is_a_clear_error_within_the_connect_timeout() {
    let redis = tls_redis(&pki("the server's CA")).await;
    let other = pki("some other CA");
    let started = Instant::now();
    let err = RedisBackend::builder(tls_url(&redis).as_str())
        .add_root_certificate_pem(&other.ca_pem)
        .connect_timeout(Duration::from_millis(500))
        .connect()
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let message = err.to_string();
    assert!(matches!(err, Error::Backend(_)), "{err:?}");
    assert!(message.contains("TLS"), "{message}");
}

/// `rediss://` pointed at a server that speaks plain TCP: an error, never a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_server_behind_rediss_is_a_clear_error_within_the_connect_timeout() {
    let plain = Redis::start().await;
    let url = plain.url.replace("redis://", "rediss://");
    let started = Instant::now();
    let err = RedisBackend::builder(url.as_str())
        .add_root_certificate_pem(pki("any CA").ca_pem)
        .connect_timeout(Duration::from_millis(500))
        .connect()
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(err, Error::Backend(_)), "{err:?}");
    assert!(err.to_string().contains("TLS"), "{err}");
}

#[tokio::test]
async fn root_certificates_need_a_tls_url() {
    let err = RedisBackend::builder("redis://127.0.0.1:1")
        .add_root_certificate_pem("-----BEGIN CERTIFICATE-----")
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err:?}");
    assert!(err.to_string().contains("rediss://"), "{err}");
}
