//! `parc run`.
use crate::SpecArgs;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The .par file.
    pub file: std::path::PathBuf,
    #[command(flatten)]
    pub spec: SpecArgs,
}

pub fn main(args: RunArgs) -> u8 {
    let _ = (&args.file, &args.spec.set);
    eprintln!("error: `parc run` is not implemented in this build yet");
    2
}
