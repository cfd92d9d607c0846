//! `parc run --comm auto|local|nccl`: how the ranks of a run communicate. `local` moves every
//! collective through host memory between the rank threads of this process; `nccl` runs them
//! on the GPUs' own buffers through NCCL (CUDA runs only), overlapped with compute. `auto` is
//! NCCL for a CUDA run of several ranks when NCCL can be loaded, else local. This module also
//! makes a CUDA rank's backend with NCCL attached: for rank threads of this process
//! ([`cuda_rank`]) and for one rank of a multi-process run ([`cuda_process_rank`]: the NCCL id
//! travels through the launcher's rendezvous).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CommChoice {
    /// NCCL for a CUDA run of several ranks (when NCCL loads), else local.
    Auto,
    /// Through host memory, between the rank threads of this process.
    Local,
    /// NCCL on the GPUs' buffers (needs --backend cuda and the NCCL library).
    Nccl,
}

/// `--comm-timeout SECS` as a duration: how long NCCL waits before it gives up on a peer.
#[cfg(feature = "cuda")]
pub fn comm_timeout(seconds: f64) -> Result<std::time::Duration, String> {
    if seconds.is_finite() && seconds > 0.0 {
        Ok(std::time::Duration::from_secs_f64(seconds))
    } else {
        Err("--comm-timeout must be a positive number of seconds".to_string())
    }
}

/// A CPU run cannot use NCCL.
pub fn check_cpu(choice: CommChoice) -> Result<(), String> {
    match choice {
        CommChoice::Nccl => Err(
            "--comm nccl moves GPU buffers: use it with --backend cuda (a \
             CPU run communicates with --comm local)"
                .to_string(),
        ),
        CommChoice::Auto | CommChoice::Local => Ok(()),
    }
}

#[cfg(feature = "cuda")]
pub use cuda::{cuda_process_rank, cuda_rank, resolve_cuda, StartGate};

#[cfg(feature = "cuda")]
mod cuda {
    use super::CommChoice;
    use parc_compiler::ir::Plan;
    use parc_compiler::spec::Spec;
    use parc_runtime::cuda::{nccl_available, nccl_version, CudaBackend, NcclId};
    use parc_runtime::error::{Result, RuntimeError};
    use parc_runtime::exec::{train_rank, ProcessRankResult, StepRecord, TrainOptions};
    use parc_runtime::launch::{LaunchEnv, Rendezvous};
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    /// How a CUDA run's ranks communicate, resolved.
    pub enum CudaComm {
        Local,
        /// NCCL, every rank joining the world communicator of this id.
        Nccl(NcclId),
    }

    /// Resolve `--comm` for a CUDA run of `world` ranks; says what it chose unless `quiet`.
    pub fn resolve_cuda(
        choice: CommChoice,
        world: u32,
        quiet: bool,
    ) -> std::result::Result<CudaComm, String> {
        let nccl = || -> Result<(NcclId, String)> { Ok((NcclId::new()?, nccl_version()?)) };
        let chosen = match choice {
            CommChoice::Local => CudaComm::Local,
            CommChoice::Nccl => {
                let (id, version) = nccl().map_err(|e| format!("--comm nccl: {e}"))?;
                if !quiet {
                    eprintln!("comm: nccl {version}");
                }
                CudaComm::Nccl(id)
            }
            CommChoice::Auto if world > 1 => match nccl_available().and_then(|()| nccl()) {
                Ok((id, version)) => {
                    if !quiet {
                        eprintln!("comm: nccl {version} (auto: {world} GPU ranks)");
                    }
                    CudaComm::Nccl(id)
                }
                Err(e) => {
                    if !quiet {
                        eprintln!("comm: local (auto: {e})");
                    }
                    CudaComm::Local
                }
            },
            CommChoice::Auto => CudaComm::Local,
        };
        Ok(chosen)
    }

    /// What the rank threads of one process share about NCCL. They join it only once every
    /// rank has opened its GPU (joining waits for all ranks, so a rank that failed before would
    /// leave the others waiting forever), and a rank that fails later records it here, which
    /// stops the others' NCCL waits at once instead of at the timeout.
    pub struct StartGate {
        world: u32,
        ready: AtomicU32,
        failed: AtomicBool,
        timeout: Duration,
        /// The first rank that failed after joining, and why.
        failure: Arc<Mutex<Option<(u32, String)>>>,
    }

    impl StartGate {
        pub fn new(world: u32, timeout: Duration) -> StartGate {
            StartGate {
                world,
                ready: AtomicU32::new(0),
                failed: AtomicBool::new(false),
                timeout,
                failure: Arc::new(Mutex::new(None)),
            }
        }

        fn fail(&self) {
            self.failed.store(true, Ordering::SeqCst);
        }

        /// This rank is ready; wait for the others (or fail when one failed or the timeout
        /// passes).
        fn pass(&self, rank: u32) -> Result<()> {
            self.ready.fetch_add(1, Ordering::SeqCst);
            let started = Instant::now();
            while self.ready.load(Ordering::SeqCst) < self.world {
                if self.failed.load(Ordering::SeqCst) {
                    return Err(RuntimeError::Comm(format!(
                        "rank {rank} stopped before joining NCCL because another rank could \
                         not open its GPU"
                    )));
                }
                if started.elapsed() > self.timeout {
                    return Err(RuntimeError::Comm(format!(
                        "rank {rank} waited {:.1} s for the other ranks to open their GPUs",
                        self.timeout.as_secs_f64()
                    )));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(())
        }
    }

    impl StartGate {
        /// Fails once another rank than `rank` recorded a failure.
        fn probe(&self, rank: u32) -> impl Fn() -> Result<()> + Send + 'static {
            let failure = Arc::clone(&self.failure);
            move || match failure.lock().ok().and_then(|f| f.clone()) {
                Some((failed, reason)) if failed != rank => Err(RuntimeError::Comm(format!(
                    "rank {rank} stopped because rank {failed} failed: {reason}"
                ))),
                _ => Ok(()),
            }
        }

        /// Records that `rank` failed (the first failure wins).
        fn notice(&self, rank: u32) -> impl Fn(&str) + Send + 'static {
            let failure = Arc::clone(&self.failure);
            move |reason: &str| {
                if let Ok(mut first) = failure.lock() {
                    first.get_or_insert_with(|| (rank, reason.to_string()));
                }
            }
        }
    }

    /// Rank `rank`'s backend on GPU `rank`, with NCCL attached when `comm` says so.
    pub fn cuda_rank(
        rank: u32,
        spec: &Spec,
        plan: &Plan,
        comm: &CudaComm,
        gate: &StartGate,
    ) -> Result<CudaBackend> {
        let backend = CudaBackend::with_precision(rank as usize, spec.train.precision);
        let mut backend = match backend {
            Ok(b) => b,
            Err(e) => {
                gate.fail();
                return Err(RuntimeError::Unsupported(format!(
                    "rank {rank} of a local CUDA run uses GPU {rank} (one GPU per rank, {} ranks \
                     in this plan): {e}",
                    plan.world
                )));
            }
        };
        if let CudaComm::Nccl(id) = comm {
            gate.pass(rank)?;
            backend.use_nccl(id, rank, plan, gate.timeout)?;
            backend.watch_failures(Box::new(gate.probe(rank)))?;
            backend.on_abort(Box::new(gate.notice(rank)))?;
        }
        Ok(backend)
    }

    /// This process's rank of a multi-process CUDA run: GPU `env.local_rank`, NCCL joined
    /// with the id rank 0 makes and the rendezvous carries to the others, and the NCCL host
    /// comm as the rank's comm (its abort reaches the rendezvous; NCCL waits stop when the
    /// rendezvous hears of another rank's failure).
    pub fn cuda_process_rank(
        choice: CommChoice,
        spec: &Spec,
        plan: &Plan,
        options: &TrainOptions,
        env: &LaunchEnv,
        rendezvous: &Rendezvous,
        on_step: &(dyn Fn(&StepRecord) + Sync),
    ) -> std::result::Result<ProcessRankResult, String> {
        if choice == CommChoice::Local {
            return Err(
                "--comm local runs the ranks as threads of one process; the ranks of a \
                 multi-process CUDA run communicate through NCCL (--comm nccl or auto)"
                    .to_string(),
            );
        }
        let (rank, gpu) = (env.rank, env.local_rank);
        let mut backend = CudaBackend::with_precision(gpu as usize, spec.train.precision)
            .map_err(|e| format!("rank {rank} uses GPU {gpu} (its local rank): {e}"))?;
        let id = if rank == 0 {
            let id = NcclId::new().map_err(|e| format!("rank 0: {e}"))?;
            rendezvous.broadcast_bytes(Some(&id.to_bytes()))
        } else {
            rendezvous.broadcast_bytes(None)
        };
        let id = id
            .and_then(|bytes| NcclId::from_bytes(&bytes))
            .map_err(|e| e.to_string())?;
        backend
            .use_nccl(&id, rank, plan, options.comm_timeout)
            .map_err(|e| e.to_string())?;
        let watch = rendezvous.clone();
        backend
            .watch_failures(Box::new(move || {
                watch.check_failed("waiting for NCCL communication")
            }))
            .map_err(|e| e.to_string())?;
        let notify = rendezvous.clone();
        let comm = backend
            .nccl_host_comm(Some(Box::new(move |reason: &str| notify.abort(reason))))
            .map_err(|e| e.to_string())?;
        train_rank(spec, plan, options, backend, Box::new(comm), on_step).map_err(|e| e.to_string())
    }

    #[cfg(test)]
    mod tests {
        use super::StartGate;
        use std::time::Duration;

        #[test]
        fn waiting_ranks_stop_when_one_fails_to_open_its_gpu() {
            let gate = StartGate::new(2, Duration::from_secs(30));
            std::thread::scope(|s| {
                let waiting = s.spawn(|| gate.pass(0));
                gate.fail();
                let err = waiting.join().unwrap().unwrap_err().to_string();
                assert!(err.contains("another rank could not open its GPU"), "{err}");
            });
        }

        #[test]
        fn a_rank_that_fails_stops_the_others_waits_and_the_first_failure_wins() {
            let gate = StartGate::new(3, Duration::from_secs(30));
            let (probe0, probe1) = (gate.probe(0), gate.probe(1));
            assert!(probe0().is_ok() && probe1().is_ok());
            gate.notice(1)("rank 1: op failed");
            gate.notice(2)("rank 2: later");
            let err = probe0().unwrap_err().to_string();
            assert!(
                err.contains("rank 0 stopped because rank 1 failed: rank 1: op failed"),
                "{err}"
            );
            assert!(probe1().is_ok(), "the failed rank does not stop itself");
        }

        #[test]
        fn ranks_pass_once_all_are_ready_and_time_out_otherwise() {
            let gate = StartGate::new(2, Duration::from_secs(30));
            std::thread::scope(|s| {
                let first = s.spawn(|| gate.pass(0));
                assert!(gate.pass(1).is_ok());
                assert!(first.join().unwrap().is_ok());
            });
            let lonely = StartGate::new(2, Duration::from_millis(20));
            let err = lonely.pass(0).unwrap_err().to_string();
            assert!(err.contains("waited"), "{err}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "cuda")]
    #[test]
    fn the_comm_timeout_must_be_positive() {
        assert_eq!(
            comm_timeout(2.5),
            Ok(std::time::Duration::from_millis(2500))
        );
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(comm_timeout(bad).unwrap_err().contains("positive"), "{bad}");
        }
    }

    #[test]
    fn a_cpu_run_refuses_nccl_and_takes_the_others() {
        let err = check_cpu(CommChoice::Nccl).unwrap_err();
        assert!(err.contains("--backend cuda"), "{err}");
        assert!(check_cpu(CommChoice::Auto).is_ok());
        assert!(check_cpu(CommChoice::Local).is_ok());
    }
}
