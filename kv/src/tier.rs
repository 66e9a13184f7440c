//! Where a block lives: the engine's memory tiers, and the bit each one has in a tier mask.

/// Tier bits, as the index stores them and the filters read them.
pub const GPU: u8 = 1;
pub const CPU: u8 = 2;
pub const DISK: u8 = 4;
/// A tier the host does not know by name (an engine's or connector's own): indexed, counted,
/// and worth the least of the known tiers' weights.
pub const OTHER: u8 = 8;

/// Where a block lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Medium {
    Gpu,
    Cpu,
    Disk,
    /// A name the host does not know (`"NVME"`, a connector's own).
    Other,
}

impl Medium {
    /// vLLM says "GPU" (or nothing); connectors and SGLang use other names for host memory and
    /// storage tiers. Any other name is [`Medium::Other`], never taken for GPU.
    pub fn parse(s: Option<&str>) -> Self {
        let Some(s) = s.filter(|s| !s.is_empty()) else { return Medium::Gpu };
        let any = |names: &[&str]| names.iter().any(|n| s.eq_ignore_ascii_case(n));
        if any(&["gpu", "cuda", "device", "l1"]) {
            Medium::Gpu
        } else if any(&["cpu", "cpu_tier", "host", "l2", "dram"]) {
            Medium::Cpu
        } else if any(&["disk", "ssd", "storage", "l3", "lmcache"]) {
            Medium::Disk
        } else {
            Medium::Other
        }
    }

    /// This tier's bit in a tier mask.
    pub fn bit(self) -> u8 {
        match self {
            Medium::Gpu => GPU,
            Medium::Cpu => CPU,
            Medium::Disk => DISK,
            Medium::Other => OTHER,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_names_map_to_their_tier_and_unknown_ones_are_other() {
        assert_eq!(Medium::parse(None), Medium::Gpu, "vLLM omits it for GPU");
        assert_eq!(Medium::parse(Some("GPU")), Medium::Gpu);
        assert_eq!(Medium::parse(Some("CPU")), Medium::Cpu);
        assert_eq!(Medium::parse(Some("LMCache")), Medium::Disk);
        assert_eq!(Medium::parse(Some("NVME")), Medium::Other, "never taken for GPU");
        let bits = [Medium::Gpu, Medium::Cpu, Medium::Disk, Medium::Other].map(Medium::bit);
        assert_eq!(bits.iter().fold(0, |a, b| a | b), GPU | CPU | DISK | OTHER, "one bit each");
    }
}
