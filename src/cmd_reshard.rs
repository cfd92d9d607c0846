//! `parc reshard CKPT SPEC OUT [--set PATH=VALUE]...`: write checkpoint `CKPT` re-sharded for
//! the plan of `SPEC` as `OUT/step-N` (a checkpoint folder that `parc run SPEC --resume OUT`
//! loads without re-sharding, and verifies), offline: no backend, no comm. A change the
//! checkpoint cannot follow (another model, optimizer, precision, global batch or seed) is
//! refused naming the field (E1101–E1106, docs/diagnostics.md). [`render_moves`] shows what
//! each new rank reads, here and in `parc check --resume`.
use crate::run_prepare::{compile, print_error};
use crate::SpecArgs;
use parc_compiler::ir::Plan;
use parc_compiler::spec::Spec;
use parc_runtime::checkpoint::{self, reshard::RankRead, FolderLock, Layout, ResumeKind};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct ReshardArgs {
    /// The checkpoint: a `step-N` folder, or a checkpoint folder (its newest checkpoint that
    /// verifies).
    pub checkpoint: PathBuf,
    /// The .par file whose plan to re-shard it for.
    pub file: PathBuf,
    /// The checkpoint folder to write `step-N` into (give it to `parc run --resume`).
    pub out: PathBuf,
    #[command(flatten)]
    pub spec: SpecArgs,
}

pub fn main(args: ReshardArgs) -> u8 {
    let (spec, plan) = match compile(&args.file, &args.spec) {
        Ok(compiled) => compiled,
        Err(code) => return code,
    };
    match reshard(&args, &spec, &plan) {
        Ok(()) => 0,
        Err(message) => {
            print_error(&message);
            1
        }
    }
}

fn reshard(args: &ReshardArgs, spec: &Spec, plan: &Plan) -> Result<(), String> {
    let (source, manifest) =
        checkpoint::choose_resume(&args.checkpoint).map_err(|e| e.to_string())?;
    let layout = Layout::of(spec, plan).map_err(|e| e.to_string())?;
    let hash = checkpoint::plan_hash(plan);
    let kind = checkpoint::plan_change(&manifest, &hash, &layout, spec.train.seed, false)
        .map_err(|refusal| format!("{}: {refusal}", source.display()))?;
    let target = args.out.join(checkpoint::step_dir_name(manifest.step));
    if target.exists() {
        return Err(format!(
            "{} exists; give another OUT folder (parc reshard never replaces a checkpoint)",
            target.display()
        ));
    }
    let _lock = FolderLock::acquire(&args.out).map_err(|e| e.to_string())?;
    let (written, reads) =
        checkpoint::reshard::write_checkpoint(&source, &manifest, &layout, &hash, &args.out)
            .map_err(|e| e.to_string())?;
    if kind == ResumeKind::SamePlan {
        eprintln!(
            "note: {} was already written by this plan; {} is a copy",
            source.display(),
            written.display()
        );
    }
    println!(
        "{} ({} ranks) → {} ({} ranks, plan {hash}), step {}:",
        source.display(),
        manifest.world,
        written.display(),
        plan.world,
        manifest.step
    );
    print!("{}", render_moves(&reads));
    Ok(())
}

/// One line per new rank: the bytes it reads and from which old shard files.
pub fn render_moves(reads: &[RankRead]) -> String {
    let mut out = String::new();
    for read in reads {
        let shards = read.shards();
        let names: Vec<String> = shards.iter().map(|&r| format!("rank {r}")).collect();
        let from = match names.len() {
            0 => "nothing".to_string(),
            1..=4 => format!(
                "{} shard file{} ({})",
                names.len(),
                plural(names.len()),
                names.join(", ")
            ),
            n => format!("{n} shard files"),
        };
        out.push_str(&format!(
            "  rank {}: reads {} from {from}\n",
            read.rank,
            bytes(read.bytes())
        ));
    }
    out
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// `12.3 KiB`: a size for people.
fn bytes(n: u64) -> String {
    let n = n as f64;
    match n {
        n if n >= 1024.0 * 1024.0 * 1024.0 => format!("{:.2} GiB", n / (1024.0 * 1024.0 * 1024.0)),
        n if n >= 1024.0 * 1024.0 => format!("{:.2} MiB", n / (1024.0 * 1024.0)),
        n if n >= 1024.0 => format!("{:.1} KiB", n / 1024.0),
        n => format!("{n} B"),
    }
}
