//! The view as the session publishes it: read freely (it derefs to [`View`]), changed only
//! through [`Published::edit`], so that every change is one the agent loop hears of.

use std::ops::Deref;
use std::time::Instant;

use crate::etcd::view::View;

#[derive(Debug, Default)]
pub(super) struct Published {
    view: View,
    /// Changed since the agent loop last looked.
    changed: bool,
    /// Only the lease clock moved since, and later: nobody needs waking for it.
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

    /// The lease is safe until `safe_until` now. Later than before, it is handed on
    /// without waking anyone ([`Published::lease_moved`]); earlier, it is a change like
    /// any other: a wait timed by the old moment would fence late.
    pub(super) fn lease_safe_until(&mut self, safe_until: Option<Instant>) {
        let old = self.view.lease_safe_until;
        if old == safe_until {
            return;
        }
        self.view.lease_safe_until = safe_until;
        if matches!((old, safe_until), (Some(o), Some(n)) if n > o) {
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
