//! `rediss://`: a real redis-server speaking TLS with a certificate from a private CA made at
//! test time, trusted through `add_root_certificate_pem`; and the ways it goes wrong (an
//! untrusted certificate, a plain-TCP server behind `rediss://`), each a clear error within
//! the connect timeout.

mod support;

use std::net::TcpListener;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use tokio::process::{Child, Command};
use tokio::time::Instant;
use tower_distributed_limit::{Error, RedisBackend, Semaphore};

use support::{Redis, eventually};

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

/// A redis-server that speaks only TLS, on a free loopback port; killed when dropped.
struct TlsRedis {
    _child: Child,
    _dir: TempDir,
    port: u16,
}

struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    assert_ne!(port, 6379);
    port
}

impl TlsRedis {
    async fn start(pki: &Pki) -> TlsRedis {
        let dir = std::env::temp_dir().join(format!("dlimit-tls-{}", fastrand::u64(..)));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let cert = write("server.crt", &pki.cert_pem);
        let key = write("server.key", &pki.key_pem);
        let ca = write("ca.crt", &pki.ca_pem);
        let port = free_port();
        let arg = |path: &Path| path.to_str().unwrap().to_owned();
        let child = Command::new("redis-server")
            .args([
                "--port",
                "0",
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--tls-port", &port.to_string()])
            .args(["--tls-cert-file", &arg(&cert), "--tls-key-file", &arg(&key)])
            .args(["--tls-ca-cert-file", &arg(&ca), "--tls-auth-clients", "no"])
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start redis-server");
        let server = TlsRedis {
            _child: child,
            _dir: TempDir(dir),
            port,
        };
        eventually(
            Duration::from_secs(10),
            "the TLS port to listen",
            || async {
                tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .is_ok()
            },
        )
        .await;
        server
    }

    fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.port)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_server_with_a_private_ca_shares_a_limit() {
    let pki = pki("dlimit test CA");
    let redis = TlsRedis::start(&pki).await;
    let connect = || {
        RedisBackend::builder(redis.url().as_str())
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
    let redis = TlsRedis::start(&pki("the server's CA")).await;
    let other = pki("some other CA");
    let started = Instant::now();
    let err = RedisBackend::builder(redis.url().as_str())
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
