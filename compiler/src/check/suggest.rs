//! "Did you mean" suggestions and readable lists for diagnostics.

/// The candidate closest to `name` by edit distance, if it is close enough to be a typo.
pub fn closest<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let limit = (name.chars().count() / 3).max(1);
    candidates
        .into_iter()
        .map(|c| (edit_distance(&name.to_lowercase(), &c.to_lowercase()), c))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, c)| (*d, c.len()))
        .map(|(_, c)| c)
}

/// The help for a `name` that is none of `candidates`: `rest`, after "did you mean `c`?" where
/// a candidate `c` is close to it.
pub fn help<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>, rest: &str) -> String {
    match closest(name, candidates) {
        Some(c) => format!("did you mean `{c}`? {rest}"),
        None => rest.to_string(),
    }
}

/// "did you mean `c`?" where a candidate `c` is close to `name`, else `otherwise`.
pub fn did_you_mean<'a>(
    name: &str,
    candidates: impl IntoIterator<Item = &'a str>,
    otherwise: &str,
) -> String {
    match closest(name, candidates) {
        Some(c) => format!("did you mean `{c}`?"),
        None => otherwise.to_string(),
    }
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = if ca == *cb {
                prev
            } else {
                1 + prev.min(cur).min(row[j])
            };
            prev = cur;
        }
    }
    row[b.len()]
}

/// `a, b or c` with each item in backticks.
pub fn one_of(items: &[&str]) -> String {
    let quoted: Vec<String> = items.iter().map(|i| format!("`{i}`")).collect();
    match quoted.len() {
        0 => String::new(),
        1 => quoted[0].clone(),
        n => format!("{} or {}", quoted[..n - 1].join(", "), quoted[n - 1]),
    }
}

/// `1, 2, 3, 4, 6 or 12`: the divisors of `n` (at most `limit` of them, then the largest).
pub fn divisors(n: u64, up_to: u64) -> String {
    let ds: Vec<String> = (1..=n.min(up_to).min(1 << 20))
        .filter(|d| n.is_multiple_of(*d))
        .map(|d| d.to_string())
        .collect();
    let refs: Vec<&str> = ds.iter().map(String::as_str).collect();
    match refs.len() {
        0 => String::new(),
        1 => refs[0].to_string(),
        k => format!("{} or {}", refs[..k - 1].join(", "), refs[k - 1]),
    }
}

/// The divisors of `n` (up to 2^20), nearest to `near` first (of two as near, the larger):
/// a help's alternatives in the order a tool should prefer them.
pub fn divisors_nearest(n: u64, near: u64) -> Vec<u64> {
    let mut ds: Vec<u64> = (1..=n.min(1 << 20))
        .filter(|d| n.is_multiple_of(*d))
        .collect();
    ds.sort_by_key(|&d| (d.abs_diff(near), std::cmp::Reverse(d)));
    ds
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divisors_nearest_come_first_the_larger_of_two_as_near() {
        assert_eq!(divisors_nearest(4, 3), vec![4, 2, 1]);
        assert_eq!(divisors_nearest(12, 5), vec![6, 4, 3, 2, 1, 12]);
    }

    #[test]
    fn finds_typos_only() {
        assert_eq!(closest("heds", ["heads", "d", "layers"]), Some("heads"));
        assert_eq!(closest("zzz", ["heads", "layers"]), None);
    }

    #[test]
    fn lists_divisors() {
        assert_eq!(divisors(12, 12), "1, 2, 3, 4, 6 or 12");
        assert_eq!(divisors(12, 4), "1, 2, 3 or 4");
    }
}
