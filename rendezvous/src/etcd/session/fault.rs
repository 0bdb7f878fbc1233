//! An etcd failure as the machine sees it: a kind to match on, sorted once at the I/O
//! edge ([`crate::etcd::errors`] reads etcd's codes and descriptions), so that nothing
//! inside [`super::Machine::step`] looks at an error's text. The error itself rides along
//! for the log lines and for the command whose answer it is.

use crate::etcd::errors;

/// What a failure means to the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// etcd is too busy for the request, on a connection that works
    /// ([`errors::overloaded`]): the same request goes again later.
    Overloaded,
    /// The request is larger than etcd takes ([`errors::too_large`]).
    TooLarge,
    /// The lease the request names does not exist (any more).
    LeaseNotFound,
    /// etcd did not answer within the driver's patience ([`errors::unanswered`]): the
    /// connection may be wedged.
    Unanswered,
    /// etcd answered with another refusal.
    Refused,
    /// The connection or the stream failed without a word from etcd.
    Connection,
}

/// An etcd failure, sorted.
#[derive(Debug)]
pub struct Fault {
    pub kind: FaultKind,
    /// It can pass by itself ([`errors::transient`]), as opposed to configuration that no
    /// retry fixes.
    pub transient: bool,
    error: etcd_client::Error,
}

impl Fault {
    /// Whether etcd itself said this (not the driver, the connection or the clock).
    pub fn said_by_etcd(&self) -> bool {
        matches!(self.error, etcd_client::Error::GRpcStatus(_))
    }

    /// A failure the machine itself finds (an answer of the wrong kind, a keep-alive late
    /// enough to try another member): a connection failure, transient.
    pub fn local(kind: std::io::ErrorKind, what: String) -> Self {
        etcd_client::Error::IoError(std::io::Error::new(kind, what)).into()
    }
}

impl From<etcd_client::Error> for Fault {
    fn from(error: etcd_client::Error) -> Self {
        let kind = if errors::overloaded(&error) {
            FaultKind::Overloaded
        } else if errors::too_large(&error) {
            FaultKind::TooLarge
        } else if errors::lease_not_found(&error) {
            FaultKind::LeaseNotFound
        } else if errors::is_unanswered(&error) {
            FaultKind::Unanswered
        } else if matches!(error, etcd_client::Error::GRpcStatus(_)) {
            FaultKind::Refused
        } else {
            FaultKind::Connection
        };
        Fault {
            kind,
            transient: errors::transient(&error),
            error,
        }
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for Fault {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: tonic::Code, said: &str) -> Fault {
        etcd_client::Error::GRpcStatus(tonic::Status::new(code, said)).into()
    }

    #[test]
    fn each_failure_is_sorted_once_by_what_etcd_said() {
        use tonic::Code;
        let busy = status(Code::Unavailable, "etcdserver: request timed out");
        assert_eq!(
            (busy.kind, busy.transient, busy.said_by_etcd()),
            (FaultKind::Overloaded, true, true)
        );
        let large = status(Code::InvalidArgument, "etcdserver: request is too large");
        assert_eq!((large.kind, large.transient), (FaultKind::TooLarge, false));
        let gone = status(Code::NotFound, "etcdserver: requested lease not found");
        assert_eq!(gone.kind, FaultKind::LeaseNotFound);
        let denied = status(Code::PermissionDenied, "etcdserver: permission denied");
        assert_eq!((denied.kind, denied.transient), (FaultKind::Refused, false));
        let late: Fault = errors::unanswered(std::time::Duration::from_secs(3)).into();
        assert_eq!(
            (late.kind, late.transient, late.said_by_etcd()),
            (FaultKind::Unanswered, true, false)
        );
        let cut = Fault::local(std::io::ErrorKind::ConnectionReset, "cut".into());
        assert_eq!((cut.kind, cut.transient), (FaultKind::Connection, true));
        assert_eq!(
            cut.to_string(),
            etcd_client::Error::IoError(std::io::Error::other("cut")).to_string()
        );
    }
}
