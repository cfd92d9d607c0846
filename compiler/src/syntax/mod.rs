//! Syntax of `.par` files: the tree ([`ast`]) and the parser that builds it from text
//! ([`parser`], over `grammar/par.pest`). No meaning is given here; see [`crate::check`].
pub mod ast;
pub mod parser;

pub use parser::{parse_file, parse_value};
