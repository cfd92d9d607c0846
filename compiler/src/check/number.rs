//! Numbers of the language: integer/float arithmetic with units (`80 GB`, `900 GB/s`,
//! `989 TFLOP/s`, `5 us`). Integers stay exact (checked, overflow is an error); a division that
//! is not exact gives a float that remembers its operands, so a later "this must be an integer"
//! error can say `64 / 3`.

use crate::diag::{Diagnostic, Span};
use crate::syntax::ast::BinOp;

/// What a number measures. Decimal prefixes are powers of 1000, binary ones (`GiB`) of 1024;
/// bits (`Gb/s`) are converted to bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    None,
    Bytes,
    BytesPerSec,
    FlopsPerSec,
    Seconds,
}

impl Unit {
    pub fn describe(self) -> &'static str {
        match self {
            Unit::None => "a plain number",
            Unit::Bytes => "a size like `80 GB`",
            Unit::BytesPerSec => "a bandwidth like `450 GB/s`",
            Unit::FlopsPerSec => "a compute rate like `989 TFLOP/s`",
            Unit::Seconds => "a time like `5 us`",
        }
    }
}

/// The unit suffixes, their scale and what they measure.
pub const UNITS: [(&str, f64, Unit); 21] = [
    ("B", 1.0, Unit::Bytes),
    ("KB", 1e3, Unit::Bytes),
    ("MB", 1e6, Unit::Bytes),
    ("GB", 1e9, Unit::Bytes),
    ("TB", 1e12, Unit::Bytes),
    ("KiB", 1024.0, Unit::Bytes),
    ("MiB", 1048576.0, Unit::Bytes),
    ("GiB", 1073741824.0, Unit::Bytes),
    ("TiB", 1099511627776.0, Unit::Bytes),
    ("MB/s", 1e6, Unit::BytesPerSec),
    ("GB/s", 1e9, Unit::BytesPerSec),
    ("TB/s", 1e12, Unit::BytesPerSec),
    ("Gb/s", 1e9 / 8.0, Unit::BytesPerSec),
    ("Tb/s", 1e12 / 8.0, Unit::BytesPerSec),
    ("FLOP/s", 1.0, Unit::FlopsPerSec),
    ("GFLOP/s", 1e9, Unit::FlopsPerSec),
    ("TFLOP/s", 1e12, Unit::FlopsPerSec),
    ("PFLOP/s", 1e15, Unit::FlopsPerSec),
    ("ns", 1e-9, Unit::Seconds),
    ("us", 1e-6, Unit::Seconds),
    ("ms", 1e-3, Unit::Seconds),
];

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Number {
    pub value: f64,
    /// Set while the value is an exact integer computed with integers only.
    pub int: Option<i64>,
    pub unit: Unit,
    /// `(a, b)` when this came from an integer division `a / b` that was not exact.
    pub inexact: Option<(i64, i64)>,
    pub span: Span,
}

impl Number {
    pub fn int(i: i64, span: Span) -> Number {
        Number {
            value: i as f64,
            int: Some(i),
            unit: Unit::None,
            inexact: None,
            span,
        }
    }

    pub fn float(value: f64, unit: Unit, span: Span) -> Number {
        Number {
            value,
            int: None,
            unit,
            inexact: None,
            span,
        }
    }

    /// A literal as written, with its unit suffix.
    pub fn literal(text: &str, unit: Option<&str>, span: Span) -> Result<Number, Diagnostic> {
        let clean: String = text.chars().filter(|c| *c != '_').collect();
        let is_int = !clean.contains(['.', 'e', 'E']);
        let bad = || {
            Diagnostic::error("E0907", format!("the number `{text}` is too large"))
                .label(span, "this number")
                .help("numbers must fit in 64 bits")
        };
        let base = if is_int {
            Number::int(clean.parse::<i64>().map_err(|_| bad())?, span)
        } else {
            let v = clean.parse::<f64>().map_err(|_| bad())?;
            if !v.is_finite() {
                return Err(bad());
            }
            Number::float(v, Unit::None, span)
        };
        let Some(unit) = unit else {
            return Ok(base);
        };
        let Some((_, scale, kind)) = UNITS.iter().find(|(u, _, _)| *u == unit) else {
            return Ok(base);
        };
        // Sub-unit scales divide by their exact reciprocal: 10 us is 1e-5 s, not 9.999…e-6.
        let value = if *scale < 1.0 {
            base.value / (1.0 / scale).round()
        } else {
            base.value * scale
        };
        let int = (value.fract() == 0.0 && value.abs() < 9.0e15 && *kind == Unit::Bytes)
            .then_some(value as i64);
        Ok(Number {
            value,
            int,
            unit: *kind,
            inexact: None,
            span,
        })
    }

    pub fn neg(self, span: Span) -> Number {
        Number {
            value: -self.value,
            int: self.int.and_then(i64::checked_neg),
            span,
            inexact: None,
            ..self
        }
    }

    /// The value as a non-negative integer, or an error saying why it is not one.
    pub fn as_count(&self, what: &str) -> Result<u64, Diagnostic> {
        self.as_count_in(what, 0, None)
    }

    /// [`Number::as_count`] for a value whose range is `min..=max`: the help of a negative or
    /// too large value names that range, so that following it passes. (The caller checks a
    /// whole number against the range.)
    pub fn as_count_in(&self, what: &str, min: u64, max: Option<u64>) -> Result<u64, Diagnostic> {
        // A count has no unit: `steps = 4 MB` is not four million steps.
        if self.unit != Unit::None {
            return Err(Diagnostic::error(
                "E0908",
                format!(
                    "{what} must be a plain number, not {}",
                    self.unit.describe()
                ),
            )
            .label(self.span, "this value")
            .help(format!("write {what} without a unit")));
        }
        if let Some((a, b)) = self.inexact {
            let q = a / b;
            let pick = [q, q + 1]
                .iter()
                .map(|v| (v * b).to_string())
                .collect::<Vec<_>>();
            return Err(Diagnostic::error(
                "E0901",
                format!(
                    "{a} / {b} = {:.4} is not a whole number, and it is used as a size",
                    a as f64 / b as f64
                ),
            )
            .label(
                self.span,
                format!("this division is not exact (used as {what})"),
            )
            .help(format!(
                "make {a} a multiple of {b} (e.g. {}), or {b} a divisor of {a}",
                pick.join(" or ")
            )));
        }
        let int = match self.int {
            Some(i) => Some(i),
            None if self.value.fract() == 0.0 && self.value.abs() < 9.0e15 => {
                Some(self.value as i64)
            }
            None => None,
        };
        match int {
            Some(i) if i >= 0 => Ok(i as u64),
            Some(i) => Err(Diagnostic::error(
                "E0903",
                format!("{what} must not be negative, found {i}"),
            )
            .label(self.span, "negative")
            .help(format!("use a value ≥ {min} for {what}"))),
            None if !self.value.is_finite() || self.value.fract() == 0.0 => {
                Err(too_large(what, self.value, max).label(self.span, "too large"))
            }
            None => Err(Diagnostic::error(
                "E0901",
                format!("{what} must be a whole number, found {}", self.value),
            )
            .label(self.span, "not a whole number")
            .help(format!(
                "use {} or {}",
                self.value.floor(),
                self.value.ceil()
            ))),
        }
    }

    /// The value in the given unit (a plain number is accepted as already in base units).
    pub fn as_measure(&self, what: &str, unit: Unit) -> Result<f64, Diagnostic> {
        if self.unit != unit && self.unit != Unit::None {
            return Err(Diagnostic::error(
                "E0908",
                format!(
                    "{what} must be {}, found {}",
                    unit.describe(),
                    self.unit.describe()
                ),
            )
            .label(self.span, "wrong unit")
            .help(format!("write {what} as {}", unit.describe())));
        }
        Ok(self.value)
    }

    /// A plain number reads in base units (bytes, bytes/s, FLOP/s), but a GPU's or link's one
    /// too small to be meant so (`memory: 24`, `flops: 165`: a 24-byte GPU) is a unit left
    /// out: said, where it would pass and price the plan on a GPU that fits nothing. (A small
    /// gradient bucket in bytes is meant: the caller asks only of the cluster's hardware.)
    pub fn unitless_too_small(&self, what: &str, unit: Unit) -> Option<Diagnostic> {
        let (least, base, meant) = match unit {
            Unit::Bytes => (1e6, "bytes", "GB"),
            Unit::BytesPerSec => (1e6, "bytes/s", "GB/s"),
            Unit::FlopsPerSec => (1e9, "FLOP/s", "TFLOP/s"),
            Unit::None | Unit::Seconds => return None,
        };
        (self.unit == Unit::None && self.value > 0.0 && self.value < least).then(|| {
            Diagnostic::error(
                "E0908",
                format!(
                    "{what} = {} has no unit, so it reads as {} {base}",
                    self.value, self.value
                ),
            )
            .label(self.span, "no unit")
            .help(format!("write the unit: `{} {meant}`", self.value))
        })
    }
}

/// `a op b` with units: `+`/`-` need equal units, `*` at most one unit, `/` a unitless divisor
/// (or equal units, giving a plain ratio).
pub fn arith(op: BinOp, a: Number, b: Number, span: Span) -> Result<Number, Diagnostic> {
    let unit_err = || {
        Diagnostic::error(
            "E0908",
            format!(
                "cannot apply `{}` to {} and {}",
                op.symbol(),
                a.unit.describe(),
                b.unit.describe()
            ),
        )
        .label(span, "mixed units")
        .help(
            "only multiply or divide a quantity by a plain number, and add quantities of one unit",
        )
    };
    let overflow = || {
        Diagnostic::error(
            "E0907",
            "arithmetic overflow: the result does not fit in 64 bits",
        )
        .label(span, "this expression")
        .help("use smaller values")
    };
    let unit = match op {
        BinOp::Add | BinOp::Sub if a.unit == b.unit => a.unit,
        BinOp::Mul if a.unit == Unit::None => b.unit,
        BinOp::Mul if b.unit == Unit::None => a.unit,
        BinOp::Div if b.unit == Unit::None => a.unit,
        BinOp::Div if a.unit == b.unit => Unit::None,
        _ => return Err(unit_err()),
    };
    if op == BinOp::Div && b.value == 0.0 {
        return Err(Diagnostic::error("E0907", "division by zero")
            .label(b.span, "this is zero")
            .help("divide by a non-zero value"));
    }
    let ints = match (a.int, b.int) {
        (Some(x), Some(y)) if a.inexact.is_none() && b.inexact.is_none() => Some((x, y)),
        _ => None,
    };
    let mut out = Number {
        value: 0.0,
        int: None,
        unit,
        inexact: None,
        span,
    };
    if let Some((x, y)) = ints {
        let exact = match op {
            BinOp::Add => x.checked_add(y),
            BinOp::Sub => x.checked_sub(y),
            BinOp::Mul => x.checked_mul(y),
            BinOp::Div => {
                if x % y == 0 {
                    Some(x / y)
                } else {
                    out.value = x as f64 / y as f64;
                    out.inexact = Some((x, y));
                    return Ok(out);
                }
            }
        };
        let v = exact.ok_or_else(overflow)?;
        out.int = Some(v);
        out.value = v as f64;
        return Ok(out);
    }
    out.value = match op {
        BinOp::Add => a.value + b.value,
        BinOp::Sub => a.value - b.value,
        BinOp::Mul => a.value * b.value,
        BinOp::Div => a.value / b.value,
    };
    if !out.value.is_finite() {
        return Err(overflow());
    }
    Ok(out)
}

/// A whole number past what parc counts in (2^53), or past `max`.
fn too_large(what: &str, value: f64, max: Option<u64>) -> Diagnostic {
    let help = match max {
        Some(max) => format!("use a value of at most {max} for {what}"),
        None => format!("use a smaller value for {what}: parc counts in whole numbers below 2^53"),
    };
    Diagnostic::error(
        "E0903",
        format!("{what} = {value:e} is more than parc supports"),
    )
    .help(help)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(i: i64) -> Number {
        Number::int(i, Span::default())
    }

    #[test]
    fn units_scale_and_bits_become_bytes() {
        let gb = Number::literal("80", Some("GB"), Span::default()).unwrap();
        assert_eq!(gb.int, Some(80_000_000_000));
        let ib = Number::literal("400", Some("Gb/s"), Span::default()).unwrap();
        assert_eq!(ib.value, 50e9);
        assert_eq!(ib.unit, Unit::BytesPerSec);
    }

    #[test]
    fn inexact_division_is_remembered() {
        let q = arith(BinOp::Div, n(64), n(3), Span::default()).unwrap();
        assert_eq!(q.inexact, Some((64, 3)));
        let e = q.as_count("head_dim").unwrap_err();
        assert_eq!(e.code, "E0901");
        assert_eq!(
            arith(BinOp::Div, n(64), n(4), Span::default()).unwrap().int,
            Some(16)
        );
    }

    #[test]
    fn overflow_and_zero_division_are_errors() {
        assert!(arith(BinOp::Mul, n(i64::MAX), n(2), Span::default()).is_err());
        assert!(arith(BinOp::Div, n(1), n(0), Span::default()).is_err());
    }

    #[test]
    fn adding_bytes_to_bandwidth_is_refused() {
        let a = Number::literal("1", Some("GB"), Span::default()).unwrap();
        let b = Number::literal("1", Some("GB/s"), Span::default()).unwrap();
        assert_eq!(
            arith(BinOp::Add, a, b, Span::default()).unwrap_err().code,
            "E0908"
        );
    }
}
