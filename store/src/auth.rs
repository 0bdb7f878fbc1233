//! etcd's password authentication, as etcd's clients speak it: `Auth/Authenticate` with a
//! user name and password returns a token, and every later request carries it in the
//! `token` metadata header (etcd-client and etcdctl both do this when given a user).
//!
//! With no [`Credentials`] the store is open, as torchrun's TCPStore is. With them, every
//! KV, Watch, Lease, Cluster and Maintenance call must carry a token this store handed
//! out, and the refusals are etcd's own (code and message), so a client reports them as
//! it would an etcd's:
//!
//! * no token: `InvalidArgument`, `etcdserver: user name is empty`;
//! * a token this store did not issue: `Unauthenticated`, `etcdserver: invalid auth token`;
//! * a wrong user or password: `InvalidArgument`,
//!   `etcdserver: authentication failed, invalid user ID or password`;
//! * `Authenticate` on an open store: `FailedPrecondition`,
//!   `etcdserver: authentication is not enabled`.
//!
//! Tokens are 256 random bits, kept only as SHA-256 digests (a lookup by digest tells a
//! timing observer nothing about a token it does not have), and never expire: an agent
//! authenticates once per connection and must not lose its lease to a token's age. The
//! most recent [`MAX_TOKENS`] are kept. Passwords are compared as digests, in constant
//! time.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use ring::digest::{SHA256, digest};
use ring::rand::{SecureRandom, SystemRandom};
use tonic::{Request, Status};

/// Tokens kept; beyond this the oldest stops working (its client authenticates again on
/// reconnecting). Far above one per agent of a thousand-node job.
pub const MAX_TOKENS: usize = 16_384;

/// The metadata header etcd's clients send the token in.
pub const TOKEN_HEADER: &str = "token";

/// The one user the store accepts. Its `Debug` hides the password.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub user: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("user", &self.user)
            .field("password", &"***")
            .finish()
    }
}

type Digest = [u8; 32];

fn sha256(bytes: &[u8]) -> Digest {
    let mut out = [0u8; 32];
    out.copy_from_slice(digest(&SHA256, bytes).as_ref());
    out
}

/// Equal digests, in time that does not depend on where they differ.
fn same(a: &Digest, b: &Digest) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

struct Secret {
    user: Digest,
    password: Digest,
    issued: Mutex<Issued>,
    random: SystemRandom,
}

#[derive(Default)]
struct Issued {
    digests: HashSet<Digest>,
    order: VecDeque<Digest>,
}

/// The store's gate: open, or closed to all but holders of a token.
#[derive(Clone, Default)]
pub struct Gate {
    secret: Option<Arc<Secret>>,
}

impl Gate {
    /// Anyone who reaches the port gets in.
    pub fn open() -> Self {
        Self::default()
    }

    pub fn new(credentials: Option<&Credentials>) -> Self {
        Self {
            secret: credentials.map(|c| {
                Arc::new(Secret {
                    user: sha256(c.user.as_bytes()),
                    password: sha256(c.password.as_bytes()),
                    issued: Mutex::default(),
                    random: SystemRandom::new(),
                })
            }),
        }
    }

    pub fn is_open(&self) -> bool {
        self.secret.is_none()
    }

    /// A new token for the right user and password, as etcd's `Authenticate`.
    pub fn authenticate(&self, user: &str, password: &str) -> Result<String, Status> {
        let Some(s) = &self.secret else {
            return Err(Status::failed_precondition(
                "etcdserver: authentication is not enabled",
            ));
        };
        if user.is_empty() {
            return Err(Status::invalid_argument("etcdserver: user name is empty"));
        }
        // Both compared, whatever the first gave, so the time says nothing about which.
        let user_ok = same(&sha256(user.as_bytes()), &s.user);
        let password_ok = same(&sha256(password.as_bytes()), &s.password);
        if !(user_ok & password_ok) {
            return Err(Status::invalid_argument(
                "etcdserver: authentication failed, invalid user ID or password",
            ));
        }
        let mut raw = [0u8; 32];
        s.random
            .fill(&mut raw)
            .map_err(|_| Status::internal("etcdserver: no randomness for a token"))?;
        let token: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        let mut issued = s.issued.lock().unwrap_or_else(|p| p.into_inner());
        let d = sha256(token.as_bytes());
        if issued.digests.insert(d) {
            issued.order.push_back(d);
        }
        while issued.order.len() > MAX_TOKENS {
            if let Some(old) = issued.order.pop_front() {
                issued.digests.remove(&old);
            }
        }
        Ok(token)
    }

    /// Whether `req` may proceed: always on an open store, else only with an issued token.
    pub fn check<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let Some(s) = &self.secret else {
            return Ok(());
        };
        let Some(token) = req.metadata().get(TOKEN_HEADER) else {
            return Err(Status::invalid_argument("etcdserver: user name is empty"));
        };
        let d = sha256(token.as_bytes());
        let issued = s.issued.lock().unwrap_or_else(|p| p.into_inner());
        if issued.digests.contains(&d) {
            Ok(())
        } else {
            Err(Status::unauthenticated("etcdserver: invalid auth token"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate() -> Gate {
        Gate::new(Some(&Credentials {
            user: "fsdp".into(),
            password: "s3cret".into(),
        }))
    }

    fn with_token(token: Option<&str>) -> Request<()> {
        let mut r = Request::new(());
        if let Some(t) = token {
            r.metadata_mut().insert(TOKEN_HEADER, t.parse().unwrap());
        }
        r
    }

    #[test]
    fn an_open_store_lets_everyone_in_and_has_no_authenticate() {
        let g = Gate::open();
        assert!(g.check(&with_token(None)).is_ok());
        let e = g.authenticate("fsdp", "x").unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    }

    #[test]
    fn a_closed_store_wants_a_token_it_issued() {
        let g = gate();
        let e = g.check(&with_token(None)).unwrap_err();
        assert_eq!(
            (e.code(), e.message()),
            (
                tonic::Code::InvalidArgument,
                "etcdserver: user name is empty"
            )
        );
        let e = g.check(&with_token(Some("forged"))).unwrap_err();
        assert_eq!(
            (e.code(), e.message()),
            (
                tonic::Code::Unauthenticated,
                "etcdserver: invalid auth token"
            )
        );
        let t = g.authenticate("fsdp", "s3cret").unwrap();
        assert!(g.check(&with_token(Some(&t))).is_ok());
        let t2 = g.authenticate("fsdp", "s3cret").unwrap();
        assert_ne!(t, t2, "a token per authentication");
        assert!(g.check(&with_token(Some(&t))).is_ok());
    }

    #[test]
    fn a_wrong_user_or_password_is_refused_as_etcd_refuses_it() {
        let g = gate();
        for (u, p) in [("fsdp", "wrong"), ("root", "s3cret"), ("fsdp", "")] {
            let e = g.authenticate(u, p).unwrap_err();
            assert_eq!(
                (e.code(), e.message()),
                (
                    tonic::Code::InvalidArgument,
                    "etcdserver: authentication failed, invalid user ID or password"
                ),
                "{u}/{p}"
            );
        }
    }

    #[test]
    fn the_oldest_tokens_go_past_the_cap() {
        let g = gate();
        let first = g.authenticate("fsdp", "s3cret").unwrap();
        for _ in 0..MAX_TOKENS {
            g.authenticate("fsdp", "s3cret").unwrap();
        }
        assert!(g.check(&with_token(Some(&first))).is_err());
    }
}
