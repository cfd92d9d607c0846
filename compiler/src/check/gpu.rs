//! The GPU catalogue (`gpu = h100_80gb`) and the default links of a cluster.
//!
//! Memory is what one process can hold: nvidia-smi's MiB total less what the driver reserves
//! (its `memory.reserved`), which is cuMemGetInfo's total. The prediction E0701 judges against
//! it is nvidia-smi's `memory.used` (docs/memory.md), which cannot pass it. Measured on an H100
//! 80GB HBM3 (driver 580.159.04): total 81,559 MiB, reserved 480, cuMemGetInfo's total 81,079,
//! and a process that allocated until cuMemAlloc failed held 81,077 MiB. The other GPUs are
//! not measured yet and keep nvidia-smi's total, which overstates what a process can hold by
//! their driver's reservation (the H100's is 0.6%). Peak FLOP/s are the vendors' dense (no
//! sparsity) numbers (FP8: none on GPUs without FP8 tensor cores); bandwidths are bytes/s. Link
//! bandwidths are per GPU and per direction: NVLink 4 on H100/H200 is 900 GB/s bidirectional =
//! 450 GB/s each way; one 400 Gb/s InfiniBand NIC per GPU is 50 GB/s each way.

use crate::spec::{Gpu, Link};

const MIB: u64 = 1 << 20;

/// The names `gpu = …` accepts (besides `custom { … }`).
pub const NAMES: [&str; 6] = [
    "h100_80gb",
    "h100_94gb",
    "h200",
    "a100_80gb",
    "a100_40gb",
    "cpu",
];

pub fn lookup(name: &str) -> Option<Gpu> {
    let (memory_mib, peak, fp32, hbm, fp8) = match name {
        // nvidia-smi: 81,559 MiB total, 480 reserved by the driver.
        "h100_80gb" => (81_079, 989e12, 67e12, 3.35e12, Some(1979e12)),
        "h100_94gb" => (95_830, 835e12, 60e12, 3.9e12, Some(1671e12)),
        "h200" => (143_771, 989e12, 67e12, 4.8e12, Some(1979e12)),
        "a100_80gb" => (81_920, 312e12, 19.5e12, 2.039e12, None),
        "a100_40gb" => (40_960, 312e12, 19.5e12, 1.555e12, None),
        // A laptop/CI CPU core set running the reference backend in f32; it emulates FP8
        // GEMMs exactly, at no speed-up.
        "cpu" => (16_384, 100e9, 100e9, 20e9, Some(100e9)),
        _ => return None,
    };
    Some(Gpu {
        name: name.to_string(),
        memory_bytes: memory_mib * MIB,
        peak_flops: peak,
        peak_flops_fp32: fp32,
        peak_flops_fp8: fp8,
        memory_bandwidth: hbm,
    })
}

/// The link between GPUs of one node when the spec names none.
pub fn default_intra(gpu: &str) -> Link {
    match gpu {
        "cpu" => link("shm", 10e9, 1e-6),
        n if n.starts_with("a100") => link("nvlink", 300e9, 2e-6),
        _ => link("nvlink", 450e9, 2e-6),
    }
}

/// The link between nodes when the spec names none.
pub fn default_inter(gpu: &str) -> Link {
    match gpu {
        "cpu" => link("ethernet", 1.25e9, 20e-6),
        n if n.starts_with("a100") => link("infiniband", 25e9, 5e-6),
        _ => link("infiniband", 50e9, 5e-6),
    }
}

/// Known link kinds with their latency (seconds), used when a spec gives only a bandwidth.
pub fn link_latency(kind: &str) -> Option<f64> {
    match kind {
        "nvlink" => Some(2e-6),
        "pcie" => Some(3e-6),
        "infiniband" | "roce" => Some(5e-6),
        "ethernet" => Some(20e-6),
        "shm" => Some(1e-6),
        _ => None,
    }
}

pub fn link(kind: &str, bandwidth: f64, latency: f64) -> Link {
    Link {
        kind: kind.to_string(),
        bandwidth,
        latency,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The catalogue's H100s and H200 run the Hopper kernels; the A100s and the CPU do not; a
    /// custom GPU counts as one where it has FP8 tensor cores.
    #[test]
    fn hopper_is_the_catalogue_h100s_and_h200_and_custom_gpus_with_fp8() {
        let hopper = |name: &str| lookup(name).map(|g| g.hopper());
        for name in ["h100_80gb", "h100_94gb", "h200"] {
            assert_eq!(hopper(name), Some(true), "{name}");
        }
        for name in ["a100_80gb", "a100_40gb", "cpu"] {
            assert_eq!(hopper(name), Some(false), "{name}");
        }
        let Some(mut custom) = lookup("h100_80gb") else {
            panic!("h100_80gb is in the catalogue");
        };
        custom.name = "custom".into();
        assert!(custom.hopper());
        custom.peak_flops_fp8 = None;
        assert!(!custom.hopper());
    }
}
