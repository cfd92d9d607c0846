//! `parc check`.
use crate::SpecArgs;

#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// The .par file.
    pub file: std::path::PathBuf,
    #[command(flatten)]
    pub spec: SpecArgs,
}

pub fn main(args: CheckArgs) -> u8 {
    let _ = (&args.file, &args.spec.set);
    eprintln!("error: `parc check` is not implemented in this build yet");
    2
}
