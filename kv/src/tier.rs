//! Where a block lives: the engine's memory tiers, and the bit each one has in a tier mask.

/// Tier bits, as the index stores them and the filters read them.
pub const GPU: u8 = 1;
pub const CPU: u8 = 2;
pub const DISK: u8 = 4;

/// Where a block lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Medium {
    Gpu,
    Cpu,
    Disk,
}

impl Medium {
    /// vLLM says "GPU" (or nothing); connectors and SGLang use other names for host memory and
    /// storage tiers.
    pub fn parse(s: Option<&str>) -> Self {
        match s.map(str::to_ascii_lowercase).as_deref() {
            Some("cpu") | Some("cpu_tier") | Some("host") | Some("l2") | Some("dram") => Medium::Cpu,
            Some("disk") | Some("ssd") | Some("storage") | Some("l3") | Some("lmcache") => Medium::Disk,
            _ => Medium::Gpu,
        }
    }

    /// This tier's bit in a tier mask.
    pub fn bit(self) -> u8 {
        match self {
            Medium::Gpu => GPU,
            Medium::Cpu => CPU,
            Medium::Disk => DISK,
        }
    }
}
