//! `parc plan`.
use crate::SpecArgs;

#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// The .par file.
    pub file: std::path::PathBuf,
    #[command(flatten)]
    pub spec: SpecArgs,
}

pub fn main(args: PlanArgs) -> u8 {
    let _ = (&args.file, &args.spec.set);
    eprintln!("error: `parc plan` is not implemented in this build yet");
    2
}
