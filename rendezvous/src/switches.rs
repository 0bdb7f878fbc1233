//! Test-only switches that put back what a fix took away, so that the simulator and the
//! exhaustive search can show they find the bug the fix removed.
//!
//! With the `sim` feature (the test command's) each switch is a per-thread flag, off
//! unless a test or `scripts/sim.sh --switch` turns one on. Without it (the agent's
//! build) each is an `Off`: the same read, `SWITCH.with(Cell::get)`, always `false`, so
//! the compiler drops the old code paths; and no switch can be set.

#[cfg(feature = "sim")]
use std::cell::Cell;

#[cfg(feature = "sim")]
thread_local! {
    /// Departures read without incarnations: any departure of a node breaks a round,
    /// whatever incarnation it names. The departure of a node's old registration (a
    /// frozen agent's expired lease, left behind when it came back with a new one) then
    /// breaks every round sealed with its new one: the frozen agent's loop.
    pub static OLD_DEPARTURES: Cell<bool> = const { Cell::new(false) };
    /// A ring watcher revokes the lease id its round names without checking that it still
    /// holds the dead node's registration (with lease ids reused: a live agent evicted).
    pub static OLD_EVICTIONS: Cell<bool> = const { Cell::new(false) };
    /// Agents never fence themselves: workers run on under a lease etcd may have expired.
    pub static NEVER_FENCE: Cell<bool> = const { Cell::new(false) };
    /// A round broken before it started never hands its charged restart to the loop: a
    /// node that waited for it waits on when the budget is spent.
    pub static NO_CHARGE_IN_BROKEN: Cell<bool> = const { Cell::new(false) };
    /// A joining node adds load as fast as it can: no pacing by etcd's answers, and its
    /// lease kept alive only from its watches on (after its first read).
    pub static NO_ADMISSION: Cell<bool> = const { Cell::new(false) };
}

#[cfg(not(feature = "sim"))]
pub use off::{NEVER_FENCE, NO_ADMISSION, NO_CHARGE_IN_BROKEN, OLD_DEPARTURES, OLD_EVICTIONS, Off};

#[cfg(not(feature = "sim"))]
mod off {
    use std::cell::Cell;

    /// A switch in a build without the simulator: always off.
    ///
    /// It is read as the per-thread flag is, `SWITCH.with(Cell::get)`, so the code that
    /// reads it is the same in both builds; a read is `false` once inlined. It cannot be
    /// set: [`Off::with`] takes only a read (a closure that sets a flag returns `()`, not
    /// `bool`, and does not compile).
    #[derive(Debug, Clone, Copy)]
    pub struct Off;

    impl Off {
        /// Reads the switch: `read` sees a flag that is off.
        #[inline(always)]
        pub fn with(self, read: impl FnOnce(&Cell<bool>) -> bool) -> bool {
            read(&Cell::new(false))
        }
    }

    /// Departures read without incarnations (the simulator's build only).
    pub const OLD_DEPARTURES: Off = Off;
    /// Evictions that do not check the registration the lease holds (the simulator's build
    /// only).
    pub const OLD_EVICTIONS: Off = Off;
    /// Agents that never fence themselves (the simulator's build only).
    pub const NEVER_FENCE: Off = Off;
    /// Broken rounds that drop their charged restart (the simulator's build only).
    pub const NO_CHARGE_IN_BROKEN: Off = Off;
    /// Joins without admission (the simulator's build only).
    pub const NO_ADMISSION: Off = Off;
}
