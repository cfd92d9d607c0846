//! A source file's text as a diagnostic shows it: control characters escaped (`\u{1b}`, never
//! raw bytes to the terminal) and lines longer than [`MAX_LINE`] characters cut to a window of
//! [`WINDOW`] characters around the labels on them, with `…` where text was left out. Offsets of
//! the original text are mapped to the shown text so labels still point at their spans.

/// Lines longer than this (in characters) are cut.
pub const MAX_LINE: usize = 160;
/// How many characters of a cut line are shown.
pub const WINDOW: usize = 120;

/// The shown text, and for each byte offset of the original (and its end) the offset in it.
#[derive(Debug)]
struct Shown {
    pub text: String,
    map: Vec<usize>,
}

impl Shown {
    /// Where the original's byte `offset` is in the shown text.
    pub fn offset(&self, offset: usize) -> usize {
        self.map
            .get(offset)
            .or(self.map.last())
            .copied()
            .unwrap_or(0)
    }
}

/// A file as a diagnostic shows it, for miette: the shown text, whose location header gives the
/// column in the file's own text (not in the shown, cut or escaped, line).
#[derive(Debug)]
pub struct ShownSource {
    pub name: String,
    shown: Shown,
    original: String,
}

impl ShownSource {
    pub fn new(name: String, original: &str, spans: &[(usize, usize)]) -> ShownSource {
        ShownSource {
            name,
            shown: shown(original, spans),
            original: original.to_string(),
        }
    }

    /// Where the original's byte `offset` is in the shown text.
    pub fn offset(&self, offset: usize) -> usize {
        self.shown.offset(offset)
    }

    /// The 0-based byte column in the original text of the shown text's byte `at`.
    fn original_column(&self, at: usize) -> usize {
        let offset = self.shown.map.partition_point(|&x| x < at);
        let offset = offset.min(self.original.len());
        let line_start = self.original[..offset].rfind('\n').map_or(0, |i| i + 1);
        offset - line_start
    }
}

impl miette::SourceCode for ShownSource {
    fn read_span<'a>(
        &'a self,
        span: &miette::SourceSpan,
        before: usize,
        after: usize,
    ) -> Result<Box<dyn miette::SpanContents<'a> + 'a>, miette::MietteError> {
        let contents = self.shown.text.read_span(span, before, after)?;
        // Without context lines the column is the label's: the file's own.
        let column = if before == 0 {
            self.original_column(span.offset())
        } else {
            contents.column()
        };
        Ok(Box::new(miette::MietteSpanContents::new_named(
            self.name.clone(),
            contents.data(),
            *contents.span(),
            contents.line(),
            column,
            contents.line_count(),
        )))
    }
}

/// Whether `c` is shown escaped (line breaks and tabs are layout, not content to escape).
fn is_escaped(c: char) -> bool {
    c.is_control() && c != '\n' && c != '\t'
}

/// `text` with control characters escaped as `\u{1b}` (for messages that quote the file).
pub fn escape_controls(text: &str) -> String {
    text.chars()
        .map(|c| {
            if is_escaped(c) {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// `text` as shown, for labels at the byte ranges `spans`.
fn shown(text: &str, spans: &[(usize, usize)]) -> Shown {
    let mut out = Shown {
        text: String::with_capacity(text.len().min(1 << 16)),
        map: vec![0; text.len() + 1],
    };
    let mut line_start = 0;
    for line in text.split_inclusive('\n') {
        show_line(&mut out, text, line_start, line, spans);
        line_start += line.len();
    }
    out.map[text.len()] = out.text.len();
    out
}

/// Append `line` (at byte `start` of `text`) to `out`, cut to its window when long.
fn show_line(out: &mut Shown, text: &str, start: usize, line: &str, spans: &[(usize, usize)]) {
    let body = line.strip_suffix('\n').unwrap_or(line);
    let chars: Vec<(usize, char)> = body.char_indices().collect();
    let (from, to) = window(&chars, start, spans);
    let byte_at = |i: usize| start + chars.get(i).map_or(body.len(), |&(b, _)| b);
    if from > 0 {
        // Left out before the window: at the window's start.
        out.text.push('…');
        out.map[start..byte_at(from)].fill(out.text.len());
    }
    for &(at, c) in &chars[from..to] {
        let byte = start + at;
        out.map[byte..byte + c.len_utf8()].fill(out.text.len());
        if is_escaped(c) && !(c == '\r' && text[byte + 1..].starts_with('\n')) {
            out.text.extend(c.escape_unicode());
        } else {
            out.text.push(c);
        }
    }
    if to < chars.len() {
        // Left out after the window: at its end.
        out.map[byte_at(to)..start + body.len()].fill(out.text.len());
        out.text.push('…');
    }
    if line.len() > body.len() {
        out.map[start + body.len()] = out.text.len();
        out.text.push('\n');
    }
}

/// The characters `[from, to)` of a line to show: all of a short line; of a long one
/// [`WINDOW`] characters around the spans on it (from a little before their start when they are
/// longer), or its start when none is on it.
fn window(chars: &[(usize, char)], start: usize, spans: &[(usize, usize)]) -> (usize, usize) {
    let len = chars.len();
    if len <= MAX_LINE {
        return (0, len);
    }
    let end = start + chars.last().map_or(0, |&(b, c)| b + c.len_utf8());
    let index = |byte: usize| chars.partition_point(|&(b, _)| start + b < byte);
    let on_line: Vec<(usize, usize)> = spans
        .iter()
        .filter(|&&(s, e)| s < end && e.max(s + 1) > start)
        .map(|&(s, e)| (index(s.max(start)), index(e.min(end))))
        .collect();
    let lo = on_line.iter().map(|s| s.0).min();
    let hi = on_line.iter().map(|s| s.1).max();
    let from = match (lo, hi) {
        (Some(lo), Some(hi)) if hi - lo <= WINDOW => lo.saturating_sub((WINDOW - (hi - lo)) / 2),
        (Some(lo), _) => lo.saturating_sub(WINDOW / 6),
        _ => 0,
    };
    // Cutting a few characters at the start saves nothing worth the `…`.
    let from = if from <= WINDOW / 6 { 0 } else { from };
    let from = from.min(len.saturating_sub(WINDOW));
    (from, (from + WINDOW).min(len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use miette::SourceCode;

    #[test]
    fn control_characters_are_escaped_and_labels_follow() {
        let text = "a = \"x\u{1b}[2Jy\"\r\nb = 1\n";
        let span = (text.find('y').unwrap(), text.find('y').unwrap() + 1);
        let shown = shown(text, &[span]);
        assert_eq!(shown.text, "a = \"x\\u{1b}[2Jy\"\r\nb = 1\n");
        let at = shown.offset(span.0);
        assert_eq!(&shown.text[at..shown.offset(span.1)], "y");
        assert_eq!(escape_controls("name\u{7}\n"), "name\\u{7}\n");
    }

    #[test]
    fn a_long_line_is_cut_around_its_label() {
        let long = format!(
            "x = {}1{}\nnext\n",
            "(".repeat(100_000),
            ")".repeat(100_000)
        );
        let one = long.find('1').unwrap();
        let shown = shown(&long, &[(one, one + 1)]);
        let first = shown.text.lines().next().unwrap();
        assert_eq!(first.chars().count(), WINDOW + 2, "{first}");
        assert!(first.starts_with('…') && first.ends_with('…'));
        assert_eq!(
            &shown.text[shown.offset(one)..shown.offset(one + 1)],
            "1",
            "the label still points at its character"
        );
        assert!(shown.text.ends_with("…\nnext\n"));
        assert_eq!(shown.offset(long.len()), shown.text.len());
        // The location names the file's own column.
        let source = ShownSource::new("f".into(), &long, &[(one, one + 1)]);
        let at = source.offset(one);
        let contents = source.read_span(&(at, 1).into(), 0, 0).unwrap();
        assert_eq!((contents.line(), contents.column()), (0, one));
        // A line without a label shows its start.
        let unlabelled = super::shown(&"y".repeat(500), &[]);
        assert_eq!(unlabelled.text, format!("{}…", "y".repeat(WINDOW)));
    }
}
