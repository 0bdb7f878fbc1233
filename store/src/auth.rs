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
//! etcd-client sends no token on `Lease` calls and on `Cluster/MemberList` (etcd does not
//! ask for one there), so those stay open, as on an etcd; the one that can hurt an agent,
//! `LeaseRevoke`, is only taken on a connection that has authenticated ([`Gate::admit`]).
//!
//! A token is a random nonce, the time it expires and their HMAC-SHA256 under a key derived
//! from the run, the user and the password: checking one needs no table (nothing for a flood
//! of `Authenticate` calls to grow), compares in constant time, and survives the host
//! agent's restart in place (the others' clients keep their tokens and re-register as
//! after an etcd restart). A token is good for [`Credentials::token_ttl`] (etcd's
//! `--auth-token-ttl`, 300 s) and only on a store of its run: one taken from a log or a
//! core dump stops working, and jobs that share a password do not share tokens. A client
//! whose token expired is answered `invalid auth token`, as etcd answers it, and
//! authenticates again (the agents do; etcd's Go client does). Passwords are compared as
//! digests, in constant time.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ring::digest::{SHA256, digest};
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use tonic::{Request, Status};

use crate::bounded_listener::ConnectionMark;

/// The metadata header etcd's clients send the token in.
pub const TOKEN_HEADER: &str = "token";

/// How long a token is good for when nothing else is said: etcd's `--auth-token-ttl`.
pub const TOKEN_TTL: Duration = Duration::from_secs(300);

/// The one user the store accepts, for one run. Its `Debug` hides the password.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub user: String,
    pub password: String,
    /// The run the store serves: its tokens are good on no other run's store.
    pub run: String,
    /// How long a token is good for after `Authenticate` handed it out.
    pub token_ttl: Duration,
}

impl Credentials {
    /// `user` and `password` for `run`, with tokens good for [`TOKEN_TTL`].
    pub fn new(user: String, password: String, run: String) -> Self {
        Self {
            user,
            password,
            run,
            token_ttl: TOKEN_TTL,
        }
    }
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("user", &self.user)
            .field("password", &"***")
            .field("run", &self.run)
            .field("token_ttl", &self.token_ttl)
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
    tokens: hmac::Key,
    token_ttl: Duration,
    random: SystemRandom,
}

/// Milliseconds since the Unix epoch on this host's clock. Tokens outlive the host
/// agent's restart in place, so they are dated by the clock that also outlives it. Not
/// seconds: a token of a one-second TTL issued late in a second expired at the next one,
/// a few milliseconds later (a fresh token refused on a busy machine).
fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A token's TTL in the units of [`unix_now`].
fn ttl_ms(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX)
}

/// What a token's tag signs: its nonce and when it expires.
fn signed(nonce: &[u8], expires: u64) -> Vec<u8> {
    let mut m = nonce.to_vec();
    m.extend_from_slice(&expires.to_be_bytes());
    m
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
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
                let mut seed = b"fsdp-store token\0".to_vec();
                seed.extend_from_slice(&sha256(c.run.as_bytes()));
                seed.extend_from_slice(&sha256(c.user.as_bytes()));
                seed.extend_from_slice(&sha256(c.password.as_bytes()));
                Arc::new(Secret {
                    user: sha256(c.user.as_bytes()),
                    password: sha256(c.password.as_bytes()),
                    tokens: hmac::Key::new(hmac::HMAC_SHA256, &sha256(&seed)),
                    // At least a second: a token must outlive the call that fetched it.
                    token_ttl: c.token_ttl.max(Duration::from_secs(1)),
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
        self.authenticate_at(user, password, unix_now())
    }

    fn authenticate_at(&self, user: &str, password: &str, now: u64) -> Result<String, Status> {
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
        let mut nonce = [0u8; 32];
        s.random
            .fill(&mut nonce)
            .map_err(|_| Status::internal("etcdserver: no randomness for a token"))?;
        let expires = now.saturating_add(ttl_ms(s.token_ttl));
        let tag = hmac::sign(&s.tokens, &signed(&nonce, expires));
        Ok(format!("{}.{expires}.{}", hex(&nonce), hex(tag.as_ref())))
    }

    /// Whether `token` is one this store's secret signed and has not expired by `now`.
    fn valid(s: &Secret, token: &[u8], now: u64) -> bool {
        let Some((nonce, expires, tag)) = std::str::from_utf8(token).ok().and_then(|t| {
            let mut parts = t.splitn(3, '.');
            let nonce = unhex(parts.next()?)?;
            let expires: u64 = parts.next()?.parse().ok()?;
            Some((nonce, expires, unhex(parts.next()?)?))
        }) else {
            return false;
        };
        // The tag first: an expiry nobody signed says nothing. Then the time, both ways:
        // a clock set back must not stretch a token past the TTL it was given.
        hmac::verify(&s.tokens, &signed(&nonce, expires), &tag).is_ok()
            && now < expires
            && expires <= now.saturating_add(ttl_ms(s.token_ttl))
    }

    /// Whether `req` may proceed: always on an open store, else only with a token this store's secret signed.
    pub fn check<T>(&self, req: &Request<T>) -> Result<(), Status> {
        self.check_at(req, unix_now())
    }

    fn check_at<T>(&self, req: &Request<T>, now: u64) -> Result<(), Status> {
        let Some(s) = &self.secret else {
            return Ok(());
        };
        let Some(token) = req.metadata().get(TOKEN_HEADER) else {
            return Err(Status::invalid_argument("etcdserver: user name is empty"));
        };
        if Self::valid(s, token.as_bytes(), now) {
            if let Some(mark) = req.extensions().get::<ConnectionMark>() {
                mark.set();
            }
            Ok(())
        } else {
            Err(Status::unauthenticated("etcdserver: invalid auth token"))
        }
    }

    /// [`Gate::check`], or a connection that authenticated before: for the calls
    /// etcd-client sends without a token (`LeaseRevoke`).
    pub fn admit<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let marked = req
            .extensions()
            .get::<ConnectionMark>()
            .is_some_and(ConnectionMark::is_set);
        if marked { Ok(()) } else { self.check(req) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn credentials(run: &str, password: &str) -> Credentials {
        Credentials::new("fsdp".into(), password.into(), run.into())
    }

    fn gate() -> Gate {
        Gate::new(Some(&credentials("job", "s3cret")))
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
    fn a_token_is_only_good_with_the_secret_that_signed_it() {
        let g = gate();
        let t = g.authenticate("fsdp", "s3cret").unwrap();
        // The host restarted in place: the same secret still knows the token.
        assert!(gate().check(&with_token(Some(&t))).is_ok());
        let other = Gate::new(Some(&credentials("job", "other")));
        assert!(other.check(&with_token(Some(&t))).is_err());
        let mut forged = t.clone();
        forged.replace_range(0..2, if t.starts_with("00") { "01" } else { "00" });
        assert!(g.check(&with_token(Some(&forged))).is_err());
        assert!(g.check(&with_token(Some("zz.zz"))).is_err());
        assert!(g.check(&with_token(Some("zz.1.zz"))).is_err());
    }

    #[test]
    fn a_token_is_good_only_on_a_store_of_its_run() {
        let t = gate().authenticate("fsdp", "s3cret").unwrap();
        let other_run = Gate::new(Some(&credentials("another-job", "s3cret")));
        assert!(other_run.check(&with_token(Some(&t))).is_err());
    }

    #[test]
    fn a_token_expires_after_its_ttl_and_its_expiry_cannot_be_moved() {
        let g = gate();
        let t = g.authenticate_at("fsdp", "s3cret", 1_000_000).unwrap();
        let at = |now| g.check_at(&with_token(Some(&t)), now);
        assert!(at(1_000_000).is_ok() && at(1_299_999).is_ok());
        let e = at(1_300_000).unwrap_err();
        assert_eq!(
            (e.code(), e.message()),
            (
                tonic::Code::Unauthenticated,
                "etcdserver: invalid auth token"
            ),
            "an expired token is refused as etcd refuses one"
        );
        // A clock set far back does not make the token good for longer than its TTL.
        assert!(at(900_000).is_err());
        // Nor does writing a later expiry into it.
        let (nonce, rest) = t.split_once('.').unwrap();
        let (_, tag) = rest.split_once('.').unwrap();
        let moved = format!("{nonce}.99999999999.{tag}");
        assert!(g.check_at(&with_token(Some(&moved)), 1_100_000).is_err());
    }

    #[test]
    fn a_ttl_under_a_second_is_a_second() {
        let mut c = credentials("job", "s3cret");
        c.token_ttl = Duration::ZERO;
        let g = Gate::new(Some(&c));
        let t = g.authenticate_at("fsdp", "s3cret", 50_000).unwrap();
        assert!(g.check_at(&with_token(Some(&t)), 50_999).is_ok());
        assert!(g.check_at(&with_token(Some(&t)), 51_000).is_err());
    }

    /// A token issued late in a second lives its whole TTL (dated in seconds, a
    /// one-second token issued at x.99 s was refused at x+1 s: `store_security` in the
    /// loaded suite).
    #[test]
    fn a_token_issued_late_in_a_second_lives_its_whole_ttl() {
        let mut c = credentials("job", "s3cret");
        c.token_ttl = Duration::from_secs(1);
        let g = Gate::new(Some(&c));
        let t = g.authenticate_at("fsdp", "s3cret", 7_000_990).unwrap();
        assert!(g.check_at(&with_token(Some(&t)), 7_001_500).is_ok());
        assert!(g.check_at(&with_token(Some(&t)), 7_001_990).is_err());
    }
}
