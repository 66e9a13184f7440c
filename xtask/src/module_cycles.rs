//! No module cycle inside any crate (`cargo xtask shape`, run by `cargo xtask lint`).
//!
//! For each crate root of each workspace member (`src/lib.rs`, `src/main.rs`, `src/bin/*.rs`)
//! the check follows the `mod` declarations, reads every module's `crate::…` and `super::…`
//! paths outside `#[cfg(test)]` items, and draws an edge from the top-level module a path is
//! written in to the top-level module it names (`crate::a::b::f` is an edge to `a`; a name the
//! root re-exports, `pub use a::X`, counts as `a`). A strongly connected set of two or more
//! top-level modules is a cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::rust_tokens::{tokenize, Token};

/// Top-level module → the top-level modules it uses.
pub type Graph = BTreeMap<String, BTreeSet<String>>;

/// One parsed module file: its module path from the crate root, and its tokens.
struct ModuleFile {
    path: Vec<String>,
    tokens: Vec<Token>,
}

/// The crate roots of a workspace member.
pub fn crate_roots(member: &Path) -> Vec<PathBuf> {
    let src = member.join("src");
    let mut roots: Vec<PathBuf> = ["lib.rs", "main.rs"].iter().map(|f| src.join(f)).filter(|p| p.is_file()).collect();
    if let Ok(bins) = std::fs::read_dir(src.join("bin")) {
        let mut bins: Vec<PathBuf> =
            bins.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|e| e == "rs")).collect();
        bins.sort();
        roots.extend(bins);
    }
    roots
}

/// The module graph of the crate whose root file is `root`.
pub fn module_graph(root: &Path) -> Result<Graph> {
    let root_tokens = tokenize(&read(root)?);
    let root_dir = root.parent().context("a crate root has a folder")?.to_path_buf();
    let tops: BTreeSet<String> = declared_modules(&root_tokens)?.into_iter().map(|(name, _)| name).collect();
    let reexports = root_reexports(&root_tokens, &tops);
    let mut files = Vec::new();
    collect_files(&root_tokens, &root_dir, &[], &mut files)?;
    // The root's own inline modules (`mod x { … }` in lib.rs) are top-level modules too.
    files.push(ModuleFile { path: Vec::new(), tokens: root_tokens });
    let mut graph: Graph = tops.iter().map(|t| (t.clone(), BTreeSet::new())).collect();
    for f in &files {
        for (from, to) in references(f, &tops, &reexports) {
            if from != to {
                graph.entry(from).or_default().insert(to);
            }
        }
    }
    Ok(graph)
}

fn read(p: &Path) -> Result<String> {
    std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
}

/// Every module file under `dir` declared by `tokens` (a file at module path `path`), its
/// own declarations followed recursively.
fn collect_files(tokens: &[Token], dir: &Path, path: &[String], out: &mut Vec<ModuleFile>) -> Result<()> {
    for (name, kind) in declared_modules(tokens)? {
        if kind == Declared::Inline {
            continue; // its items are read with the file that holds it
        }
        let (file, child_dir) = module_file(dir, &name)?;
        let child_tokens = tokenize(&read(&file)?);
        let child_path: Vec<String> = path.iter().cloned().chain([name]).collect();
        collect_files(&child_tokens, &child_dir, &child_path, out)?;
        out.push(ModuleFile { path: child_path, tokens: child_tokens });
    }
    Ok(())
}

/// `dir/name.rs` (its modules in `dir/name/`) or `dir/name/mod.rs`.
fn module_file(dir: &Path, name: &str) -> Result<(PathBuf, PathBuf)> {
    let flat = dir.join(format!("{name}.rs"));
    let nested = dir.join(name).join("mod.rs");
    match (flat.is_file(), nested.is_file()) {
        (true, _) => Ok((flat, dir.join(name))),
        (false, true) => Ok((nested, dir.join(name))),
        (false, false) => bail!("module `{name}`: neither {} nor {}", flat.display(), nested.display()),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Declared {
    /// `mod name;`: a file of its own.
    File,
    /// `mod name { … }`.
    Inline,
}

/// The modules a file declares at its top level (`mod name;` or `mod name { … }`) outside
/// `#[cfg(test)]` items. A `mod name;` inside an inline module is refused rather than
/// guessed at (none in the workspace).
fn declared_modules(tokens: &[Token]) -> Result<Vec<(String, Declared)>> {
    let mut out = Vec::new();
    let mut nested_file = None;
    walk(tokens, |i, inline| {
        if !tokens[i].is_ident("mod") {
            return;
        }
        let (Some(name), Some(Token::Punct(end))) = (tokens.get(i + 1).and_then(Token::ident), tokens.get(i + 2))
        else {
            return;
        };
        match (*end, inline.is_empty()) {
            (';', true) => out.push((name.to_owned(), Declared::File)),
            ('{', true) => out.push((name.to_owned(), Declared::Inline)),
            (';', false) => nested_file = Some(name.to_owned()),
            _ => {}
        }
    });
    if let Some(name) = nested_file {
        bail!("`mod {name};` inside an inline module: not supported by the module-cycle check");
    }
    Ok(out)
}

/// Names the root file brings in with `use a::…` (`pub use a::{X, Y as Z}`): each maps to `a`.
fn root_reexports(tokens: &[Token], tops: &BTreeSet<String>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    walk(tokens, |i, inline| {
        if !inline.is_empty() || !tokens[i].is_ident("use") {
            return;
        }
        let mut j = i + 1;
        while tokens.get(j).is_some_and(|t| t.is_ident("crate") || t.is_ident("self") || *t == Token::PathSep) {
            j += 1;
        }
        let Some(module) = tokens.get(j).and_then(Token::ident).filter(|m| tops.contains(*m)) else { return };
        let end = tokens[j..].iter().position(|t| *t == Token::Punct(';')).map_or(tokens.len(), |p| j + p);
        for k in j + 1..end {
            let leaf = matches!(tokens.get(k + 1), Some(Token::Punct(',' | '}' | ';')));
            if let (true, Some(name)) = (leaf, tokens[k].ident().filter(|n| *n != "self")) {
                out.insert(name.to_owned(), module.to_owned());
            }
        }
    });
    out
}

/// The (from, to) top-level modules of `f`'s paths: `crate::a…`, `crate::{a…, b…}`, and
/// `super::…` climbing to the crate root (a `super` that stays inside its top-level module
/// names that module). `from` is the top-level module the path is written in.
fn references(
    f: &ModuleFile,
    tops: &BTreeSet<String>,
    reexports: &BTreeMap<String, String>,
) -> BTreeSet<(String, String)> {
    let resolve = |name: &str| tops.get(name).cloned().or_else(|| reexports.get(name).cloned());
    let t = &f.tokens;
    let mut out = BTreeSet::new();
    walk(t, |i, inline| {
        let Some(from) = f.path.first().or(inline.first()) else { return }; // the root's own items
        let dollar = i > 0 && t[i - 1] == Token::Punct('$'); // `$crate` in a macro: the caller's path
        let after_sep = i > 0 && t[i - 1] == Token::PathSep; // `super::super`: read from the first
        if dollar || after_sep || t.get(i + 1) != Some(&Token::PathSep) {
            return;
        }
        let mut j = i + 2;
        if t[i].is_ident("super") {
            let mut ups = 1;
            while t.get(j).is_some_and(|x| x.is_ident("super")) && t.get(j + 1) == Some(&Token::PathSep) {
                ups += 1;
                j += 2;
            }
            if ups < f.path.len() + inline.len() {
                return; // still inside `from`
            }
        } else if !t[i].is_ident("crate") {
            return;
        }
        let names = if t.get(j) == Some(&Token::Punct('{')) { group_heads(&t[j + 1..]) } else { Vec::new() };
        let single = t.get(j).and_then(Token::ident).map(str::to_owned);
        for name in names.into_iter().chain(single) {
            if let Some(to) = resolve(&name) {
                out.insert((from.clone(), to));
            }
        }
    });
    out
}

/// The first identifier of each element of a `{a::x, b, c::{…}}` group (the tokens after `{`).
fn group_heads(tokens: &[Token]) -> Vec<String> {
    let mut out = Vec::new();
    let mut level = 0usize;
    let mut first = true;
    for tok in tokens {
        match tok {
            Token::Punct('}') if level == 0 => break,
            Token::Punct('{') => level += 1,
            Token::Punct('}') => level -= 1,
            Token::Punct(',') if level == 0 => {
                first = true;
                continue;
            }
            Token::Ident(name) if first && level == 0 => out.push(name.clone()),
            _ => {}
        }
        first = false;
    }
    out
}

/// Call `f(index, inline_modules)` for every token outside `#[cfg(test)]` items, with the names
/// of the inline modules (`mod x { … }`) the token is in.
fn walk(tokens: &[Token], mut f: impl FnMut(usize, &[String])) {
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < tokens.len() {
        if let Some(end) = test_only_item_end(tokens, i) {
            i = end;
            continue;
        }
        f(i, &inline.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>());
        match &tokens[i] {
            Token::Punct('{') => {
                depth += 1;
                if i >= 2 && tokens[i - 2].is_ident("mod") {
                    if let Some(name) = tokens[i - 1].ident() {
                        inline.push((name.to_owned(), depth));
                    }
                }
            }
            Token::Punct('}') => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
            }
            _ => {}
        }
        i += 1;
    }
}

/// If a `#[cfg(test)]` (or `#[cfg(all(test, …))]`) attribute starts at `i`, the index past the
/// item it applies to: further attributes, then up to the first `;` outside brackets, or to the
/// `}` that closes its body (and a `;` right after it, as in `use a::{b};`).
fn test_only_item_end(tokens: &[Token], i: usize) -> Option<usize> {
    let (attr_end, is_test) = attribute(tokens, i)?;
    if !is_test {
        return None;
    }
    let mut j = attr_end;
    while let Some((end, _)) = attribute(tokens, j) {
        j = end;
    }
    let mut depth = 0usize;
    while let Some(t) = tokens.get(j) {
        match t {
            Token::Punct('{' | '(' | '[') => depth += 1,
            Token::Punct('}') if depth == 1 => {
                let semicolon = tokens.get(j + 1) == Some(&Token::Punct(';'));
                return Some(j + 1 + usize::from(semicolon));
            }
            Token::Punct('}' | ')' | ']') => depth = depth.saturating_sub(1),
            Token::Punct(';') if depth == 0 => return Some(j + 1),
            _ => {}
        }
        j += 1;
    }
    Some(j)
}

/// If an outer attribute `#[…]` starts at `i`: the index past it, and whether it is a
/// test-only `cfg`.
fn attribute(tokens: &[Token], i: usize) -> Option<(usize, bool)> {
    if tokens.get(i) != Some(&Token::Punct('#')) || tokens.get(i + 1) != Some(&Token::Punct('[')) {
        return None;
    }
    let mut depth = 0usize;
    let mut j = i + 1;
    while let Some(t) = tokens.get(j) {
        match t {
            Token::Punct('[') => depth += 1,
            Token::Punct(']') => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            _ => {}
        }
        j += 1;
    }
    let inner = &tokens[(i + 2).min(j)..j];
    let ident = |k: usize| inner.get(k).and_then(Token::ident);
    let is_test = ident(0) == Some("cfg")
        && (ident(2) == Some("test") && inner.get(3) == Some(&Token::Punct(')'))
            || ident(2) == Some("all") && all_args_include_test(&inner[3..]));
    Some((j + 1, is_test))
}

/// Whether `test` is one of the arguments of `all(…)` (the tokens from its `(`).
fn all_args_include_test(tokens: &[Token]) -> bool {
    let mut depth = 0usize;
    for (k, t) in tokens.iter().enumerate() {
        match t {
            Token::Punct('(') => depth += 1,
            Token::Punct(')') => depth = depth.saturating_sub(1),
            Token::Ident(n) if n == "test" && depth == 1 => {
                let before = tokens.get(k.wrapping_sub(1));
                let after = tokens.get(k + 1);
                if matches!(before, Some(Token::Punct('(' | ','))) && matches!(after, Some(Token::Punct(')' | ','))) {
                    return true;
                }
            }
            _ => {}
        }
    }
    false
}

/// The strongly connected sets of two or more modules (Tarjan), each sorted, in name order.
pub fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    struct Tarjan<'g> {
        graph: &'g Graph,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        out: Vec<Vec<String>>,
    }
    impl<'g> Tarjan<'g> {
        fn visit(&mut self, v: &'g str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.graph.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    self.low.entry(v).and_modify(|l| *l = (*l).min(lw));
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    self.low.entry(v).and_modify(|l| *l = (*l).min(iw));
                }
            }
            if self.low[v] == self.index[v] {
                let mut set = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    set.push(w.to_owned());
                    if w == v {
                        break;
                    }
                }
                if set.len() > 1 {
                    set.sort();
                    self.out.push(set);
                }
            }
        }
    }
    let mut t = Tarjan {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.out.sort();
    t.out
}

/// One shortest cycle through the first module of `set`, for a readable report: `a → b → a`.
pub fn example_cycle(graph: &Graph, set: &[String]) -> String {
    let Some(start) = set.first() else { return String::new() };
    let mut prev: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start.as_str()]);
    while let Some(v) = queue.pop_front() {
        for w in graph.get(v).into_iter().flatten().filter(|w| set.contains(w)) {
            if w == start {
                let mut path = vec![start.as_str()];
                let mut at = v;
                while at != start {
                    path.push(at);
                    at = prev[at];
                }
                path.push(start);
                let last = path.len() - 1;
                path[1..last].reverse();
                return path.join(" → ");
            }
            if !prev.contains_key(w.as_str()) {
                prev.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    set.join(" ↔ ")
}

/// The workspace's members, from the root `Cargo.toml`'s `members = [...]`.
pub fn workspace_members(root: &Path) -> Result<Vec<PathBuf>> {
    let manifest = read(&root.join("Cargo.toml"))?;
    let start = manifest.find("members").context("no `members` in the workspace's Cargo.toml")?;
    let list = &manifest[start..];
    let (open, close) = (list.find('[').context("members = [")?, list.find(']').context("members = [...]")?);
    let members: Vec<PathBuf> = list[open + 1..close]
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty())
        .map(|m| root.join(m))
        .collect();
    if members.is_empty() {
        bail!("no workspace members found");
    }
    Ok(members)
}

/// Check every crate root of the workspace; fail naming every cycle.
pub fn check(root: &Path) -> Result<()> {
    let mut refused = Vec::new();
    let mut checked = 0;
    for member in workspace_members(root)? {
        for crate_root in crate_roots(&member) {
            let name = crate_root.strip_prefix(root).unwrap_or(&crate_root).display().to_string();
            let graph = module_graph(&crate_root).with_context(|| format!("reading the modules of {name}"))?;
            checked += 1;
            for set in cycles(&graph) {
                let edges: Vec<String> = set
                    .iter()
                    .flat_map(|from| {
                        graph[from].iter().filter(|to| set.contains(to)).map(move |to| format!("{from}→{to}"))
                    })
                    .collect();
                refused.push(format!("{name}: {} (edges {})", example_cycle(&graph, &set), edges.join(", ")));
            }
        }
    }
    if !refused.is_empty() {
        bail!("module cycles:\n  {}", refused.join("\n  "));
    }
    eprintln!("xtask shape: no module cycle in {checked} crate roots");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        // The checkout found at run time, not the one this binary was compiled in (a shared
        // target directory reuses a test binary built from another clone).
        crate::root().join("xtask/fixtures/module-cycles").join(name).join("src/lib.rs")
    }

    #[test]
    fn a_cycle_through_a_reexport_and_super_super_is_found() {
        let graph = module_graph(&fixture("cycle")).unwrap();
        // a uses crate::Thing (re-exported from b); b::inner uses super::super::a.
        assert_eq!(graph["a"], BTreeSet::from(["b".to_owned()]));
        assert_eq!(graph["b"], BTreeSet::from(["a".to_owned()]));
        assert_eq!(cycles(&graph), vec![vec!["a".to_owned(), "b".to_owned()]]);
        assert_eq!(example_cycle(&graph, &cycles(&graph)[0]), "a → b → a");
    }

    #[test]
    fn test_code_comments_and_strings_make_no_edges() {
        let graph = module_graph(&fixture("acyclic")).unwrap();
        assert_eq!(graph["a"], BTreeSet::from(["b".to_owned(), "c".to_owned()]));
        assert_eq!(graph["b"], BTreeSet::from(["c".to_owned()]));
        assert_eq!(graph["c"], BTreeSet::new(), "{graph:?}");
        assert!(cycles(&graph).is_empty());
    }

    #[test]
    fn longer_cycles_are_reported_through_their_shortest_loop() {
        let g: Graph = [("a", &["b"][..]), ("b", &["c"]), ("c", &["a", "d"]), ("d", &[]), ("e", &["e"])]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.iter().map(|s| s.to_string()).collect()))
            .collect();
        let found = cycles(&g);
        assert_eq!(found, vec![vec!["a".to_owned(), "b".to_owned(), "c".to_owned()]]);
        assert_eq!(example_cycle(&g, &found[0]), "a → b → c → a");
    }

    #[test]
    fn test_only_attributes_are_told_apart() {
        for (src, test_only) in [
            ("#[cfg(test)] mod t;", true),
            ("#[cfg(all(test, feature = \"x\"))] mod t;", true),
            ("#[cfg(any(test, feature = \"x\"))] mod t;", false),
            ("#[cfg(not(test))] mod t;", false),
            ("#[cfg(feature = \"test\")] mod t;", false),
        ] {
            let declared = declared_modules(&tokenize(src)).unwrap();
            assert_eq!(declared.is_empty(), test_only, "{src}");
        }
    }
}
