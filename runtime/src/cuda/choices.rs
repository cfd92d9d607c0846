//! The CUDA backend's choices that change a run's rounding, as a checkpoint shard carries them
//! (`Backend::choices`, `Backend::adopt_choices`): for each GEMM plan timed on its first run,
//! the cuBLASLt algorithm that won (`gemm::Blas`) and whether parc's own Hopper kernel beat it
//! (`gemm_ws`). Two runs that time the same GEMM can pick different algorithms (the times are
//! close; the products differ by rounding), so a resumed run that timed again would not
//! continue its original run bit for bit; taking the original's choices does.
//!
//! A cuBLASLt algorithm is an opaque 64-byte value NVIDIA documents as serializable for reuse
//! with the same cuBLASLt version; choices are taken only on the device model and cuBLASLt
//! version they were made on (else the run times its own and says so). Plans are keyed by
//! their description as this build prints it (`PlanKey`'s `Debug`): a build that describes a
//! plan otherwise finds no saved choice for it and times it.
use crate::error::{Result, RuntimeError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The loaded cuBLASLt's version (`cublasLtGetVersion`).
pub(super) fn cublaslt_version() -> u64 {
    // SAFETY: a query without arguments of the library the backend has loaded.
    unsafe { cudarc::cublaslt::sys::cublasLtGetVersion() as u64 }
}

/// Where the choices were made and what they are.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(super) struct Choices {
    /// The device's name (`cuDeviceGetName`).
    pub device: String,
    /// `cublasLtGetVersion()`.
    pub cublaslt: u64,
    pub gemms: Vec<GemmChoice>,
}

/// `plan`'s entry of `gemms`, made empty where it has none.
fn entry(gemms: &mut BTreeMap<String, GemmChoice>, plan: String) -> &mut GemmChoice {
    gemms.entry(plan.clone()).or_insert(GemmChoice {
        plan,
        algorithm: None,
        parc_kernel: None,
    })
}

/// One GEMM plan's choices.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(super) struct GemmChoice {
    /// The plan (`PlanKey`'s `Debug`).
    pub plan: String,
    /// The cuBLASLt algorithm timed fastest (`cublasLtMatmulAlgo_t::data`), where it was timed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<[u64; 8]>,
    /// Whether parc's kernel runs the plan instead, and its split count, where the two were
    /// measured against each other.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parc_kernel: Option<ParcKernel>,
}

/// parc's Hopper GEMM against cuBLASLt for one plan (`gemm_ws::Chosen`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub(super) struct ParcKernel {
    pub runs: bool,
    pub splits: usize,
}

impl Choices {
    /// Choices from the plans' algorithms and parc-kernel verdicts, each by plan description
    /// (one entry per plan, in the descriptions' order).
    pub fn from_maps(
        device: String,
        cublaslt: u64,
        algorithms: BTreeMap<String, [u64; 8]>,
        kernels: BTreeMap<String, ParcKernel>,
    ) -> Choices {
        let mut gemms: BTreeMap<String, GemmChoice> = BTreeMap::new();
        for (plan, algorithm) in algorithms {
            entry(&mut gemms, plan).algorithm = Some(algorithm);
        }
        for (plan, kernel) in kernels {
            entry(&mut gemms, plan).parc_kernel = Some(kernel);
        }
        Choices {
            device,
            cublaslt,
            gemms: gemms.into_values().collect(),
        }
    }

    /// The inverse of [`Choices::from_maps`]: the algorithms and the parc-kernel verdicts.
    pub fn into_maps(self) -> (BTreeMap<String, [u64; 8]>, BTreeMap<String, ParcKernel>) {
        let mut algorithms = BTreeMap::new();
        let mut kernels = BTreeMap::new();
        for g in self.gemms {
            if let Some(a) = g.algorithm {
                algorithms.insert(g.plan.clone(), a);
            }
            if let Some(k) = g.parc_kernel {
                kernels.insert(g.plan, k);
            }
        }
        (algorithms, kernels)
    }

    /// The text a checkpoint shard carries.
    pub fn to_text(&self) -> Result<String> {
        serde_json::to_string(self)
            .map_err(|e| RuntimeError::Checkpoint(format!("cannot record the GEMM choices: {e}")))
    }

    /// `saved` read back; `Err` names what is wrong with it (the resumed run then times its
    /// own GEMMs).
    pub fn parse(saved: &str) -> Result<Choices> {
        serde_json::from_str(saved)
            .map_err(|e| RuntimeError::Checkpoint(format!("unreadable GEMM choices ({e})")))
    }

    /// Why choices made on `self`'s device and library cannot be taken on `device` with
    /// cuBLASLt `cublaslt`; None where they can.
    pub fn foreign(&self, device: &str, cublaslt: u64) -> Option<String> {
        if self.device != device {
            return Some(format!("made on {}, this is {device}", self.device));
        }
        (self.cublaslt != cublaslt)
            .then(|| format!("made with cuBLASLt {}, this is {cublaslt}", self.cublaslt))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn choices() -> Choices {
        Choices {
            device: "NVIDIA H200".into(),
            cublaslt: 130_100,
            // In the plans' descriptions' order, as `from_maps` gives them.
            gemms: vec![
                GemmChoice {
                    plan: "PlanKey { m: 16 }".into(),
                    algorithm: None,
                    parc_kernel: Some(ParcKernel {
                        runs: true,
                        splits: 4,
                    }),
                },
                GemmChoice {
                    plan: "PlanKey { m: 8 }".into(),
                    algorithm: Some([1, 2, 3, 4, 5, 6, 7, u64::MAX]),
                    parc_kernel: None,
                },
            ],
        }
    }

    #[test]
    fn choices_read_back_as_written_and_only_on_their_device_and_library() {
        let c = choices();
        let back = Choices::parse(&c.to_text().unwrap()).unwrap();
        assert_eq!(back, c);
        let (algorithms, kernels) = back.into_maps();
        assert_eq!((algorithms.len(), kernels.len()), (1, 1));
        let again = Choices::from_maps(c.device.clone(), c.cublaslt, algorithms, kernels);
        assert_eq!(again, c);
        assert_eq!(c.foreign("NVIDIA H200", 130_100), None);
        let other = c.foreign("NVIDIA H100 80GB HBM3", 130_100).unwrap();
        assert!(
            other.contains("NVIDIA H200") && other.contains("H100"),
            "{other}"
        );
        let library = c.foreign("NVIDIA H200", 120_900).unwrap();
        assert!(
            library.contains("130100") && library.contains("120900"),
            "{library}"
        );
    }

    #[test]
    fn unreadable_choices_are_an_error_saying_why() {
        for bad in ["", "{", "{\"device\": 3}", "[]"] {
            let e = Choices::parse(bad).unwrap_err().to_string();
            assert!(e.contains("unreadable GEMM choices ("), "{e}");
        }
    }
}
