//! Picking a free port to publish as `MASTER_PORT`.

use std::net::{TcpListener, ToSocketAddrs};

use crate::RendezvousError;

/// Asks the kernel for a free port on `addr` and releases it at once.
///
/// Worker rank 0 binds the port later, when it starts the c10d store. Another process could
/// take it in between; the window is a few milliseconds and the same one torchrun leaves
/// when its agent does not host the store itself. A fresh port every round (rather than a
/// fixed 29500) keeps a restarted group clear of a previous store still in `TIME_WAIT`.
pub fn free_port(addr: &str) -> Result<u16, RendezvousError> {
    let fail = |source| RendezvousError::NoFreePort {
        addr: addr.to_owned(),
        source,
    };
    let bind_to = (addr, 0)
        .to_socket_addrs()
        .map_err(fail)?
        .next()
        .ok_or_else(|| fail(std::io::Error::other("address resolved to nothing")))?;
    let listener = TcpListener::bind(bind_to).map_err(fail)?;
    Ok(listener.local_addr().map_err(fail)?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_port_is_bindable_and_nonzero() {
        let port = free_port("127.0.0.1").expect("a free port");
        assert_ne!(port, 0);
        TcpListener::bind(("127.0.0.1", port)).expect("the port is free again");
    }

    #[test]
    fn unresolvable_address_is_an_error_naming_it() {
        let err = free_port("no-such-host.invalid").unwrap_err();
        assert!(err.to_string().contains("no-such-host.invalid"), "{err}");
    }
}
