//! The NCCL watchdog: a thread per rank that aborts the rank's NCCL communicators when its
//! communication stream stops making progress, so no host call can wait forever on a peer
//! that died or hangs. The backend's own waits poll with a timeout, but some host calls block
//! inside CUDA (a synchronous copy behind compute that waits for a collective); aborting NCCL
//! ends the stuck NCCL kernels, the call returns, and the next wait reports why.
//!
//! Every `PERIOD` it records an event on the communication stream and polls it: the stream must
//! reach it within the run's timeout. Meanwhile it checks the communicators' health (NCCL's
//! asynchronous errors, the failure probe: another rank's reported failure) and aborts on an
//! error. It never holds the communicators' lock while the backend needs it for long: it only
//! tries the lock for the health check, and takes it to abort.
use super::comms::Shared;
use crate::cuda::device::driver_error;
use crate::error::Result;
use cudarc::driver::{CudaContext, CudaStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often the watchdog checks progress and health.
const PERIOD: Duration = Duration::from_millis(50);

/// Stops and joins the thread when dropped.
pub(crate) struct Watchdog {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    pub(crate) fn start(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        comms: &Shared,
        timeout: Duration,
    ) -> Result<Watchdog> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ctx, stream, comms, flag) = (
            Arc::clone(ctx),
            Arc::clone(stream),
            Arc::clone(comms),
            Arc::clone(&stop),
        );
        let thread = std::thread::Builder::new()
            .name("parc-nccl-watchdog".into())
            .spawn(move || watch(&ctx, &stream, &comms, timeout, &flag))
            .map_err(|e| crate::error::RuntimeError::Io {
                context: "starting the NCCL watchdog thread".into(),
                source: e,
            })?;
        Ok(Watchdog {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn abort(comms: &Shared, reason: &str) {
    if let Ok(mut c) = comms.lock() {
        let reason = format!("{reason}{}", c.stuck_note());
        c.abort(&reason);
    }
}

fn watch(
    ctx: &CudaContext,
    stream: &CudaStream,
    comms: &Shared,
    timeout: Duration,
    stop: &AtomicBool,
) {
    if ctx.bind_to_thread().is_err() {
        return;
    }
    while !stop.load(Ordering::SeqCst) {
        let event = match stream.record_event(None) {
            Ok(event) => event,
            Err(e) => {
                let e = driver_error("the NCCL watchdog recording an event", e);
                abort(comms, &e.to_string());
                return;
            }
        };
        let started = Instant::now();
        loop {
            if stop.load(Ordering::SeqCst) {
                return;
            }
            if event.try_is_complete().unwrap_or(false) {
                break;
            }
            // The backend may hold the lock while it waits itself (with its own timeout).
            let health = comms.try_lock().ok().map(|c| c.health());
            if let Some(Err(e)) = health {
                abort(comms, &format!("the NCCL watchdog saw: {e}"));
                return;
            }
            if started.elapsed() > timeout {
                abort(
                    comms,
                    &format!(
                        "the NCCL watchdog found communication stuck for {:.1} s (a peer rank \
                         is stuck or died)",
                        timeout.as_secs_f64()
                    ),
                );
                return;
            }
            std::thread::sleep(PERIOD);
        }
        std::thread::sleep(PERIOD);
    }
}
