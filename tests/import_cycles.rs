//! No import cycles among the modules of parc's crates ([`CRATES`]): every module can be read,
//! moved or split knowing only what it imports.
//!
//! The graph has one node per module file (`a/b.rs` or `a/b/mod.rs` is module `a::b`, `lib.rs`
//! or `main.rs` the crate root), found by following `mod NAME;` declarations from the root.
//! There is an edge A → B when A's code names a path that resolves to module B: `use crate::…`
//! and `crate::…` in expressions and types, `super::…`, `self::…`, and paths that start with a
//! declared submodule (`use child::…`, `child::f()`); `use` groups (`use crate::{a, b::{c, d}}`)
//! are expanded. A path resolves to its longest prefix that is a module file.
//!
//! The rule: a reference from a module to one of its ancestors (`super::Thing` defined in the
//! parent's mod.rs, `crate::Thing` from lib.rs or main.rs) is not an edge: a parent module is
//! the namespace its children live in. Every other reference is an edge, a parent's to its own
//! child included. A cycle is a strongly connected component of more than one module (Tarjan);
//! the test lists each with its files and, per edge, the line that makes it, so a failure says
//! what to move.
//!
//! Not read: comments and string literals; module files declared under `#[cfg(test)]` and
//! inline test modules (`mod tests { … }`, or any inline module under `#[cfg(test)]`), since
//! tests may reach anywhere. Other inline modules (`mod cuda { … }` inside a file) belong to
//! their file's node, and their `super::` counts from the inline module. Paths made by macros
//! and `#[path]` attributes are not followed (parc has neither).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::path::Path;

/// The crates checked, as their source folders relative to the workspace root.
const CRATES: [&str; 3] = ["compiler/src", "runtime/src", "src"];

type ModPath = Vec<String>;

#[test]
fn no_crate_has_an_import_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut report = String::new();
    for dir in CRATES {
        let src = root.join(dir);
        let read = |file: &str| std::fs::read_to_string(src.join(file)).ok();
        let graph = Graph::load(&read).unwrap_or_else(|e| panic!("{dir}: {e}"));
        for (i, cycle) in graph.cycles().iter().enumerate() {
            report.push_str(&format!(
                "{dir}, cycle {}:\n{}\n",
                i + 1,
                graph.describe(cycle)
            ));
        }
    }
    assert!(
        report.is_empty(),
        "import cycles (break each by moving what both sides need into a module that imports \
         neither):\n\n{report}"
    );
}

/// One module file: its module path, its file (relative to the crate's source folder), its
/// code (comments, literals and test modules blanked, line breaks kept; ASCII only, so byte
/// offsets are character offsets) and its original text.
struct ModuleFile {
    path: ModPath,
    file: String,
    code: String,
    text: String,
}

/// Why A → B: the first line of A that names B.
struct Evidence {
    line: usize,
    text: String,
}

struct Graph {
    modules: Vec<ModuleFile>,
    edges: BTreeMap<(usize, usize), Evidence>,
}

impl Graph {
    /// Read a crate through `read` (a file relative to the source folder; `None` when absent),
    /// starting at `lib.rs` or `main.rs`.
    fn load(read: &dyn Fn(&str) -> Option<String>) -> Result<Graph, String> {
        let modules = load_modules(read)?;
        let index: BTreeMap<ModPath, usize> = modules
            .iter()
            .enumerate()
            .map(|(i, m)| (m.path.clone(), i))
            .collect();
        let mut edges = BTreeMap::new();
        for (from, module) in modules.iter().enumerate() {
            for (target, evidence) in references(module, &index) {
                let to_path = &modules[target].path;
                if !module.path.starts_with(to_path) {
                    edges.entry((from, target)).or_insert(evidence);
                }
            }
        }
        Ok(Graph { modules, edges })
    }

    /// Every strongly connected component of more than one module, each sorted, in file order.
    fn cycles(&self) -> Vec<Vec<usize>> {
        let mut next = vec![Vec::new(); self.modules.len()];
        for &(from, to) in self.edges.keys() {
            next[from].push(to);
        }
        let mut cycles: Vec<Vec<usize>> = tarjan(&next)
            .into_iter()
            .filter(|c| c.len() > 1)
            .map(|mut c| {
                c.sort_by(|a, b| self.modules[*a].file.cmp(&self.modules[*b].file));
                c
            })
            .collect();
        cycles.sort_by(|a, b| self.modules[a[0]].file.cmp(&self.modules[b[0]].file));
        cycles
    }

    /// A cycle's files, then each edge inside it with the line that makes it.
    fn describe(&self, cycle: &[usize]) -> String {
        let members: BTreeSet<usize> = cycle.iter().copied().collect();
        let files: Vec<&str> = cycle
            .iter()
            .map(|m| self.modules[*m].file.as_str())
            .collect();
        let mut out = format!("  files: {}\n", files.join(", "));
        for ((from, to), evidence) in &self.edges {
            if members.contains(from) && members.contains(to) {
                let (from, to) = (&self.modules[*from].file, &self.modules[*to].file);
                out.push_str(&format!(
                    "  {from} -> {to}   ({from}:{}: {})\n",
                    evidence.line, evidence.text
                ));
            }
        }
        out
    }

    /// The edges as `from -> to` file pairs (for the checker's own tests).
    fn edge_files(&self) -> Vec<(String, String)> {
        self.edges
            .keys()
            .map(|(f, t)| (self.modules[*f].file.clone(), self.modules[*t].file.clone()))
            .collect()
    }
}

/// Every module file reachable from the crate root through `mod NAME;` declarations not under
/// `#[cfg(test)]`.
fn load_modules(read: &dyn Fn(&str) -> Option<String>) -> Result<Vec<ModuleFile>, String> {
    let root = ["lib.rs", "main.rs"]
        .into_iter()
        .find(|f| read(f).is_some())
        .ok_or("neither lib.rs nor main.rs")?;
    let mut pending = vec![(ModPath::new(), root.to_string())];
    let mut modules = Vec::new();
    while let Some((path, file)) = pending.pop() {
        let text = read(&file).ok_or_else(|| format!("cannot read {file}"))?;
        let code = blank_test_modules(&code_only(&text));
        for (name, inline_path) in declarations(&code) {
            let dir = format!("{}{}", child_folder(&file), inline_path.join("/"));
            let dir = dir.trim_end_matches('/');
            let candidates = [format!("{dir}/{name}.rs"), format!("{dir}/{name}/mod.rs")];
            let found = candidates
                .into_iter()
                .map(|c| c.trim_start_matches('/').to_string())
                .find(|c| read(c).is_some())
                .ok_or_else(|| format!("{file}: `mod {name};` has no file"))?;
            let mut child = path.clone();
            child.extend(inline_path);
            child.push(name);
            pending.push((child, found));
        }
        modules.push(ModuleFile {
            path,
            file,
            code,
            text,
        });
    }
    modules.sort_by(|a, b| a.file.cmp(&b.file));
    Ok(modules)
}

/// The folder a file's submodules live in, with a trailing `/` (empty for the crate root).
fn child_folder(file: &str) -> String {
    let (dir, name) = file.rsplit_once('/').unwrap_or(("", file));
    let dir = if dir.is_empty() {
        String::new()
    } else {
        format!("{dir}/")
    };
    match name {
        "lib.rs" | "main.rs" | "mod.rs" => dir,
        other => format!("{dir}{}/", other.trim_end_matches(".rs")),
    }
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// `text` with comments, string and character literals and non-ASCII characters replaced by
/// spaces; line breaks are kept so line numbers stay.
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(chars.len());
    let mut i = 0;
    while i < chars.len() {
        let end = literal_or_comment_end(&chars, i);
        if end > i {
            out.extend(
                chars[i..end]
                    .iter()
                    .map(|&c| if c == '\n' { '\n' } else { ' ' }),
            );
            i = end;
        } else {
            out.push(if chars[i].is_ascii() { chars[i] } else { ' ' });
            i += 1;
        }
    }
    out
}

/// Where the comment or literal starting at `i` ends (`i` itself when none starts there).
fn literal_or_comment_end(chars: &[char], i: usize) -> usize {
    let at = |k: usize| chars.get(k).copied().unwrap_or('\0');
    let ident_before = i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
    match (at(i), at(i + 1)) {
        ('/', '/') => (i..chars.len())
            .find(|&k| chars[k] == '\n')
            .unwrap_or(chars.len()),
        ('/', '*') => block_comment_end(chars, i),
        ('"', _) => quoted_end(chars, i + 1, '"'),
        ('\'', '\\') => quoted_end(chars, i + 1, '\''),
        ('\'', _) if at(i + 2) == '\'' => i + 3,
        ('r', '#' | '"') if !ident_before => raw_string_end(chars, i + 1).unwrap_or(i),
        ('b', 'r') if !ident_before => raw_string_end(chars, i + 2).unwrap_or(i),
        _ => i,
    }
}

/// The end of a nested `/* … */` comment starting at `i`.
fn block_comment_end(chars: &[char], mut i: usize) -> usize {
    let mut depth = 0;
    while i + 1 < chars.len() {
        match (chars[i], chars[i + 1]) {
            ('/', '*') => depth += 1,
            ('*', '/') => {
                depth -= 1;
                if depth == 0 {
                    return i + 2;
                }
            }
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    chars.len()
}

/// The end of a literal whose body starts at `i` and ends at an unescaped `close`.
fn quoted_end(chars: &[char], mut i: usize, close: char) -> usize {
    while i < chars.len() {
        match chars[i] {
            '\\' => i += 2,
            c if c == close => return i + 1,
            _ => i += 1,
        }
    }
    chars.len()
}

/// The end of a raw string whose hashes start at `i` (`#"…"#`), if one starts there.
fn raw_string_end(chars: &[char], i: usize) -> Option<usize> {
    let hashes = chars[i..].iter().take_while(|&&c| c == '#').count();
    if chars.get(i + hashes) != Some(&'"') {
        return None;
    }
    let close: Vec<char> = std::iter::once('"')
        .chain(std::iter::repeat_n('#', hashes))
        .collect();
    let body = i + hashes + 1;
    let end = (body..chars.len()).find(|&k| chars[k..].starts_with(&close));
    Some(end.map_or(chars.len(), |k| k + close.len()))
}

/// An inline module (`mod NAME { … }`): its name, whether attributes before it make it
/// test-only, and its text from `mod` to the closing brace.
struct InlineModule {
    name: String,
    test_only: bool,
    span: Range<usize>,
}

/// A `mod NAME` item at `at`: its name, whether it is test-only, and whether a body (`{`) or a
/// file (`;`) follows.
fn mod_item(code: &str, at: usize) -> Option<(String, bool, u8, usize)> {
    let bytes = code.as_bytes();
    let keyword = code[at..].starts_with("mod")
        && (at == 0 || !is_ident(bytes[at - 1]))
        && bytes.get(at + 3).is_some_and(u8::is_ascii_whitespace);
    if !keyword {
        return None;
    }
    let rest = &code[at + 3..];
    let name_start = at + 3 + (rest.len() - rest.trim_start().len());
    let name_end = name_start
        + code[name_start..]
            .bytes()
            .take_while(|&c| is_ident(c))
            .count();
    let after = code[name_end..].trim_start();
    let follows = *after.as_bytes().first()?;
    let item_start = code[..at].rfind([';', '{', '}']).map_or(0, |k| k + 1);
    let attributes = &code[item_start..at];
    let name = code[name_start..name_end].to_string();
    let test_only = attributes.contains("cfg(test)") || attributes.contains("cfg(all(test");
    let follows_at = code.len() - after.len();
    Some((name, test_only, follows, follows_at))
}

/// Every inline module of `code`, outermost first.
fn inline_modules(code: &str) -> Vec<InlineModule> {
    (0..code.len())
        .filter_map(|at| {
            let (name, test_only, follows, open) = mod_item(code, at)?;
            (follows == b'{').then(|| InlineModule {
                test_only: test_only || name == "tests",
                name,
                span: at..matching_brace(code, open),
            })
        })
        .collect()
}

/// The offset just past the brace that closes the one at `open`.
fn matching_brace(code: &str, open: usize) -> usize {
    let mut depth = 0usize;
    for (k, c) in code.bytes().enumerate().skip(open) {
        match c {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return k + 1;
                }
            }
            _ => {}
        }
    }
    code.len()
}

/// `code` with every inline test module blanked.
fn blank_test_modules(code: &str) -> String {
    let mut out = code.to_string();
    for module in inline_modules(code).into_iter().filter(|m| m.test_only) {
        blank(&mut out, module.span);
    }
    out
}

/// Replace `range` of `code` with spaces, keeping line breaks.
fn blank(code: &mut String, range: Range<usize>) {
    let blanked: String = code[range.clone()]
        .chars()
        .map(|c| if c == '\n' { '\n' } else { ' ' })
        .collect();
    code.replace_range(range, &blanked);
}

/// The names of the inline modules enclosing `at`, outermost first.
fn inline_path(inline: &[InlineModule], at: usize) -> Vec<String> {
    inline
        .iter()
        .filter(|m| m.span.contains(&at))
        .map(|m| m.name.clone())
        .collect()
}

/// Every `mod NAME;` of `code` (test modules already blanked) with the inline modules it is
/// declared in.
fn declarations(code: &str) -> Vec<(String, Vec<String>)> {
    let inline = inline_modules(code);
    (0..code.len())
        .filter_map(|at| {
            let (name, test_only, follows, _) = mod_item(code, at)?;
            (follows == b';' && !test_only).then(|| (name, inline_path(&inline, at)))
        })
        .collect()
}

/// Every module `module` names, with where: first its `use` statements, then the paths in the
/// rest of its code.
fn references(module: &ModuleFile, index: &BTreeMap<ModPath, usize>) -> Vec<(usize, Evidence)> {
    let mut code = module.code.clone();
    let inline = inline_modules(&code);
    let scope_at = |at: usize| {
        let mut scope = module.path.clone();
        scope.extend(inline_path(&inline, at));
        scope
    };
    let line_at = |at: usize| module.code[..at].matches('\n').count() + 1;
    let mut found = Vec::new();
    for statement in use_statements(&module.code) {
        let text = module.code[statement.clone()]
            .split_whitespace()
            .collect::<Vec<_>>();
        let body = &module.code[statement.start + 3..statement.end - 1];
        for path in use_paths(body) {
            if let Some(target) = resolve(&scope_at(statement.start), &path, index) {
                let (line, text) = (line_at(statement.start), text.join(" "));
                found.push((target, Evidence { line, text }));
            }
        }
        blank(&mut code, statement);
    }
    for (at, path) in expression_paths(&code) {
        if let Some(target) = resolve(&scope_at(at), &path, index) {
            let line = line_at(at);
            let text = module
                .text
                .lines()
                .nth(line - 1)
                .unwrap_or("")
                .trim()
                .to_string();
            found.push((target, Evidence { line, text }));
        }
    }
    found
}

/// Each `use …;` statement of `code`, from `use` to the `;`.
fn use_statements(code: &str) -> Vec<Range<usize>> {
    let bytes = code.as_bytes();
    let mut statements = Vec::new();
    let mut at = 0;
    while let Some(k) = code[at..].find("use") {
        let start = at + k;
        at = start + 3;
        let keyword = (start == 0 || !is_ident(bytes[start - 1]))
            && bytes.get(start + 3).is_some_and(u8::is_ascii_whitespace);
        if let (true, Some(end)) = (keyword, code[start..].find(';')) {
            statements.push(start..start + end + 1);
            at = start + end + 1;
        }
    }
    statements
}

/// The paths a `use` tree names (`crate::{a, b::{c, d as e}}` names `crate::a`, `crate::b::c`
/// and `crate::b::d`); a leading `::` is kept as a segment, `as` renames are dropped.
fn use_paths(tree: &str) -> Vec<ModPath> {
    let tokens = use_tokens(tree);
    let mut paths = Vec::new();
    let mut pos = 0;
    use_tree(&tokens, &mut pos, &mut Vec::new(), &mut paths);
    paths
}

fn use_tokens(tree: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut rest = tree.trim_start();
    while let Some(c) = rest.chars().next() {
        let len = match c {
            ':' => 2,
            c if is_ident(c as u8) => rest.bytes().take_while(|&b| is_ident(b)).count(),
            _ => 1,
        };
        tokens.push(rest[..len].to_string());
        rest = rest[len..].trim_start();
    }
    tokens
}

/// Read one use tree at `pos` under `prefix`, pushing each complete path to `paths`.
fn use_tree(tokens: &[String], pos: &mut usize, prefix: &mut ModPath, paths: &mut Vec<ModPath>) {
    let depth = prefix.len();
    while let Some(token) = tokens.get(*pos) {
        *pos += 1;
        match token.as_str() {
            "::" if prefix.is_empty() => prefix.push("::".to_string()),
            "::" => {}
            "as" => *pos += 1,
            "*" => break,
            "{" => {
                use_group(tokens, pos, prefix, paths);
                prefix.truncate(depth);
                return;
            }
            "," | "}" => {
                *pos -= 1;
                break;
            }
            segment => prefix.push(segment.to_string()),
        }
    }
    if prefix.len() > depth {
        paths.push(prefix.clone());
    }
    prefix.truncate(depth);
}

/// Read the trees of a `{ … }` group whose `{` is just before `pos`, through its `}`.
fn use_group(tokens: &[String], pos: &mut usize, prefix: &mut ModPath, paths: &mut Vec<ModPath>) {
    while let Some(token) = tokens.get(*pos) {
        match token.as_str() {
            "}" => {
                *pos += 1;
                return;
            }
            "," => *pos += 1,
            _ => use_tree(tokens, pos, prefix, paths),
        }
    }
}

/// Each path of two or more segments in `code` that starts at an identifier (`a::b::c`, not
/// the `b::c` inside it, nor `$crate::…`), with its offset.
fn expression_paths(code: &str) -> Vec<(usize, ModPath)> {
    let bytes = code.as_bytes();
    let mut paths = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let starts = is_ident(bytes[at])
            && !bytes[at].is_ascii_digit()
            && (at == 0 || (!matches!(bytes[at - 1], b':' | b'$') && !is_ident(bytes[at - 1])));
        if !starts {
            at += 1;
            continue;
        }
        let (path, end) = path_at(code, at);
        if path.len() > 1 {
            paths.push((at, path));
        }
        at = end;
    }
    paths
}

/// The `a::b::c` path starting at `at` and where it ends.
fn path_at(code: &str, mut at: usize) -> (ModPath, usize) {
    let bytes = code.as_bytes();
    let mut path = Vec::new();
    loop {
        let len = bytes[at..].iter().take_while(|&&c| is_ident(c)).count();
        path.push(code[at..at + len].to_string());
        at += len;
        let next_is_ident = bytes.get(at + 2).is_some_and(|&c| is_ident(c));
        if !(code[at..].starts_with("::") && next_is_ident) {
            return (path, at);
        }
        at += 2;
    }
}

/// The module file `path`, named in module `scope`, resolves to: its longest prefix that is a
/// module file. `None` for a path into another crate (or anything not a module of this one).
fn resolve(scope: &[String], path: &[String], index: &BTreeMap<ModPath, usize>) -> Option<usize> {
    let (first, rest) = path.split_first()?;
    let mut full: ModPath = match first.as_str() {
        "crate" => Vec::new(),
        "self" => scope.to_vec(),
        "super" => scope[..scope.len().checked_sub(1)?].to_vec(),
        _ => {
            let mut child = scope.to_vec();
            child.push(first.clone());
            if !index.contains_key(&child) {
                return None;
            }
            child
        }
    };
    for segment in rest {
        match segment.as_str() {
            "super" => {
                full.pop()?;
            }
            "self" => {}
            other => full.push(other.to_string()),
        }
    }
    (0..=full.len())
        .rev()
        .find_map(|k| index.get(&full[..k]).copied())
}

/// The strongly connected components of the graph `next` (Tarjan's algorithm).
fn tarjan(next: &[Vec<usize>]) -> Vec<Vec<usize>> {
    struct State<'a> {
        next: &'a [Vec<usize>],
        order: Vec<Option<usize>>,
        low: Vec<usize>,
        stack: Vec<usize>,
        on_stack: Vec<bool>,
        counter: usize,
        components: Vec<Vec<usize>>,
    }
    fn visit(s: &mut State, v: usize) {
        s.order[v] = Some(s.counter);
        s.low[v] = s.counter;
        s.counter += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        for &w in &s.next[v] {
            match s.order[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(order) if s.on_stack[w] => s.low[v] = s.low[v].min(order),
                Some(_) => {}
            }
        }
        if Some(s.low[v]) == s.order[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack[w] = false;
                component.push(w);
                if w == v {
                    break;
                }
            }
            s.components.push(component);
        }
    }
    let n = next.len();
    let mut state = State {
        next,
        order: vec![None; n],
        low: vec![0; n],
        stack: Vec::new(),
        on_stack: vec![false; n],
        counter: 0,
        components: Vec::new(),
    };
    for v in 0..n {
        if state.order[v].is_none() {
            visit(&mut state, v);
        }
    }
    state.components
}

/// The checker on crates held in memory.
mod checker {
    use super::*;

    fn graph(files: &[(&str, &str)]) -> Graph {
        let files: BTreeMap<String, String> = files
            .iter()
            .map(|(name, text)| (name.to_string(), text.to_string()))
            .collect();
        Graph::load(&|file| files.get(file).cloned()).unwrap()
    }

    fn strings(path: &[&str]) -> ModPath {
        path.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_cycle_through_three_modules_is_found_with_its_lines() {
        let graph = graph(&[
            ("lib.rs", "mod a;\nmod b;\nmod c;\n"),
            ("a.rs", "use crate::b::B;\npub struct A;\n"),
            (
                "b.rs",
                "pub struct B;\nuse crate::{\n    c::{C},\n    a as alias,\n};\n",
            ),
            (
                "c.rs",
                "pub struct C;\nfn f() {\n    let _ = super::a::A;\n}\n",
            ),
        ]);
        let cycles = graph.cycles();
        assert_eq!(cycles.len(), 1);
        let description = graph.describe(&cycles[0]);
        assert!(
            description.contains("files: a.rs, b.rs, c.rs"),
            "{description}"
        );
        assert!(description.contains("a.rs -> b.rs   (a.rs:1: use crate::b::B;)"));
        assert!(
            description.contains("b.rs -> c.rs   (b.rs:2: use crate::{ c::{C}, a as alias, };)")
        );
        assert!(description.contains("c.rs -> a.rs   (c.rs:3: let _ = super::a::A;)"));
    }

    #[test]
    fn ancestors_comments_strings_and_tests_make_no_edge() {
        let graph = graph(&[
            ("lib.rs", "mod p;\npub struct Root;\nfn f() { p::q::g() }\n"),
            (
                "p/mod.rs",
                "mod q;\n#[cfg(test)]\nmod tests;\npub struct T;\nuse q::U;\nfn r() -> crate::Root {}\n",
            ),
            (
                "p/q.rs",
                "use super::T; use crate::Root;\n// use crate::p::T;\n\
                 const S: &str = \"crate::p::x\";\npub struct U;\n\
                 #[cfg(test)]\nmod tests {\n    use crate::p::q::U;\n}\n",
            ),
            ("p/tests.rs", "use crate::p::q::U;\n"),
        ]);
        let edges = graph.edge_files();
        let expected = [("lib.rs", "p/q.rs"), ("p/mod.rs", "p/q.rs")];
        let expected: Vec<(String, String)> = expected
            .iter()
            .map(|(f, t)| (f.to_string(), t.to_string()))
            .collect();
        assert_eq!(edges, expected);
        assert!(graph.cycles().is_empty());
    }

    #[test]
    fn inline_modules_count_super_from_themselves() {
        let graph = graph(&[
            ("main.rs", "mod a;\nmod b;\n"),
            (
                "a.rs",
                "pub struct A;\nmod inner {\n    use super::A;\n    use super::super::b::B;\n}\n",
            ),
            ("b.rs", "pub struct B;\n"),
        ]);
        assert_eq!(
            graph.edge_files(),
            vec![("a.rs".to_string(), "b.rs".to_string())]
        );
    }

    #[test]
    fn use_groups_expand_to_every_path() {
        let paths = use_paths("crate::{a, b::{c, d as e}, self}");
        let expected = [
            strings(&["crate", "a"]),
            strings(&["crate", "b", "c"]),
            strings(&["crate", "b", "d"]),
            strings(&["crate", "self"]),
        ];
        assert_eq!(paths, expected);
        assert_eq!(
            use_paths("::std::io::Write"),
            [strings(&["::", "std", "io", "Write"])]
        );
        assert_eq!(use_paths("super::*"), [strings(&["super"])]);
    }
}
