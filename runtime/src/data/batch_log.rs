//! The batch log (`parc run --log-batches FILE`): the token windows of every step's global
//! batch, written before training starts, so that another trainer (the PyTorch peer in
//! `bench/torch_peer.py`) can train on exactly the sequences parc trains on.
//!
//! JSON lines. The first is a header,
//! `{"event":"batches","seq":S,"global_batch":G,"samples":N,"seed":SEED}`; then one line per step,
//! `{"step":K,"offsets":[O_0, …, O_{G-1}]}`, with `K` 1-based as in `parc run --log-format
//! json` and `O_i` the token offset (sample index × seq) of the `i`-th sample of the global
//! batch in stream order (dp rank `r`'s microbatch `j` is the slice starting at
//! `(r · microbatches + j) · micro_batch`). A sample's inputs are tokens `[O, O + S)` of the
//! data file and its targets `[O + 1, O + S + 1)`.
use super::{BatchLayout, Sampler};
use crate::error::{Result, RuntimeError};
use parc_compiler::ir::Plan;
use parc_compiler::spec::{Axis, Spec};
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::Path;

/// Write the batch log of a run of `plan` over 0-based `steps` with a dataset of `samples`
/// samples: the batches of the sampler every rank builds (the spec's seed, the plan's layout),
/// the first step starting at stream position `position` (`Sampler::resume_at`).
pub fn write_run_batch_log(
    path: &Path,
    spec: &Spec,
    plan: &Plan,
    samples: u64,
    steps: Range<u64>,
    position: u64,
) -> Result<()> {
    let layout = BatchLayout {
        dp: plan.mesh.size(Axis::Dp),
        microbatches: plan.microbatches,
        micro_batch: plan.micro_batch,
    };
    let mut sampler = Sampler::new(spec.train.seed, samples, layout)?;
    sampler.resume_at(steps.start, position);
    write_batch_log(path, &mut sampler, spec.model.seq, spec.train.seed, steps)
}

/// Write the batch log of 0-based `steps` to `path` (replacing it).
pub fn write_batch_log(
    path: &Path,
    sampler: &mut Sampler,
    seq: u64,
    seed: u64,
    steps: Range<u64>,
) -> Result<()> {
    let io = |source| RuntimeError::Io {
        context: format!("writing the batch log {}", path.display()),
        source,
    };
    let file = std::fs::File::create(path).map_err(io)?;
    let mut out = BufWriter::new(file);
    writeln!(
        out,
        "{{\"event\":\"batches\",\"seq\":{seq},\"global_batch\":{},\"samples\":{},\"seed\":{seed}}}",
        sampler.layout().global_batch(),
        sampler.samples()
    )
    .map_err(io)?;
    for step in steps {
        let offsets: Vec<String> = sampler
            .global_batch(step)
            .iter()
            .map(|sample| (sample * seq).to_string())
            .collect();
        writeln!(
            out,
            "{{\"step\":{},\"offsets\":[{}]}}",
            step + 1,
            offsets.join(",")
        )
        .map_err(io)?;
    }
    out.flush().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::BatchLayout;

    #[test]
    fn lines_hold_each_steps_global_batch_as_token_offsets() {
        let layout = BatchLayout {
            dp: 2,
            microbatches: 2,
            micro_batch: 1,
        };
        let mut sampler = Sampler::new(7, 10, layout).unwrap();
        let path =
            std::env::temp_dir().join(format!("parc-batch-log-{}.jsonl", std::process::id()));
        write_batch_log(&path, &mut sampler, 16, 7, 1..3).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(
            lines[0],
            r#"{"event":"batches","seq":16,"global_batch":4,"samples":10,"seed":7}"#
        );
        let expected: Vec<String> = sampler
            .global_batch(2)
            .iter()
            .map(|s| (s * 16).to_string())
            .collect();
        assert_eq!(
            lines[2],
            format!("{{\"step\":3,\"offsets\":[{}]}}", expected.join(","))
        );
        let first: serde_json::Value = serde_json::from_str(lines[1]).unwrap();
        assert_eq!(first["step"], 2);
        assert_eq!(first["offsets"].as_array().unwrap().len(), 4);
    }
}
