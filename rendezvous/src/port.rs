//! Picking a free port to publish as `MASTER_PORT`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, ToSocketAddrs};

use crate::RendezvousError;

/// A port free on every address of this host, taken and released at once.
///
/// Worker rank 0 binds the port later, when it starts the c10d store, and torch's store
/// binds the wildcard address, not `addr`: a port free on `addr` but taken on another
/// address (127.0.0.1, say) would fail there with EADDRINUSE. So the port is taken on the
/// wildcard address of `addr`'s family, which the kernel grants only if no address has it.
///
/// And it is taken below the kernel's ephemeral range, at random, where only a process
/// that asks for a port by number can take it. A port the kernel hands out (bind to port
/// 0, as torchrun's agent does) comes from the range every outgoing connection on the host
/// also takes its local port from: in the few hundred milliseconds before the store bound
/// it, a connection took it on a busy host and the store failed with EADDRINUSE (seen in
/// this repository's test suite). Where the range starts too low to leave room below it,
/// the kernel picks. A fresh port every round (rather than a fixed 29500) keeps a
/// restarted group clear of a previous store still in `TIME_WAIT`.
pub fn free_port(addr: &str) -> Result<u16, RendezvousError> {
    let fail = |source| RendezvousError::NoFreePort {
        addr: addr.to_owned(),
        source,
    };
    let resolved = (addr, 0)
        .to_socket_addrs()
        .map_err(fail)?
        .next()
        .ok_or_else(|| fail(std::io::Error::other("address resolved to nothing")))?;
    let wildcard = match resolved.ip() {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    if let Some(below) = below_ephemeral(&ephemeral_range()) {
        for _ in 0..64 {
            let span = u128::from(below.end - below.start);
            let port = below.start + (uuid::Uuid::new_v4().as_u128() % span) as u16;
            if TcpListener::bind(SocketAddr::new(wildcard, port)).is_ok() {
                return Ok(port);
            }
        }
    }
    let listener = TcpListener::bind(SocketAddr::new(wildcard, 0)).map_err(fail)?;
    Ok(listener.local_addr().map_err(fail)?.port())
}

/// The kernel's ephemeral port range as `/proc` says it (`low high`), if it can be read.
fn ephemeral_range() -> String {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default()
}

/// The ports a master port is picked from: from 10,000 (clear of the well-known and
/// registered services most hosts run) up to the start of the ephemeral range, if that
/// leaves at least 1,000 (Linux's default range starts at 32768).
fn below_ephemeral(range: &str) -> Option<std::ops::Range<u16>> {
    let low: u16 = range.split_whitespace().next()?.parse().ok()?;
    (low >= 11_000).then_some(10_000..low)
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

    /// Outside the range outgoing connections take their local ports from: a busy host's
    /// connection took the picked port before the store bound it (EADDRINUSE).
    #[test]
    fn the_port_is_picked_below_the_ephemeral_range_when_there_is_room() {
        assert_eq!(below_ephemeral("32768\t60999\n"), Some(10_000..32_768));
        assert_eq!(
            below_ephemeral("10500 60999"),
            None,
            "too little room below"
        );
        assert_eq!(below_ephemeral(""), None);
        if below_ephemeral(&ephemeral_range()).is_some() {
            let low: u16 = ephemeral_range()
                .split_whitespace()
                .next()
                .unwrap()
                .parse()
                .unwrap();
            for _ in 0..20 {
                let port = free_port("127.0.0.1").unwrap();
                assert!((10_000..low).contains(&port), "{port}");
            }
        }
    }

    /// The suite's race, on demand: in a network namespace of its own whose ephemeral range
    /// is ten ports, the port is picked, then ten outgoing connections take every port of
    /// that range, as a busy host's connections do in the window before the store binds.
    /// A port the kernel handed out (bind to port 0) is one of them, and the store's bind
    /// fails with EADDRINUSE; a port picked below the range still binds.
    #[test]
    fn outgoing_connections_cannot_take_the_picked_port_before_the_store_binds_it() {
        std::thread::spawn(move || {
            if nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).is_err() {
                eprintln!("skipped: creating a network namespace needs root");
                return;
            }
            let sh = |cmd: &str| {
                let ok = std::process::Command::new("sh").args(["-c", cmd]).status();
                assert!(ok.is_ok_and(|s| s.success()), "{cmd}");
            };
            sh("ip link set lo up");
            sh("echo '40000 40009' > /proc/sys/net/ipv4/ip_local_port_range");
            // Two servers: the first ten connections leave their ports in TIME_WAIT
            // towards the first, and only another destination can reuse them at once.
            let servers = [20_000, 20_001].map(|p| TcpListener::bind(("127.0.0.1", p)).unwrap());
            let take_the_range = |to: u16| -> Vec<std::net::TcpStream> {
                (0..10)
                    .map(|_| std::net::TcpStream::connect(("127.0.0.1", to)).unwrap())
                    .collect()
            };
            // What the kernel hands out is what the connections take.
            let handed_out = TcpListener::bind(("0.0.0.0", 0)).unwrap();
            let port = handed_out.local_addr().unwrap().port();
            drop(handed_out);
            let conns = take_the_range(20_000);
            assert!(
                TcpListener::bind(("0.0.0.0", port)).is_err(),
                "port {port} from the kernel survived ten connections"
            );
            drop(conns);
            // The pick is below the range: the same connections leave it alone.
            let port = free_port("127.0.0.1").unwrap();
            let conns = take_the_range(20_001);
            TcpListener::bind(("0.0.0.0", port)).expect("the store binds the picked port");
            drop((conns, servers));
        })
        .join()
        .unwrap();
    }

    #[test]
    fn unresolvable_address_is_an_error_naming_it() {
        let err = free_port("no-such-host.invalid").unwrap_err();
        assert!(err.to_string().contains("no-such-host.invalid"), "{err}");
    }

    /// Outside testing: the port was picked on `--local-addr` (free there) while another
    /// address had it, and torch's store, which binds the wildcard address, failed with
    /// EADDRINUSE. In a network namespace of its own (this thread only) with two ephemeral
    /// ports, one of them taken on 127.0.0.1, the pick for 127.0.1.10 must be the other.
    #[test]
    fn the_port_is_free_on_the_wildcard_address_where_the_store_binds() {
        let in_ns = |cmd: &str| {
            // A child forked from this thread lives in its network namespace.
            let ok = std::process::Command::new("sh")
                .args(["-c", cmd])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "{cmd}");
        };
        std::thread::spawn(move || {
            if nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).is_err() {
                eprintln!("skipped: creating a network namespace needs root");
                return;
            }
            in_ns("ip link set lo up");
            // Too low a range to pick below it: the kernel picks, from these two.
            in_ns("echo '10000 10001' > /proc/sys/net/ipv4/ip_local_port_range");
            let taken = TcpListener::bind(("127.0.0.1", 10001)).unwrap();
            for _ in 0..20 {
                let port = free_port("127.0.1.10").unwrap();
                assert_eq!(port, 10000, "a port taken on 127.0.0.1");
                TcpListener::bind(("0.0.0.0", port)).expect("the store can bind it");
            }
            drop(taken);
            // Below the range: only 10000 and 10001 left, one taken on 127.0.0.1.
            in_ns("echo '11002 60999' > /proc/sys/net/ipv4/ip_local_port_range");
            let fill: Vec<TcpListener> = (10_002..11_002)
                .filter_map(|p| TcpListener::bind(("0.0.0.0", p)).ok())
                .collect();
            let taken = TcpListener::bind(("127.0.0.1", 10001)).unwrap();
            for _ in 0..5 {
                let port = free_port("127.0.1.10").unwrap();
                assert_ne!(port, 10001, "a port taken on 127.0.0.1");
                TcpListener::bind(("0.0.0.0", port)).expect("the store can bind it");
            }
            drop((taken, fill));
        })
        .join()
        .unwrap();
    }
}
