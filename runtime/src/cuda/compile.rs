//! The CUDA C kernels (`kernels/*.cu`, one NVRTC program) compiled once per process and arch,
//! cached by content hash: in memory for every backend of the process, and on disk as PTX
//! under `$XDG_CACHE_HOME/parc` (or `~/.cache/parc`) so later runs skip NVRTC. A disk cache
//! that cannot be read or written is only skipped; compile errors carry NVRTC's log.
//!
//! A Hopper GPU (compute capability 9.0: H100, H200) gets the program compiled for
//! `compute_90a`, the architecture-specific target whose PTX may use warpgroup MMA (`wgmma`),
//! the tensor memory accelerator and `setmaxnreg`. Kernels that need them are written inside
//! `#ifdef __CUDA_ARCH_FEAT_SM90_ALL` (defined only for that target), so the same sources
//! still compile for every other GPU, where the host never launches them.
use super::device::driver_error;
use super::kernel::{Kernel, SOURCES};
use crate::error::{Result, RuntimeError};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

/// Options that change the generated code: part of the cache key. `--fmad=false` keeps
/// float arithmetic rounded as written, like the CPU reference.
const NVRTC_OPTIONS: [&str; 2] = ["--fmad=false", "--std=c++17"];

/// FNV-1a, 64-bit: a hash that is the same in every build (the disk cache key).
fn fnv1a(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in part.as_bytes().iter().chain(&[0u8]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

fn source() -> String {
    SOURCES.join("\n")
}

fn cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("parc"))
}

/// PTX compiled in this process, by cache key.
fn memory_cache() -> &'static Mutex<HashMap<u64, String>> {
    static CACHE: OnceLock<Mutex<HashMap<u64, String>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// PTX for `arch` (e.g. `compute_90`): from memory, disk, or NVRTC, in that order.
fn ptx_for(arch: &str) -> Result<String> {
    cached_ptx(
        "kernels",
        "parc's CUDA kernels",
        &source(),
        arch,
        &NVRTC_OPTIONS,
    )
}

/// PTX of the CUDA C `src` for `arch` compiled with `options`: from this process's memory, the
/// disk cache (`<stem>-<arch>-<hash>.ptx`), or NVRTC, in that order, keyed by the FNV-1a hash
/// of the source, the arch and the options. `what` names the program in a compile error.
pub(super) fn cached_ptx(
    stem: &str,
    what: &str,
    src: &str,
    arch: &str,
    options: &[&str],
) -> Result<String> {
    let mut key_parts = vec![src, arch];
    key_parts.extend(options);
    let key = fnv1a(&key_parts);
    if let Ok(cache) = memory_cache().lock() {
        if let Some(ptx) = cache.get(&key) {
            return Ok(ptx.clone());
        }
    }
    let file = cache_dir().map(|d| d.join(format!("{stem}-{arch}-{key:016x}.ptx")));
    let cached = file.as_ref().and_then(|f| std::fs::read_to_string(f).ok());
    let ptx = match cached {
        Some(ptx) => ptx,
        None => {
            let mut options: Vec<String> = options.iter().map(|s| s.to_string()).collect();
            options.push(format!("--gpu-architecture={arch}"));
            let opts = CompileOptions {
                options,
                name: Some(format!("{stem}.cu")),
                ..Default::default()
            };
            let ptx = compile_ptx_with_opts(src, opts).map_err(|e| {
                RuntimeError::Unsupported(format!(
                    "NVRTC could not compile {what} for {arch}: {e:?}"
                ))
            })?;
            let text = ptx.to_src();
            if let Some(f) = &file {
                // A cache we cannot write only costs the next run a compile.
                let _ = f.parent().map(std::fs::create_dir_all);
                let tmp = f.with_extension(format!("tmp{}", std::process::id()));
                if std::fs::write(&tmp, &text).is_ok() {
                    let _ = std::fs::rename(&tmp, f);
                }
            }
            text
        }
    };
    if let Ok(mut cache) = memory_cache().lock() {
        cache.insert(key, ptx.clone());
    }
    Ok(ptx)
}

/// The NVRTC target for a GPU of compute capability `major.minor`: its virtual architecture,
/// with Hopper's architecture-specific features for 9.0 (module docs).
fn arch_for(major: i32, minor: i32) -> String {
    if (major, minor) == (9, 0) {
        "compute_90a".to_string()
    } else {
        format!("compute_{major}{minor}")
    }
}

/// The loaded kernel module and the functions looked up so far (indexed by `Kernel`).
pub(crate) struct Kernels {
    module: Arc<CudaModule>,
    functions: Vec<Option<CudaFunction>>,
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Kernels> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| driver_error("reading the compute capability", e))?;
        let arch = arch_for(major, minor);
        let ptx = ptx_for(&arch)?;
        let module = ctx
            .load_module(Ptx::from_src(ptx))
            .map_err(|e| driver_error(&format!("loading the kernel module for {arch}"), e))?;
        Ok(Kernels {
            module,
            functions: vec![None; Kernel::ALL.len()],
        })
    }

    pub fn function(&mut self, kernel: Kernel) -> Result<&CudaFunction> {
        let missing = || RuntimeError::Unsupported(format!("kernel {kernel} is missing"));
        let slot = self
            .functions
            .get_mut(kernel as usize)
            .ok_or_else(missing)?;
        if slot.is_none() {
            let f = self
                .module
                .load_function(kernel.symbol())
                .map_err(|e| driver_error(&format!("finding kernel {kernel}"), e))?;
            *slot = Some(f);
        }
        slot.as_ref().ok_or_else(missing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hopper_gets_its_architecture_specific_target() {
        assert_eq!(arch_for(9, 0), "compute_90a");
        assert_eq!(arch_for(8, 0), "compute_80");
        assert_eq!(arch_for(8, 9), "compute_89");
        assert_eq!(arch_for(10, 0), "compute_100");
    }

    #[test]
    fn cache_key_changes_with_any_part() {
        let base = fnv1a(&["src", "compute_90"]);
        assert_eq!(base, fnv1a(&["src", "compute_90"]));
        assert_ne!(base, fnv1a(&["src", "compute_80"]));
        assert_ne!(base, fnv1a(&["src ", "compute_90"]));
        assert_ne!(fnv1a(&["ab", "c"]), fnv1a(&["a", "bc"]));
    }

    /// Every kernel compiles for Ampere and Hopper, to PTX and through ptxas. Needs only NVRTC, no GPU: CI installs it
    /// (pip `nvidia-cuda-nvrtc`, on `LD_LIBRARY_PATH`); without it the test says so and passes.
    /// The PTX lands in the disk cache, where `bench/kernel_stats.sh` hands it to ptxas.
    #[test]
    fn kernels_compile_with_nvrtc_for_ampere_and_hopper() {
        // SAFETY: only tries to load the library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("skipped: NVRTC not found (put libnvrtc on LD_LIBRARY_PATH)");
            return;
        }
        for arch in ["compute_80", "compute_90", "compute_90a"] {
            let ptx = ptx_for(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
            assert!(
                ptx.contains(".visible .entry"),
                "{arch}: no kernels in the PTX"
            );
        }
        // A real architecture makes NVRTC assemble the PTX too (ptxas), which rejects
        // instructions the GPU lacks that PTX generation lets through (inline asm).
        for arch in ["sm_80", "sm_90", "sm_90a"] {
            ptx_for(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        }
    }
}
