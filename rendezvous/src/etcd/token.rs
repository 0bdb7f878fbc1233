//! A token that expired mid-run. etcd's tokens expire (simple tokens after
//! `--auth-token-ttl` unused, JWTs at their `exp`), and so do the c10d store's; the server
//! answers `invalid auth token`, and etcd's Go client authenticates again and sends the
//! request once more. etcd-client does neither, so an agent that ran longer than a token
//! lived would take the refusal for a wrong password and end. Every call that carries a
//! token goes through [`renewing`] (or [`renew`] when the call needs `&mut` state).

use std::future::Future;

use etcd_client::{Client, Error};

/// Whether `e` says the token this client sent is no longer good (expired, or signed
/// before the server's users changed), not that the password is wrong: authenticating
/// again is the cure.
pub(crate) fn expired(e: &Error) -> bool {
    // etcd sends the second with InvalidArgument (its ErrGRPCAuthOldRevision), the first
    // with Unauthenticated.
    matches!(e, Error::GRpcStatus(s)
        if (s.code() == tonic::Code::Unauthenticated && s.message() == "etcdserver: invalid auth token")
            || s.message() == "etcdserver: revision of auth store is old")
}

/// Authenticates `client` again after `refused` ([`expired`]): its calls carry the new
/// token from now on. A refusal of the password itself is the error.
pub(crate) async fn renew(client: &Client, refused: &Error) -> Result<(), Error> {
    tracing::debug!(error = %refused, "the store's token is no longer good; authenticating again");
    client.refresh_token().await
}

/// `call`, and once more after authenticating again if the token it carried had expired.
pub(crate) async fn renewing<T, F, Fut>(client: &Client, mut call: F) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    match call().await {
        Err(e) if expired(&e) => {
            renew(client, &e).await?;
            call().await
        }
        answer => answer,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::{Code, Status};

    #[test]
    fn only_a_stale_token_is_renewed_never_a_wrong_password() {
        let stale = Error::GRpcStatus(Status::unauthenticated("etcdserver: invalid auth token"));
        let old = Error::GRpcStatus(Status::invalid_argument(
            "etcdserver: revision of auth store is old",
        ));
        assert!(expired(&stale) && expired(&old));
        for other in [
            Status::invalid_argument(
                "etcdserver: authentication failed, invalid user ID or password",
            ),
            Status::invalid_argument("etcdserver: user name is empty"),
            Status::new(Code::PermissionDenied, "etcdserver: permission denied"),
            Status::unavailable("etcdserver: invalid auth token"),
        ] {
            assert!(!expired(&Error::GRpcStatus(other.clone())), "{other:?}");
        }
    }
}
