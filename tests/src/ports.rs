//! Loopback ports for the processes a test starts: handed out once each, and probed.

use std::collections::HashSet;
use std::net::TcpListener;
use std::sync::Mutex;
use std::time::Duration;

/// Ports handed out by this process: never twice, so the simulator's range cannot overlap
/// ports already given to Envoy or the host but not yet bound.
static PORTS: Mutex<Option<(u16, HashSet<u16>)>> = Mutex::new(None);

/// The range ports are taken from: below the kernel's ephemeral range (32768-60999 by
/// default), so outgoing connections (Envoy's, the clients') cannot take them between the
/// moment a port is picked and the moment its server binds it.
const PORT_LOW: u16 = 20_000;
const PORT_HIGH: u16 = 32_000;

fn bindable(p: u16) -> bool {
    TcpListener::bind(("127.0.0.1", p)).is_ok()
}

fn registry() -> std::sync::MutexGuard<'static, Option<(u16, HashSet<u16>)>> {
    let mut guard = PORTS.lock().unwrap_or_else(|p| p.into_inner());
    guard.get_or_insert_with(|| {
        // Start somewhere different in each process, so concurrent runs rarely meet.
        let seed = std::process::id() as u64
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos() as u64)
                .unwrap_or(0);
        (PORT_LOW + (seed % u64::from(PORT_HIGH - PORT_LOW)) as u16, HashSet::new())
    });
    guard
}

/// Never hand out `ports`: they were chosen elsewhere (another process's registry, a flag)
/// and may not be bound yet, so a probe would find them free.
pub fn reserve(ports: &[u16]) {
    if let Some((_, used)) = registry().as_mut() {
        used.extend(ports.iter().copied());
    }
}

/// Pick `n` consecutive free loopback ports (the simulator binds base..base+n); 0 if none.
pub fn free_port_range(n: u16) -> u16 {
    let mut guard = registry();
    let Some((next, used)) = guard.as_mut() else { return 0 };
    for _ in 0..(PORT_HIGH - PORT_LOW) {
        let base = *next;
        *next = if base + n >= PORT_HIGH { PORT_LOW } else { base + n };
        if base + n > PORT_HIGH {
            continue;
        }
        if (0..n).all(|i| !used.contains(&(base + i)) && bindable(base + i)) {
            used.extend((0..n).map(|i| base + i));
            return base;
        }
    }
    0
}

/// Pick a free loopback port.
pub fn free_port() -> u16 {
    free_port_range(1)
}

/// Whether something accepts connections on loopback `port`.
pub fn port_open(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200)).is_ok()
}
