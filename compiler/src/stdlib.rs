//! The standard library of `.par` modules (`use std::gpt2 { Block }`), embedded in the binary
//! because the compiler reads no files. The sources live in `stdlib/*.par`; `stdlib/act.par` is
//! the prelude ([`PRELUDE`]).

/// `(module name, file name, source)` for every stdlib module.
pub const MODULES: [(&str, &str, &str); 2] = [
    (
        "gpt2",
        "stdlib/gpt2.par",
        include_str!("../../stdlib/gpt2.par"),
    ),
    (
        "llama",
        "stdlib/llama.par",
        include_str!("../../stdlib/llama.par"),
    ),
];

/// The prelude (`stdlib/act.par`): file name and source. Its functions are in scope in every
/// file and module without a `use` (`act = squared_relu`, `act = glu(gelu)`).
pub const PRELUDE: (&str, &str) = ("stdlib/act.par", include_str!("../../stdlib/act.par"));

/// The file name and source of `std::NAME`.
pub fn module(name: &str) -> Option<(&'static str, &'static str)> {
    MODULES
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|(_, file, text)| (*file, *text))
}

/// The names of the stdlib modules, for "did you mean" help.
pub fn names() -> Vec<&'static str> {
    MODULES.iter().map(|(n, _, _)| *n).collect()
}
