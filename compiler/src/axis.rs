//! The mesh axes: a leaf module, so that what the spec imports (the FP8 scale groups of
//! `ir::fp8`, which name the axes splitting an operand) can name them without importing the
//! spec. `spec::Axis` re-exports it.

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Axis {
    Dp,
    Pp,
    Cp,
    Tp,
}

impl Axis {
    pub fn name(self) -> &'static str {
        match self {
            Axis::Dp => "dp",
            Axis::Pp => "pp",
            Axis::Cp => "cp",
            Axis::Tp => "tp",
        }
    }
    pub const ALL: [Axis; 4] = [Axis::Dp, Axis::Pp, Axis::Cp, Axis::Tp];
}
