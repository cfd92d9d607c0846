//! parc's own Hopper GEMM (`kernels/gemm_ws.cu`) beside cuBLASLt: which 16-bit GEMMs it takes,
//! how a column-major [`Gemm`] maps onto its row-major view, how far a weight gradient's long
//! reduction is split, and which of the two runs each GEMM.
//!
//! The choice is measured, per plan (`gemm::PlanKey`): on the first run of a GEMM the kernel
//! takes, cuBLASLt times its candidates and runs as before, then this kernel is timed on the
//! same operands into the same output (CUDA events, best of two after a warm-up), and the
//! faster of the two runs that GEMM from then on. Variant `gemm` (PARC_GEMM_KERNEL): `auto`
//! (that choice, the default on a Hopper), `ws` (parc's kernel wherever it takes the GEMM, for
//! the tests) or `cublaslt` (cuBLASLt only).
//!
//! Row-major view: `C[mr × nr] = P[mr × k] · Q[k × nr]` with `mr = n`, `nr = m` of the
//! column-major GEMM (C row-major with `ldc` is D column-major), `P = op(B)ᵀ` and
//! `Q = op(A)ᵀ`. P is K-major when B is not transposed (a forward's or backward-data's dy, x),
//! MN-major when it is (a backward-weight's dy); Q is K-major when A is transposed (a
//! forward's weight), MN-major otherwise.
use super::choices::ParcKernel;
use super::gemm::{best_of, Epilogue, Gemm, Operands, Output, PlanKey};
use super::kernel::Kernel;
use super::tma::{self, Elem, TmaMap};
use super::variants::GemmKernel;
use super::{Arg, CudaBackend};
use crate::error::{Result, RuntimeError};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::CudaSlice;

/// The kernel's tile of C (rows × columns) and k block (gemm_ws.cu's GW_BM, GW_BN, GW_BK).
const BM: usize = 128;
const BN: usize = 256;
const BK: usize = 64;
/// Dynamic shared memory: gemm_ws.cu's GW_SMEM (alignment, 4 stages of 48 KB, a tile of
/// ones, the pipeline barriers, a flag).
const SMEM: u32 = 1024 + 4 * (BM * BK * 2 + BN * BK * 2) as u32 + 1024 + 16 * 4 + 48;
/// Tiles a split reduction can count arrivals for (the counters' length).
const MAX_SPLIT_TILES: usize = 4096;
/// Ints of the attention backward's work counters after the split counters.
const ATTENTION_WORK_INTS: usize = 2;
/// Most splits of one reduction, and fewest k blocks a split keeps.
const MAX_SPLITS: usize = 16;
const MIN_SPLIT_BLOCKS: usize = 4;

/// Which entry point runs a GEMM: its kernel, and the layout of its operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct EntryPoint {
    kernel: Kernel,
    /// P, Q MN-major (`gemm_ws.cu`'s TA, TB).
    p_mn: bool,
    q_mn: bool,
}

/// What was measured for one GEMM plan, and which runs it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Chosen {
    pub ws: bool,
    pub ws_ms: f32,
    pub lt_ms: Option<f32>,
    pub splits: usize,
}

/// The kernel for `g` in a run of `operands`, where it has one (None: cuBLASLt runs it).
pub(super) fn kernel_for(g: &Gemm, operands: Operands) -> Option<EntryPoint> {
    if operands != Operands::Bf16 {
        return None;
    }
    let aligned = g.lda % 8 == 0
        && g.ldb % 8 == 0
        && g.ldc % 8 == 0
        && g.m.is_multiple_of(8)
        && [g.a, g.b, g.c].iter().all(|p| p % 16 == 0)
        && g.c_in.is_none_or(|p| p % 16 == 0)
        && g.m <= i32::MAX as u64
        && g.n <= i32::MAX as u64
        && g.k <= i32::MAX as u64
        && g.k > 0
        // The kernel counts work items (tiles × splits) in 32-bit integers.
        && g.n.div_ceil(BM as u64) * g.m.div_ceil(BN as u64) * MAX_SPLITS as u64 <= i32::MAX as u64;
    if !aligned {
        return None;
    }
    let bias_ok = |ptr: CUdeviceptr, bf16: bool| ptr.is_multiple_of(if bf16 { 4 } else { 8 });
    let kernel = match (g.trans_a, g.trans_b, g.out, g.epilogue) {
        (true, false, Output::Bf16, Epilogue::None) => Kernel::GemmWsKkBf16,
        (true, false, Output::Bf16, Epilogue::Bias { ptr, bf16 }) if bias_ok(ptr, bf16) => {
            Kernel::GemmWsKkBf16
        }
        (true, false, Output::Bf16, Epilogue::GeluAux { bias, aux })
            if aux % 16 == 0 && bias.is_none_or(|(p, b)| bias_ok(p, b)) =>
        {
            Kernel::GemmWsKkGelu
        }
        (false, false, Output::Bf16, Epilogue::None) => Kernel::GemmWsKmBf16,
        (false, false, Output::Bf16, Epilogue::Bias { ptr, bf16 }) if bias_ok(ptr, bf16) => {
            Kernel::GemmWsKmBf16
        }
        (false, false, Output::Bf16, Epilogue::DGelu { aux }) if aux % 16 == 0 => {
            Kernel::GemmWsKmDgelu
        }
        (false, true, Output::F32, Epilogue::None) if g.c_in.is_none() => Kernel::GemmWsMmF32,
        (false, true, Output::F32, Epilogue::BiasGradB { .. }) if g.c_in.is_none() => {
            Kernel::GemmWsMmF32Db
        }
        _ => return None,
    };
    Some(EntryPoint {
        kernel,
        p_mn: g.trans_b,
        q_mn: !g.trans_a,
    })
}

/// Splits of the reduction of an fp32 `mr × nr` GEMM over `k` on `sms` persistent CTAs, with
/// `ws_bytes` of workspace for the partial tiles: the count whose items fill the waves best
/// (fewer splits where that ties), 1 where splitting cannot help or does not fit.
pub(super) fn splits_for(mr: usize, nr: usize, k: usize, sms: usize, ws_bytes: usize) -> usize {
    let tiles = mr.div_ceil(BM) * nr.div_ceil(BN);
    let blocks = k.div_ceil(BK);
    if tiles == 0 || tiles > MAX_SPLIT_TILES || sms == 0 {
        return 1;
    }
    let fill = |s: usize| {
        let items = tiles * s;
        items as f64 / (items.div_ceil(sms) * sms) as f64
    };
    let mut best = (fill(1), 1);
    for s in 2..=MAX_SPLITS {
        let partial_bytes = s * (mr * nr + mr) * 4;
        if blocks / s < MIN_SPLIT_BLOCKS || partial_bytes > ws_bytes {
            break;
        }
        // A split must fill the waves clearly better to pay for its partial tiles.
        if fill(s) > best.0 + 0.02 {
            best = (fill(s), s);
        }
    }
    best.1
}

impl CudaBackend {
    /// Runs a 16-bit GEMM whose operands are ready (`gemm_operands`): by cuBLASLt, or by
    /// parc's kernel where that was measured faster (the module docs). `tune_out` as
    /// `gemm::Blas::run`.
    pub(super) fn run_16bit_gemm(&mut self, g: &Gemm, tune_out: Option<CUdeviceptr>) -> Result<()> {
        let operands = self.operands;
        let stream = self.stream.cu_stream();
        let entry = match self.hopper && self.variants.gemm != GemmKernel::CuBlasLt {
            true => kernel_for(g, operands),
            false => None,
        };
        let Some(entry) = entry else {
            return self.blas.run(g, operands, stream, tune_out);
        };
        let key = g.key(operands);
        let chosen =
            (self.gemm_operands.ws_chosen.get(&key).copied()).or_else(|| self.adopted_choice(&key));
        if let Some(chosen) = chosen {
            return match chosen.ws {
                true => self.ws_gemm(g, entry, chosen.splits, g.c, true),
                false => self.blas.run(g, operands, stream, tune_out),
            };
        }
        let splits = match g.out {
            Output::F32 => {
                let (_, ws_bytes) = self.blas.workspace();
                splits_for(
                    g.n as usize,
                    g.m as usize,
                    g.k as usize,
                    self.limits.sms,
                    ws_bytes,
                )
            }
            Output::Bf16 => 1,
        };
        if self.variants.gemm == GemmKernel::Ws {
            let chosen = Chosen {
                ws: true,
                ws_ms: 0.0,
                lt_ms: None,
                splits,
            };
            self.gemm_operands.ws_chosen.insert(key, chosen);
            return self.ws_gemm(g, entry, splits, g.c, true);
        }
        let lt_runs = self.blas.supports(g, operands)?;
        if lt_runs {
            self.blas.run(g, operands, stream, tune_out)?;
        }
        // Timed into D itself unless D is also what the GEMM reads (an accumulation).
        let target = if g.beta != 0.0 && g.c_in.is_none() {
            tune_out
        } else {
            Some(g.c)
        };
        let Some(target) = target else {
            // Nowhere to time it: cuBLASLt keeps it (or, where cuBLASLt has nothing, ours).
            if !lt_runs {
                self.ws_gemm(g, entry, splits, g.c, true)?;
            }
            return Ok(());
        };
        // Where cuBLASLt already ran it, a failure of parc's kernel (a launch it refuses) only
        // rules the kernel out for this plan.
        let ws_ms = match self.time_ws_gemm(g, entry, splits, target) {
            Ok(ms) => ms,
            Err(_) if lt_runs => f32::INFINITY,
            Err(e) => return Err(e),
        };
        let lt_ms = if lt_runs {
            self.blas.timed_ms(g, operands)
        } else {
            None
        };
        let ws = !lt_runs || lt_ms.is_some_and(|lt| ws_ms < lt);
        if !lt_runs && target != g.c {
            // Timed into the scratch, and nothing has written D yet.
            self.ws_gemm(g, entry, splits, g.c, true)?;
        }
        let chosen = Chosen {
            ws,
            ws_ms,
            lt_ms,
            splits,
        };
        self.gemm_operands.ws_chosen.insert(key, chosen);
        Ok(())
    }

    /// The choice an earlier run made for `key` (`choices`), kept as this run's.
    fn adopted_choice(&mut self, key: &PlanKey) -> Option<Chosen> {
        let saved = *self.gemm_operands.ws_preferred.get(&format!("{key:?}"))?;
        let chosen = Chosen {
            ws: saved.runs,
            ws_ms: 0.0,
            lt_ms: None,
            splits: saved.splits,
        };
        self.gemm_operands.ws_chosen.insert(*key, chosen);
        Some(chosen)
    }

    /// What parc's kernel against cuBLASLt chose for each plan, by plan description (`choices`),
    /// with those adopted but not yet used.
    pub(super) fn chosen_kernels(&self) -> std::collections::BTreeMap<String, ParcKernel> {
        let mut out = self.gemm_operands.ws_preferred.clone();
        for (key, c) in &self.gemm_operands.ws_chosen {
            let kernel = ParcKernel {
                runs: c.ws,
                splits: c.splits,
            };
            out.insert(format!("{key:?}"), kernel);
        }
        out
    }

    /// Milliseconds of `g` on parc's kernel writing D at `d`: the best timed run after a
    /// warm-up, as cuBLASLt's candidates are timed (`gemm::best_of`).
    fn time_ws_gemm(
        &mut self,
        g: &Gemm,
        entry: EntryPoint,
        splits: usize,
        d: CUdeviceptr,
    ) -> Result<f32> {
        let stream = self.stream.cu_stream();
        self.ws_gemm(g, entry, splits, d, false)?;
        best_of(stream, || self.ws_gemm(g, entry, splits, d, false))
    }

    /// Queues `g` on parc's kernel with `splits` (fp32 output only) writing D at `d`; with
    /// `counted`, inside the GEMM kernel timer (`time_gemm_kernels`) like a cuBLASLt run.
    fn ws_gemm(
        &mut self,
        g: &Gemm,
        entry: EntryPoint,
        splits: usize,
        d: CUdeviceptr,
        counted: bool,
    ) -> Result<()> {
        let (mr, nr, k) = (g.n, g.m, g.k);
        let bf16 = |ptr, (cols, rows, ld): (u64, u64, i64), boxes| {
            tma::matrix(Elem::Bf16, ptr, (cols, rows, ld as u64 * 2), boxes, true)
        };
        let tp: TmaMap = if entry.p_mn {
            bf16(g.b, (mr, k, g.ldb), (64, 64))?
        } else {
            bf16(g.b, (k, mr, g.ldb), (BK as u32, BM as u32))?
        };
        let tq: TmaMap = if entry.q_mn {
            bf16(g.a, (nr, k, g.lda), (64, 64))?
        } else {
            bf16(g.a, (k, nr, g.lda), (BK as u32, BN as u32))?
        };
        let (bias, bias_bf16, aux, db) = match g.epilogue {
            Epilogue::None => (0, false, 0, 0),
            Epilogue::Bias { ptr, bf16 } => (ptr, bf16, 0, 0),
            Epilogue::GeluAux { bias, aux } => {
                let (ptr, bf16) = bias.unwrap_or((0, false));
                (ptr, bf16, aux, 0)
            }
            Epilogue::DGelu { aux } => (0, false, aux, 0),
            Epilogue::BiasGradB { ptr } => (0, false, 0, ptr),
        };
        let (ws, ws_bytes) = self.blas.workspace();
        let counters = self.ws_counters()?;
        let tiles = (mr as usize).div_ceil(BM) * (nr as usize).div_ceil(BN);
        let splits = splits.max(1);
        if splits > 1
            && (tiles > MAX_SPLIT_TILES || splits * (mr * nr + mr) as usize * 4 > ws_bytes)
        {
            return Err(RuntimeError::Unsupported(format!(
                "parc's GEMM kernel cannot split a {mr} x {nr} reduction {splits} ways"
            )));
        }
        let args = [
            Arg::I32(mr as i32),
            Arg::I32(nr as i32),
            Arg::I32(k as i32),
            Arg::I32(splits as i32),
            Arg::I64(g.ldc),
            Arg::F32(g.beta),
            Arg::Ptr(d),
            Arg::Ptr(g.c_in.unwrap_or(0)),
            Arg::Ptr(bias),
            Arg::I32(i32::from(bias_bf16)),
            Arg::Ptr(aux),
            Arg::Ptr(db),
            Arg::Ptr(ws),
            Arg::Ptr(counters),
        ];
        let stream = self.stream.cu_stream();
        if counted {
            self.blas.timer_start(stream)?;
        }
        // The attention kernels' persistent launch: one CTA an SM, 384 threads, maps first.
        let work = tiles * splits;
        self.launch_persistent(entry.kernel, work, SMEM, &[tp, tq], &args)?;
        if counted {
            self.blas.timer_stop(stream)?;
        }
        Ok(())
    }

    /// The warp-specialized attention kernels' work counter and exit count (attention_ws_fwd.cu's
    /// ws_claim_next: each CTA claims its next item from the first, the last CTA out zeroes
    /// both, so the forward and the backward share them, one launch after the other on the
    /// stream), the two ints after the GEMM split counters in their allocation.
    pub(super) fn attention_work_counter(&mut self) -> Result<CUdeviceptr> {
        Ok(self.ws_counters()? + (MAX_SPLIT_TILES * 4) as CUdeviceptr)
    }

    /// The split reductions' arrival counters (zeroed once; each tile's last split resets its
    /// own) and, after them, the attention backward's (`attention_work_counter`): made on
    /// first use where `prepare_gemm` did not.
    pub(super) fn ws_counters(&mut self) -> Result<CUdeviceptr> {
        if self.gemm_operands.ws_counters.is_none() {
            let memory: CudaSlice<u8> = self.alloc_bytes(
                (MAX_SPLIT_TILES + ATTENTION_WORK_INTS) * 4,
                "persistent kernels' counters",
            )?;
            self.gemm_operands.ws_counters = Some(memory);
        }
        match &self.gemm_operands.ws_counters {
            Some(m) => Ok(super::raw_ptr(&self.stream, m)),
            None => Err(RuntimeError::Unsupported(
                "GEMM split counters missing".into(),
            )),
        }
    }

    /// One line per GEMM plan parc's kernel was measured on: the two times and which runs.
    pub(super) fn describe_ws_choices(&self) -> Vec<String> {
        let mut lines: Vec<String> = self
            .gemm_operands
            .ws_chosen
            .iter()
            .map(|(key, c)| {
                format!(
                    "{}: parc's kernel {:.3} ms ({} split{}), cuBLASLt {} -> {}",
                    key.describe(),
                    c.ws_ms,
                    c.splits,
                    if c.splits == 1 { "" } else { "s" },
                    c.lt_ms
                        .map_or("none".to_string(), |ms| format!("{ms:.3} ms")),
                    if c.ws { "parc's kernel" } else { "cuBLASLt" }
                )
            })
            .collect();
        lines.sort();
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_fill_the_waves_of_weight_gradients() {
        let ws = 32 << 20;
        // 768 x 768 over 32768 rows: 18 tiles; 7 splits make 126 items on 132 SMs.
        assert_eq!(splits_for(768, 768, 32768, 132, ws), 7);
        // Enough tiles for the SMs already: no split.
        assert_eq!(splits_for(32768, 768, 768, 132, ws), 1);
        // Too short a reduction to split.
        assert_eq!(splits_for(768, 768, 256, 132, ws), 1);
        // The partials must fit the workspace.
        assert_eq!(splits_for(768, 768, 32768, 132, 1 << 20), 1);
    }

    fn gemm(trans_a: bool, trans_b: bool, out: Output, epilogue: Epilogue) -> Gemm {
        Gemm {
            trans_a,
            trans_b,
            m: 768,
            n: 32768,
            k: 768,
            a: 1 << 20,
            lda: 768,
            b: 2 << 20,
            ldb: 768,
            c: 3 << 20,
            ldc: 768,
            c_in: None,
            beta: 0.0,
            out,
            epilogue,
        }
    }

    #[test]
    fn the_kernel_takes_the_layer_gemms_it_has_entry_points_for() {
        let name = |g: Gemm| kernel_for(&g, Operands::Bf16).map(|e| e.kernel);
        let bias = Epilogue::Bias {
            ptr: 4 << 20,
            bf16: true,
        };
        assert_eq!(
            name(gemm(true, false, Output::Bf16, bias)),
            Some(Kernel::GemmWsKkBf16)
        );
        assert_eq!(
            name(gemm(
                false,
                false,
                Output::Bf16,
                Epilogue::DGelu { aux: 5 << 20 }
            )),
            Some(Kernel::GemmWsKmDgelu)
        );
        let grad = Epilogue::BiasGradB { ptr: 4 << 20 };
        assert_eq!(
            name(gemm(false, true, Output::F32, grad)),
            Some(Kernel::GemmWsMmF32Db)
        );
        // Not in an fp32 run, not for unaligned rows, not for a layout without an entry point.
        let g = gemm(true, false, Output::Bf16, Epilogue::None);
        assert_eq!(kernel_for(&g, Operands::F32), None);
        assert_eq!(name(Gemm { lda: 770, ..g }), None);
        assert_eq!(name(gemm(true, true, Output::Bf16, Epilogue::None)), None);
        // More tiles than the kernel's 32-bit item count holds.
        assert_eq!(
            name(Gemm {
                m: 1 << 30,
                n: 1 << 30,
                ..g
            }),
            None
        );
    }
}
