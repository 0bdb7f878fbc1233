//! The store's TLS, as etcd's: it presents a certificate, and with a CA it requires a
//! client certificate signed by it (etcd's `--client-cert-auth`). Every agent of a c10d
//! run is given the same files: its client presents the same certificate to the store,
//! so that certificate must carry both the server and the client usage and name the
//! endpoint's host.
//!
//! rustls on ring, the crypto stack etcd-client's `tls` feature already brings.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig, crypto};

/// The files the serving agent reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Client certificates must be signed by this CA; `None` accepts any client.
    pub client_ca: Option<PathBuf>,
}

/// Why the store cannot serve TLS (a configuration error: the agent exits 64).
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the c10d store's {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the c10d store's {what} {path} holds no PEM {kind}: give a PEM file (--rdzv-conf {key}=PATH)"
    )]
    Pem {
        what: &'static str,
        path: PathBuf,
        kind: &'static str,
        key: &'static str,
    },
    #[error("the c10d store cannot use its TLS files: {0}")]
    Config(String),
}

fn read(path: &Path, what: &'static str) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_owned(),
        source,
    })
}

/// The acceptor for `files`.
pub fn acceptor(files: &ServerTls) -> Result<TlsAcceptor, TlsError> {
    let provider = Arc::new(crypto::ring::default_provider());
    let certs: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(&read(&files.cert, "certificate")?)
            .filter_map(Result::ok)
            .collect();
    if certs.is_empty() {
        return Err(TlsError::Pem {
            what: "certificate",
            path: files.cert.clone(),
            kind: "certificate",
            key: "cert",
        });
    }
    let key =
        PrivateKeyDer::from_pem_slice(&read(&files.key, "key")?).map_err(|_| TlsError::Pem {
            what: "key",
            path: files.key.clone(),
            kind: "private key",
            key: "key",
        })?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match &files.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in CertificateDer::pem_slice_iter(&read(ca, "CA certificate")?) {
                let c = c.map_err(|e| TlsError::Config(format!("{}: {e}", ca.display())))?;
                roots
                    .add(c)
                    .map_err(|e| TlsError::Config(format!("{}: {e}", ca.display())))?;
            }
            if roots.is_empty() {
                return Err(TlsError::Pem {
                    what: "CA certificate",
                    path: ca.clone(),
                    kind: "certificate",
                    key: "cacert",
                });
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| TlsError::Config(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    // gRPC is HTTP/2 only, and grpc-go clients (etcdctl) insist the server say so.
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}
