//! The TLS material of a connection to etcd: a CA certificate and a client certificate
//! with its key, read from files.

use std::path::PathBuf;

use etcd_client::{Certificate, Identity, TlsOptions};

use crate::RendezvousError;

/// TLS material, as files.
#[derive(Debug, Clone, Default)]
pub struct TlsFiles {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

fn read(path: &PathBuf, what: &str) -> Result<Vec<u8>, RendezvousError> {
    std::fs::read(path).map_err(|e| {
        RendezvousError::InvalidConfig(format!("cannot read {what} {}: {e}", path.display()))
    })
}

/// The TLS options of `files`: the CA they name, and the client identity when they name
/// both its certificate and its key.
pub(super) fn tls_options(files: &TlsFiles) -> Result<TlsOptions, RendezvousError> {
    let mut t = TlsOptions::new();
    if let Some(ca) = &files.ca {
        t = t.ca_certificate(Certificate::from_pem(read(ca, "CA certificate")?));
    }
    match (&files.cert, &files.key) {
        (Some(c), Some(k)) => {
            t = t.identity(Identity::from_pem(
                read(c, "client certificate")?,
                read(k, "client key")?,
            ));
        }
        (None, None) => {}
        _ => {
            return Err(RendezvousError::InvalidConfig(
                "a client certificate needs both ssl_cert and ssl_cert_key".into(),
            ));
        }
    }
    Ok(t)
}
