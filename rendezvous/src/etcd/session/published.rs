//! The view as the session publishes it: read freely (it derefs to [`View`]), changed only
//! through [`Published::edit`], so that every change is one the agent loop hears of.

use std::ops::Deref;
use std::time::{Duration, Instant};

use crate::etcd::view::View;
use crate::fence::in_doubt;

#[derive(Debug, Default)]
pub(super) struct Published {
    view: View,
    /// Changed since the agent loop last looked.
    changed: bool,
    /// Only the lease clock moved since, and later, from a moment not in doubt: nobody
    /// needs waking for it.
    lease_moved: bool,
}

impl Deref for Published {
    type Target = View;

    fn deref(&self) -> &View {
        &self.view
    }
}

impl Published {
    pub(super) fn new(view: View) -> Self {
        Self {
            view,
            changed: true,
            lease_moved: false,
        }
    }

    /// The view, to change: the change will be published.
    pub(super) fn edit(&mut self) -> &mut View {
        self.changed = true;
        &mut self.view
    }

    /// The lease is safe until `safe_until` at `now`. Later than before, from a moment the
    /// fence (with `margin`) did not doubt, it is handed on without waking anyone
    /// ([`Published::lease_moved`]); from a moment in doubt, it is a change: a round
    /// sealed while the lease was in doubt waits for exactly this word, and without a
    /// wake it waited for the next unrelated change (up to the 30 s waiting line).
    /// Earlier, it is a change like any other: a wait timed by the old moment would fence
    /// late.
    pub(super) fn lease_safe_until(
        &mut self,
        safe_until: Option<Instant>,
        now: Instant,
        margin: Duration,
    ) {
        let old = self.view.lease_safe_until;
        if old == safe_until {
            return;
        }
        self.view.lease_safe_until = safe_until;
        let later = matches!((old, safe_until), (Some(o), Some(n)) if n > o);
        if later && !in_doubt(now, old, margin) {
            self.lease_moved = true;
        } else {
            self.changed = true;
        }
    }

    /// The view, when it changed since the last call.
    pub(super) fn take_changed(&mut self) -> Option<&View> {
        self.lease_moved &= !self.changed;
        std::mem::take(&mut self.changed).then_some(&self.view)
    }

    /// When nothing but the lease clock moved since the last look, and moved later.
    pub(super) fn take_lease_moved(&mut self) -> Option<Option<Instant>> {
        std::mem::take(&mut self.lease_moved).then_some(self.view.lease_safe_until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A renewal answered in time moves the clock without waking the agent loop; one that
    /// comes while the clock was within the fence margin wakes it (a round waits on it).
    #[test]
    fn a_later_clock_wakes_the_loop_only_when_the_old_moment_was_in_doubt() {
        let t0 = Instant::now();
        let margin = Duration::from_secs(1);
        let view = View {
            lease_safe_until: Some(t0 + Duration::from_secs(4)),
            ..View::default()
        };
        let mut p = Published::new(view);
        assert!(p.take_changed().is_some());
        p.lease_safe_until(Some(t0 + Duration::from_secs(5)), t0, margin);
        assert!(p.take_changed().is_none());
        assert!(p.take_lease_moved().is_some());
        // Three and a half seconds on, the clock is half a second from its end.
        let late = t0 + Duration::from_millis(4_500);
        p.lease_safe_until(Some(late + Duration::from_secs(5)), late, margin);
        assert!(
            p.take_changed().is_some(),
            "a word a round waits for wakes the loop"
        );
        assert!(p.take_lease_moved().is_none());
        // Earlier: always a change.
        p.lease_safe_until(Some(late + Duration::from_secs(2)), late, margin);
        assert!(p.take_changed().is_some());
    }
}
