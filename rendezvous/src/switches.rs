//! Test-only switches that put back what a fix took away, so that the simulator and the
//! exhaustive search can show they find the bug the fix removed. Per thread, off unless a
//! test or `scripts/sim.sh --switch` turns one on; never set by the agent.

use std::cell::Cell;

thread_local! {
    /// Departures read as before issue 26: any departure of a node breaks a round,
    /// whatever incarnation it names (the frozen agent's loop).
    pub static OLD_DEPARTURES: Cell<bool> = const { Cell::new(false) };
    /// A ring watcher revokes the lease id its round names without checking that it still
    /// holds the dead node's registration (with lease ids reused: a live agent evicted).
    pub static OLD_EVICTIONS: Cell<bool> = const { Cell::new(false) };
    /// Agents never fence themselves: workers run on under a lease etcd may have expired.
    pub static NEVER_FENCE: Cell<bool> = const { Cell::new(false) };
    /// A round broken before it started never hands its charged restart to the loop: a
    /// node that waited for it waits on when the budget is spent.
    pub static NO_CHARGE_IN_BROKEN: Cell<bool> = const { Cell::new(false) };
}
