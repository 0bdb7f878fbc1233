//! Hosts in network namespaces for partition tests: a bridge on this machine and, per host,
//! a namespace joined to it by a veth pair. Cutting a host takes its link down, so its
//! packets go nowhere (connections time out, nothing is refused), as when a node's network
//! fails; healing brings the link back.
//!
//! Names and the subnet (`10.A.B.0/24`) come from the test process id, so tests running
//! in parallel never share them; everything is deleted on drop.

use std::process::Command;

/// A bridge and the namespaces joined to it.
pub struct Net {
    tag: u32,
    bridge: String,
    /// `10.A.B`, the first three octets of the subnet.
    subnet: String,
    hosts: Vec<String>,
}

/// One host: its namespace, its address and the host-side end of its link.
#[derive(Debug, Clone)]
pub struct Host {
    pub ns: String,
    pub addr: String,
    link: String,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("ip (iproute2) must be available");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Net {
    /// A new bridge with this machine's address `10.A.B.1` on it.
    pub fn new() -> Self {
        let tag = std::process::id();
        let subnet = format!("10.{}.{}", 100 + (tag >> 8) % 150, tag & 255);
        let bridge = format!("fsb{tag}");
        ip(&["link", "add", &bridge, "type", "bridge"]);
        let net = Self {
            tag,
            bridge,
            subnet,
            hosts: Vec::new(),
        };
        ip(&[
            "addr",
            "add",
            &format!("{}/24", net.gateway()),
            "dev",
            &net.bridge,
        ]);
        ip(&["link", "set", &net.bridge, "up"]);
        net
    }

    /// This machine's address on the bridge (where etcd listens for the hosts).
    pub fn gateway(&self) -> String {
        format!("{}.1", self.subnet)
    }

    /// Adds host `i` (`10.A.B.(10+i)`), its interface `eth0` inside its namespace.
    pub fn host(&mut self, i: u8) -> Host {
        let ns = format!("fsn{}h{i}", self.tag);
        let link = format!("fsv{}h{i}", self.tag);
        let addr = format!("{}.{}", self.subnet, 10 + u32::from(i));
        ip(&["netns", "add", &ns]);
        self.hosts.push(ns.clone());
        ip(&[
            "link", "add", &link, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]);
        ip(&["link", "set", &link, "master", &self.bridge]);
        ip(&["link", "set", &link, "up"]);
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", &ns, "ip"];
            all.extend_from_slice(args);
            ip(&all);
        };
        inside(&["addr", "add", &format!("{addr}/24"), "dev", "eth0"]);
        inside(&["link", "set", "eth0", "up"]);
        inside(&["link", "set", "lo", "up"]);
        Host { ns, addr, link }
    }

    /// Cuts `host` off: its link goes down.
    pub fn cut(&self, host: &Host) {
        ip(&["link", "set", &host.link, "down"]);
    }

    /// Brings `host`'s link back.
    pub fn heal(&self, host: &Host) {
        ip(&["link", "set", &host.link, "up"]);
    }
}

impl Default for Net {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Deleting a namespace deletes its veth pair.
        for ns in &self.hosts {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge])
            .status();
    }
}
