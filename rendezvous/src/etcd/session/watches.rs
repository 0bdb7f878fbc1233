//! What a sync read and the watches it opens: the revision read (the watches start after
//! it), whether the read took the control keys alone, the role and lease the watches are
//! for, and the outage grace within which members of the round may still come back.

use std::time::Instant;

use super::io::Role;

#[derive(Debug)]
pub(super) struct Watches {
    /// The revision of the last ranged read.
    read_rev: i64,
    /// The view was read from the control keys alone (a joining member's first sync):
    /// it holds no registrations, so it cannot seal or judge who vanished until a whole
    /// read (the role change that makes this node coordinator brings one).
    control_only: bool,
    /// This sync must read the whole run even if it is the first.
    whole_read: bool,
    /// The role and lease the watches being opened are for.
    role: Role,
    lease: i64,
    /// Outage grace: members of our round not back by then are gone.
    grace_until: Option<Instant>,
}

impl Default for Watches {
    fn default() -> Self {
        Self {
            read_rev: 0,
            control_only: false,
            whole_read: false,
            role: Role::Member,
            lease: 0,
            grace_until: None,
        }
    }
}

impl Watches {
    /// A sync begins, with this grace for the members of the round.
    pub(super) fn begin(&mut self, grace_until: Option<Instant>) {
        self.whole_read = false;
        self.grace_until = grace_until;
    }

    pub(super) fn grace_until(&self) -> Option<Instant> {
        self.grace_until
    }

    /// Whether the grace ended by `now` (it is over then).
    pub(super) fn grace_over(&mut self, now: Instant) -> bool {
        self.grace_until.take_if(|at| *at <= now).is_some()
    }

    pub(super) fn read_rev(&self) -> i64 {
        self.read_rev
    }

    pub(super) fn control_only(&self) -> bool {
        self.control_only
    }

    pub(super) fn whole_read(&self) -> bool {
        self.whole_read
    }

    /// This sync reads the whole run after all.
    pub(super) fn read_whole(&mut self) {
        self.whole_read = true;
    }

    /// A read at `revision` was installed; `control_only`: of the control keys alone.
    pub(super) fn read(&mut self, revision: i64, control_only: bool) {
        self.read_rev = revision;
        self.control_only = control_only;
    }

    /// The watches are opened for `role`, their keep-alive stream for `lease`.
    pub(super) fn opening(&mut self, role: Role, lease: i64) {
        (self.role, self.lease) = (role, lease);
    }

    pub(super) fn role(&self) -> Role {
        self.role
    }

    pub(super) fn lease(&self) -> i64 {
        self.lease
    }
}
