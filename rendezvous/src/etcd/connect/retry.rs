//! Asking etcd again: the backoff of what an agent asks at start, the requests sent again
//! while etcd says it is overloaded ([`while_overloaded`]), and the log lines of a
//! connection being retried ([`Repeats`]).

use std::time::Duration;

use backon::Retryable;

use super::options::EtcdOptions;
use crate::etcd::errors::{overloaded, short_cause};

/// The retries of what an agent asks at start: from 100 ms with jitter, doubling up to
/// 2 s, for at most `window`.
pub(super) fn join_backoff(window: Duration) -> backon::ExponentialBuilder {
    crate::backoff::exponential(Duration::from_millis(100), Duration::from_secs(2))
        .with_jitter()
        .with_max_times(10_000)
        .with_total_delay(Some(window))
}

/// Runs `op` again while etcd answers that it is overloaded ([`overloaded`]), backing off
/// with jitter, for at most `window`. What an agent asks once at join (the nesting check,
/// its lease) must not end it because thousands of others joined in the same second:
/// `rdzv-bench --nodes 10000` lost nodes to one "request timed out" at their lease grant.
/// Both are safe to send twice (reads, and a grant that only leaves a lease to expire).
pub(crate) async fn while_overloaded<T, F, Fut>(
    window: Duration,
    op: F,
) -> Result<T, etcd_client::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
{
    op.retry(join_backoff(window))
        .when(overloaded)
        .notify(|e, wait| tracing::debug!(error = %e, ?wait, "etcd is overloaded; asking again"))
        .await
}

/// How often a store that stays unreachable is said to be, after the first time.
const SAY_AGAIN: Duration = Duration::from_secs(10);

/// The log lines of a connection being retried: the first failure, then one line every
/// [`SAY_AGAIN`] with the tries so far, each with its cause in a few words.
pub(super) struct Repeats<'a> {
    opts: &'a EtcdOptions,
    began: std::time::Instant,
    tries: u32,
    said_at: Option<std::time::Instant>,
}

impl<'a> Repeats<'a> {
    pub(super) fn new(opts: &'a EtcdOptions, began: std::time::Instant) -> Self {
        Self {
            opts,
            began,
            tries: 0,
            said_at: None,
        }
    }

    pub(super) fn failed(&mut self, e: &etcd_client::Error) {
        self.tries += 1;
        let now = std::time::Instant::now();
        let (store, at) = (self.opts.store_name(), self.opts.endpoints.join(","));
        match self.said_at {
            None => tracing::warn!(
                "{store} at {at} is not reachable ({}); retrying for up to {:?}",
                short_cause(e),
                self.opts.retry_window
            ),
            Some(last) if now - last >= SAY_AGAIN => tracing::warn!(
                "{store} at {at} still unreachable after {}s, {} tries ({})",
                (now - self.began).as_secs(),
                self.tries,
                short_cause(e)
            ),
            Some(_) => return,
        }
        self.said_at = Some(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use etcd_client::Error as E;
    use tonic::Status;

    /// An op that etcd answers "request timed out" `busy` times, then answers; and how
    /// many times it was sent.
    fn answered_after(
        busy: usize,
        other: Option<E>,
    ) -> (
        impl FnMut() -> std::future::Ready<Result<u32, E>>,
        std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ) {
        let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = sent.clone();
        let mut other = other;
        let op = move || {
            let n = counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            std::future::ready(match other.take() {
                Some(e) => Err(e),
                None if n < busy => Err(E::GRpcStatus(Status::unavailable(
                    "etcdserver: request timed out",
                ))),
                None => Ok(7),
            })
        };
        (op, sent)
    }

    #[tokio::test]
    async fn a_join_request_etcd_is_too_busy_for_is_sent_again() {
        let (op, sent) = answered_after(2, None);
        let got = while_overloaded(Duration::from_secs(30), op).await;
        assert_eq!(got.unwrap(), 7);
        assert_eq!(sent.load(std::sync::atomic::Ordering::Relaxed), 3);
    }

    #[tokio::test]
    async fn any_other_failure_is_the_answer_at_once() {
        let (op, sent) = answered_after(0, Some(E::GRpcStatus(Status::permission_denied("no"))));
        assert!(while_overloaded(Duration::from_secs(30), op).await.is_err());
        assert_eq!(sent.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn an_etcd_busy_past_the_window_is_the_answer() {
        let (op, sent) = answered_after(usize::MAX, None);
        let began = std::time::Instant::now();
        let got = while_overloaded(Duration::from_millis(500), op).await;
        assert!(got.as_ref().is_err_and(overloaded), "{got:?}");
        assert!(began.elapsed() < Duration::from_secs(5));
        assert!(sent.load(std::sync::atomic::Ordering::Relaxed) >= 2);
    }
}
