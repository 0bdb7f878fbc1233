//! How the rendezvous reads etcd's errors, at the I/O edge: which failures can pass by
//! themselves and which are configuration that no retry fixes ([`transient`]), which say
//! etcd is too busy on a connection that works ([`overloaded`]), which refuse a request for
//! its size ([`too_large`]) or its lease ([`lease_not_found`]), the error of an op etcd
//! never answered ([`unanswered`]), and an error told in a few words ([`short_cause`]).
//!
//! Every decision here is made on an error's kind, its gRPC code and etcd's own error
//! descriptions, as etcd's Go client makes them; the rest of the crate asks these
//! functions and never looks at an error's text.

/// The keep-alive stream a joining node kept from its grant ended before its watches
/// opened over it (the driver's and the simulator's word alike).
pub(crate) fn kept_stream_ended() -> etcd_client::Error {
    let e = std::io::Error::other("the keep-alive stream kept from the grant ended");
    etcd_client::Error::IoError(e)
}

/// The error of an op that etcd did not answer within `patience` (the driver's deadline):
/// a transient failure, and a sign that the connection itself is wedged.
pub(crate) fn unanswered(patience: std::time::Duration) -> etcd_client::Error {
    etcd_client::Error::IoError(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        Unanswered(patience),
    ))
}

/// Whether `e` is [`unanswered`]'s: requests on that connection may never return, so the
/// session reconnects on a fresh one, even to the same endpoint.
pub(crate) fn is_unanswered(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::IoError(io) if io.get_ref().is_some_and(|r| r.is::<Unanswered>()))
}

#[derive(Debug)]
struct Unanswered(std::time::Duration);

impl std::fmt::Display for Unanswered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "etcd did not answer within {:?}", self.0)
    }
}

impl std::error::Error for Unanswered {}

/// Whether an error can go away by itself (etcd starting, a network blip) as opposed to a
/// configuration problem that retrying cannot fix. Decided by the error's kind and gRPC
/// code, never its text: a malformed endpoint or a refused credential fails at once
/// instead of being retried for the whole window as if etcd were down.
pub fn transient(e: &etcd_client::Error) -> bool {
    use etcd_client::Error as E;
    use tonic::Code;
    match e {
        // The request never left: the endpoint, an argument or a header is malformed.
        E::InvalidArgs(_)
        | E::InvalidUri(_)
        | E::InvalidMetadataValue(_)
        | E::EndpointError(_)
        | E::EndpointsNotManaged
        | E::Utf8Error(_) => false,
        // etcd answered and said no: bad user or password (InvalidArgument), credentials
        // given to an etcd without auth (FailedPrecondition), missing rights.
        E::GRpcStatus(s) => {
            !matches!(
                s.code(),
                Code::InvalidArgument
                    | Code::FailedPrecondition
                    | Code::PermissionDenied
                    | Code::Unauthenticated
                    | Code::Unimplemented
                    | Code::OutOfRange
            ) && !tls_refused(s)
        }
        E::TransportError(t) => !tls_refused(t),
        E::IoError(io) => !tls_refused(io),
        // Connecting and everything else: possibly a server still starting.
        _ => true,
    }
}

/// Whether etcd answered that it is too busy for the request, on a connection that
/// works: a proposal or a linearizable read that timed out inside the server ("request
/// timed out", "waiting for the applied index took too long"), or its request limiter
/// ("too many requests"). The gRPC code (Unavailable, ResourceExhausted) is shared with a
/// connection that failed, so etcd's own error descriptions decide, as etcd's Go client
/// decides them (its rpctypes match the same descriptions). Such an answer is no reason
/// to drop the watches and read the run again: that is load added exactly when etcd is
/// slowest (at 1,000 agents on two cores, hundreds re-reading the whole run at once made
/// etcd slower still, and more of them gave up); the request is sent again later instead.
pub fn overloaded(e: &etcd_client::Error) -> bool {
    use tonic::Code;
    let etcd_client::Error::GRpcStatus(s) = e else {
        return false;
    };
    let said = s.message();
    // The limiter's answer reaches etcd-client with the code Unknown (seen at 4,000
    // joining nodes), not ResourceExhausted: its description alone decides.
    // Not "request timed out, possibly due to previous leader failure" nor "…connection
    // lost": those are a member without its leader, where another member is the way on.
    said == "etcdserver: too many requests"
        || (s.code() == Code::Unavailable
            && matches!(
                said,
                "etcdserver: request timed out"
                    | "etcdserver: request timed out, waiting for the applied index took too long"
            ))
}

/// Whether etcd refused a request for its size: over `--max-request-bytes` (1.5 MiB by
/// default) etcd says so itself, and over that plus its gRPC margin (512 KiB) gRPC does.
/// Sending it again cannot help.
pub(crate) fn too_large(e: &etcd_client::Error) -> bool {
    use tonic::Code;
    let etcd_client::Error::GRpcStatus(s) = e else {
        return false;
    };
    match s.code() {
        Code::InvalidArgument => s.message() == "etcdserver: request is too large",
        Code::ResourceExhausted => s
            .message()
            .starts_with("grpc: received message larger than max"),
        _ => false,
    }
}

/// A TLS handshake that failed on its content (a certificate refused by either side, or
/// TLS spoken to a plaintext server): rustls reports it as an `InvalidData` I/O error
/// somewhere down the error's source chain.
fn tls_refused(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(err) = next {
        if err
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::InvalidData)
        {
            return true;
        }
        next = err.source();
    }
    false
}

/// An etcd client error in a few words: the innermost I/O error ("Connection refused")
/// where there is one, else the gRPC status' message, else its own text cut short. Its
/// own text nests every layer (hundreds of characters of debug output).
pub fn short_cause(e: &etcd_client::Error) -> String {
    use std::error::Error as _;
    let mut io = None;
    // etcd-client's error names no source: start from the status' or transport's own.
    let mut next: Option<&(dyn std::error::Error + 'static)> = match e {
        etcd_client::Error::GRpcStatus(s) => s.source().map(|s| s as _),
        etcd_client::Error::TransportError(t) => Some(t),
        etcd_client::Error::IoError(io) => Some(io),
        _ => None,
    };
    while let Some(err) = next {
        if let Some(found) = err.downcast_ref::<std::io::Error>() {
            io = Some(found.to_string());
        }
        next = err.source();
    }
    if let Some(io) = io {
        // "Connection refused (os error 111)": the number adds nothing for a person.
        return io.split(" (os error").next().unwrap_or(&io).to_owned();
    }
    let text = match e {
        etcd_client::Error::GRpcStatus(s) => s.message().to_owned(),
        other => other.to_string(),
    };
    match text.char_indices().nth(160) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

/// Whether etcd refused a request because the lease it names does not exist (any more).
pub fn lease_not_found(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s)
        if s.code() == tonic::Code::NotFound && s.message().contains("lease not found"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use etcd_client::Error as E;
    use tonic::Status;

    #[test]
    fn a_request_over_etcds_size_limit_is_told_from_other_refusals() {
        let big = E::GRpcStatus(Status::invalid_argument("etcdserver: request is too large"));
        let bigger = E::GRpcStatus(Status::resource_exhausted(
            "grpc: received message larger than max (2700000 vs. 2097152)",
        ));
        assert!(too_large(&big) && too_large(&bigger));
        for other in [
            E::GRpcStatus(Status::invalid_argument("etcdserver: key is not provided")),
            E::GRpcStatus(Status::unavailable("etcdserver: request timed out")),
            E::GRpcStatus(Status::resource_exhausted(
                "etcdserver: mvcc: database space exceeded",
            )),
        ] {
            assert!(!too_large(&other), "{other}");
        }
    }

    #[test]
    fn configuration_errors_are_permanent_and_outages_transient() {
        for permanent in [
            E::InvalidArgs("x".into()),
            E::EndpointError("x".into()),
            E::GRpcStatus(Status::invalid_argument(
                "etcdserver: authentication failed, invalid user ID or password",
            )),
            E::GRpcStatus(Status::invalid_argument("etcdserver: user name is empty")),
            E::GRpcStatus(Status::failed_precondition(
                "etcdserver: authentication is not enabled",
            )),
            E::GRpcStatus(Status::permission_denied("etcdserver: permission denied")),
            E::GRpcStatus(Status::unauthenticated("etcdserver: invalid auth token")),
            // What a refused client certificate looks like: a rustls alert under the status.
            E::GRpcStatus(Status::from_error(Box::new(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "received fatal alert: BadCertificate",
            )))),
        ] {
            assert!(!transient(&permanent), "{permanent}");
        }
        for passing in [
            E::GRpcStatus(Status::unavailable("etcdserver: leader changed")),
            E::GRpcStatus(Status::deadline_exceeded("etcdserver: request timed out")),
            E::GRpcStatus(Status::unknown("transport error")),
            E::IoError(std::io::ErrorKind::ConnectionRefused.into()),
        ] {
            assert!(transient(&passing), "{passing}");
        }
    }
}
