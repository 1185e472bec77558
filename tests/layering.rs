//! The modules of `src/` import one another in one direction only:
//! leaves, then connections, the pure core, the runtime, the lease family
//! (whose primitives sit side by side), Redlock and the coordinator. Read from the `crate::` and `super::` paths in the sources,
//! grouped imports (`use crate::{a, b::{c, d}}`) included.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every module under `src/` (the binary excluded) and its source text.
fn modules() -> BTreeMap<String, String> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n != "bin") {
                    walk(&path, out);
                }
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    walk(&src, &mut files);
    files
        .into_iter()
        .filter_map(|path| {
            let rel = path.strip_prefix(&src).unwrap().with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if parts.last().is_some_and(|p| p == "mod") {
                parts.pop();
            }
            let name = parts.join("::");
            (name != "lib").then(|| (name, std::fs::read_to_string(&path).unwrap()))
        })
        .collect()
}

/// The module a `crate::a::b::c` path names: its longest prefix that is a module.
fn resolve<'a>(mods: &'a BTreeMap<String, String>, path: &str) -> Option<&'a str> {
    let parts: Vec<&str> = path.split("::").collect();
    (1..=parts.len())
        .rev()
        .map(|n| parts[..n].join("::"))
        .find_map(|cand| mods.get_key_value(&cand).map(|(k, _)| k.as_str()))
}

/// Source text with comments and the contents of string and character
/// literals blanked out (their length kept), so that neither a path in a doc
/// comment nor a brace in a format string is read as code.
fn code_only(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < c.len() {
        let rest = |n: usize| c.get(i + n).copied();
        if c[i] == '/' && rest(1) == Some('/') {
            while i < c.len() && c[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c[i] == '/' && rest(1) == Some('*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(if c[i] == '\n' { '\n' } else { ' ' });
                    i += 1;
                }
            }
        } else if c[i] == 'r'
            && (rest(1) == Some('"') || rest(1) == Some('#'))
            && (i == 0 || !is_ident(c[i - 1]))
        {
            // A raw string: r"…", r#"…"#.
            let mut j = i + 1;
            let mut hashes = 0;
            while c.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if c.get(j) != Some(&'"') {
                out.push(c[i]);
                i += 1;
                continue;
            }
            j += 1;
            while j < c.len() {
                if c[j] == '"' && (1..=hashes).all(|h| c.get(j + h) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            out.extend(std::iter::repeat_n(' ', j - i));
            i = j;
        } else if c[i] == '"' {
            let mut j = i + 1;
            while j < c.len() && c[j] != '"' {
                j += if c[j] == '\\' { 2 } else { 1 };
            }
            out.extend(std::iter::repeat_n(' ', (j + 1).min(c.len()) - i));
            i = j + 1;
        } else if c[i] == '\'' && rest(1) == Some('\\') {
            // An escaped character literal: '\n', '\u{7f}'.
            let mut j = i + 2;
            while j < c.len() && c[j] != '\'' {
                j += 1;
            }
            out.extend(std::iter::repeat_n(' ', (j + 1).min(c.len()) - i));
            i = j + 1;
        } else if c[i] == '\'' && rest(2) == Some('\'') {
            out.push_str("   ");
            i += 3;
        } else {
            // Code, or the quote of a lifetime.
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The paths a module's source imports or names, as `crate::`-relative paths:
/// `crate::a::b`, every leaf of a grouped import (`use crate::{a, b::{c,
/// d}}` names `a`, `b::c` and `b::d`), and `super::` paths resolved against
/// `module` and the inline modules (`mod tests { … }`) around them.
fn crate_paths(module: &str, text: &str) -> Vec<String> {
    let code: Vec<char> = code_only(text).chars().collect();
    let mut out = Vec::new();
    // The inline modules open at this point, with the brace depth inside each.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    let starts = |i: usize, word: &str| {
        word.chars()
            .enumerate()
            .all(|(k, w)| code.get(i + k) == Some(&w))
            && (i == 0 || !is_ident(code[i - 1]))
    };
    while i < code.len() {
        match code[i] {
            '{' => {
                depth += 1;
                i += 1;
                continue;
            }
            '}' => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
                continue;
            }
            _ => {}
        }
        if starts(i, "mod ") {
            let mut j = i + 4;
            while code.get(j).is_some_and(|c| c.is_whitespace()) {
                j += 1;
            }
            let name: String = code[j..].iter().take_while(|c| is_ident(**c)).collect();
            j += name.len();
            while code.get(j).is_some_and(|c| c.is_whitespace()) {
                j += 1;
            }
            if !name.is_empty() && code.get(j) == Some(&'{') {
                inline.push((name, depth + 1));
            }
            i = j;
            continue;
        }
        let base: Option<Vec<String>> = if starts(i, "crate::") {
            i += "crate::".len();
            Some(Vec::new())
        } else if starts(i, "super::") {
            let mut here: Vec<String> = module.split("::").map(str::to_owned).collect();
            here.extend(inline.iter().map(|(n, _)| n.clone()));
            while starts(i, "super::") {
                i += "super::".len();
                here.pop();
            }
            Some(here)
        } else {
            None
        };
        match base {
            Some(base) => {
                let (paths, next) = use_tree(&code, i);
                for p in paths {
                    let full: Vec<&str> = base
                        .iter()
                        .map(String::as_str)
                        .chain(p.iter().map(String::as_str))
                        .filter(|s| !s.is_empty() && *s != "self" && *s != "*")
                        .collect();
                    if !full.is_empty() {
                        out.push(full.join("::"));
                    }
                }
                i = next.max(i + 1);
            }
            None => i += 1,
        }
    }
    out
}

/// Reads a use tree (`a::b`, `a::{b, c::{d, e}}`, `a::*`, `a as x`) starting at
/// `i`; returns each leaf as its path segments and where the tree ends.
fn use_tree(code: &[char], mut i: usize) -> (Vec<Vec<String>>, usize) {
    let skip_ws = |i: &mut usize| {
        while code.get(*i).is_some_and(|c| c.is_whitespace()) {
            *i += 1;
        }
    };
    let mut prefix: Vec<String> = Vec::new();
    loop {
        skip_ws(&mut i);
        match code.get(i) {
            Some('{') => {
                i += 1;
                let mut leaves = Vec::new();
                loop {
                    skip_ws(&mut i);
                    match code.get(i) {
                        Some('}') => {
                            i += 1;
                            break;
                        }
                        Some(',') => i += 1,
                        None => break,
                        Some(_) => {
                            let (sub, next) = use_tree(code, i);
                            if next == i {
                                i += 1;
                                continue;
                            }
                            for s in sub {
                                leaves.push(prefix.iter().cloned().chain(s).collect());
                            }
                            i = next;
                        }
                    }
                }
                return (leaves, i);
            }
            Some('*') => {
                return (vec![prefix], i + 1);
            }
            Some(c) if is_ident(*c) => {
                let seg: String = code[i..].iter().take_while(|c| is_ident(**c)).collect();
                i += seg.len();
                prefix.push(seg);
                skip_ws(&mut i);
                if code.get(i) == Some(&':') && code.get(i + 1) == Some(&':') {
                    i += 2;
                    continue;
                }
                // `as x` renames the leaf; the path stays.
                let mut j = i;
                if code.get(j) == Some(&'a') && code.get(j + 1) == Some(&'s') {
                    j += 2;
                    if code.get(j).is_some_and(|c| c.is_whitespace()) {
                        skip_ws(&mut j);
                        let alias: String =
                            code[j..].iter().take_while(|c| is_ident(**c)).collect();
                        i = j + alias.len();
                    }
                }
                return (vec![prefix], i);
            }
            _ => return (vec![prefix], i),
        }
    }
}

fn edges(mods: &BTreeMap<String, String>) -> BTreeMap<&str, BTreeSet<&str>> {
    let mut edges: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (m, text) in mods {
        let set = edges.entry(m.as_str()).or_default();
        for path in crate_paths(m, text) {
            if let Some(t) = resolve(mods, &path)
                && t != m
                && !m.starts_with(&format!("{t}::"))
                && !t.starts_with(&format!("{m}::"))
            {
                set.insert(t);
            }
        }
    }
    edges
}

/// Strongly connected components with more than one module (Tarjan).
fn cycles<'a>(edges: &BTreeMap<&'a str, BTreeSet<&'a str>>) -> Vec<Vec<&'a str>> {
    struct Tarjan<'a, 'e> {
        edges: &'e BTreeMap<&'a str, BTreeSet<&'a str>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        next: usize,
        out: Vec<Vec<&'a str>>,
    }
    impl<'a> Tarjan<'a, '_> {
        fn visit(&mut self, v: &'a str) {
            self.index.insert(v, self.next);
            self.low.insert(v, self.next);
            self.next += 1;
            self.stack.push(v);
            self.on.insert(v);
            for &w in self.edges.get(v).into_iter().flatten() {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if self.on.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut comp = Vec::new();
                loop {
                    let w = self.stack.pop().unwrap();
                    self.on.remove(w);
                    comp.push(w);
                    if w == v {
                        break;
                    }
                }
                if comp.len() > 1 {
                    comp.sort();
                    self.out.push(comp);
                }
            }
        }
    }
    let mut t = Tarjan {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for &v in edges.keys() {
        if !t.index.contains_key(v) {
            t.visit(v);
        }
    }
    t.out
}

#[test]
fn no_module_imports_another_in_a_cycle() {
    let mods = modules();
    assert!(mods.len() > 20, "found only {:?}", mods.keys());
    let edges = edges(&mods);
    let found = cycles(&edges);
    assert!(
        found.is_empty(),
        "modules importing each other in a cycle: {found:?}"
    );
}

#[test]
fn the_lower_layers_import_nothing_above_them() {
    let mods = modules();
    let edges = edges(&mods);
    let layer = |m: &str| -> u8 {
        match m.split("::").next().unwrap() {
            "error" | "keys" | "token" | "scripts" | "cancel" | "clock" | "report"
            | "replication" | "guard" | "observe" | "identity" | "reply" => 1,
            "conn" => 2,
            "core" => 3,
            "runtime" => 4,
            "lease" => 5,
            // A Redlock group is made from coordinators, so the two share a floor.
            "redlock" | "coordinator" => 6,
            _ => 7,
        }
    };
    for (m, targets) in &edges {
        for t in targets {
            assert!(
                layer(t) <= layer(m),
                "{m} (layer {}) imports {t} (layer {})",
                layer(m),
                layer(t)
            );
        }
    }
    // The core is pure: no sockets, no threads, no clock reads.
    for (m, text) in &mods {
        if m.starts_with("core") {
            for banned in ["Instant::now", "std::thread", "redis::", "crate::conn"] {
                let code: String = text
                    .lines()
                    .filter(|l| !l.trim_start().starts_with("//"))
                    .collect::<Vec<_>>()
                    .join("\n");
                let body = code.split("#[cfg(test)]").next().unwrap();
                assert!(!body.contains(banned), "{m} uses {banned}");
            }
        }
    }
}

/// The primitives of the lease family, side by side: each imports the shared
/// lease pieces (deployment, kinds, handle, guard), never another primitive,
/// except where one is built on another (listed in [`BUILT_ON`]).
const PRIMITIVES: [&str; 7] = [
    "lease::lock",
    "lease::fenced",
    "lease::rwlease",
    "lease::semaphore",
    "lease::election",
    "lease::fairness",
    "lease::multi",
];

/// The one import each primitive built on a sibling may make: an election is
/// a fenced lease with a value; a FIFO-fair lock takes the plain lock's spec.
const BUILT_ON: [(&str, &str); 2] = [
    ("lease::election", "lease::fenced"),
    ("lease::fairness", "lease::lock"),
];

/// Every import of one primitive by another that [`BUILT_ON`] does not list.
fn sibling_imports<'a>(edges: &BTreeMap<&'a str, BTreeSet<&'a str>>) -> Vec<(&'a str, &'a str)> {
    let mut found = Vec::new();
    for (m, targets) in edges {
        if !PRIMITIVES.contains(m) {
            continue;
        }
        for t in targets {
            if PRIMITIVES.contains(t) && !BUILT_ON.contains(&(*m, *t)) {
                found.push((*m, *t));
            }
        }
    }
    found
}

/// The shared lease pieces every primitive may import: the deployment, the
/// kinds, the handle, the guard and the reply helpers of `lease/mod.rs`.
const SHARED: [&str; 5] = [
    "lease",
    "lease::acquire",
    "lease::deployment",
    "lease::guard",
    "lease::kind",
];

/// The modules of the lease family that are neither a listed primitive nor
/// a shared piece: a new primitive must be listed to be checked.
fn unlisted_lease_modules(mods: &BTreeMap<String, String>) -> Vec<&str> {
    mods.keys()
        .map(String::as_str)
        .filter(|m| *m == "lease" || m.starts_with("lease::"))
        .filter(|m| !PRIMITIVES.contains(m) && !SHARED.contains(m))
        .collect()
}

#[test]
fn every_module_of_the_lease_family_is_a_primitive_or_shared() {
    let mods = modules();
    for m in SHARED {
        assert!(mods.contains_key(m), "no module {m}");
    }
    let unlisted = unlisted_lease_modules(&mods);
    assert!(
        unlisted.is_empty(),
        "lease modules neither in PRIMITIVES nor in SHARED: {unlisted:?}"
    );
}

#[test]
fn an_unlisted_lease_module_is_found() {
    let mut mods: BTreeMap<String, String> = PRIMITIVES
        .iter()
        .chain(&SHARED)
        .map(|m| ((*m).to_owned(), String::new()))
        .collect();
    assert!(unlisted_lease_modules(&mods).is_empty());
    mods.insert("lease::barrier".to_owned(), String::new());
    assert_eq!(unlisted_lease_modules(&mods), ["lease::barrier"]);
}

#[test]
fn the_primitives_import_no_sibling() {
    let mods = modules();
    for m in PRIMITIVES {
        assert!(mods.contains_key(m), "no module {m}");
    }
    let edges = edges(&mods);
    let found = sibling_imports(&edges);
    assert!(
        found.is_empty(),
        "primitives importing a sibling: {found:?}"
    );
}

#[test]
fn the_sibling_checker_finds_a_planted_import() {
    let mut mods = BTreeMap::new();
    mods.insert(
        "lease::semaphore".to_owned(),
        "use crate::lease::rwlease::Spec;".to_owned(),
    );
    mods.insert("lease::rwlease".to_owned(), String::new());
    mods.insert(
        "lease::election".to_owned(),
        "use crate::lease::fenced::F;".to_owned(),
    );
    mods.insert("lease::fenced".to_owned(), String::new());
    let edges = edges(&mods);
    assert_eq!(
        sibling_imports(&edges),
        vec![("lease::semaphore", "lease::rwlease")]
    );
}

/// `code` (as [`code_only`] gives it) with every item marked `#[cfg(test)]`
/// blanked out: a block up to its closing brace, anything else up to its `;`.
fn without_test_items(code: &str) -> String {
    let mut out: Vec<char> = code.chars().collect();
    let marker: Vec<char> = "#[cfg(test)]".chars().collect();
    let mut i = 0;
    while i + marker.len() <= out.len() {
        if out[i..i + marker.len()] != marker[..] {
            i += 1;
            continue;
        }
        let mut j = i + marker.len();
        let mut depth = 0usize;
        while j < out.len() {
            match out[j] {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                ';' if depth == 0 => break,
                _ => {}
            }
            j += 1;
        }
        let end = (j + 1).min(out.len());
        for c in &mut out[i..end] {
            if *c != '\n' {
                *c = ' ';
            }
        }
        i = j + 1;
    }
    out.into_iter().collect()
}

/// Every read of the operating system's monotonic clock that bypasses the
/// deployment's clock: `Instant::now` or `.elapsed()` in shipped code of any
/// module but `clock`, as `(module, line)`. Test items are left aside, and so
/// is the simulation, whose model servers run on simulated time.
fn direct_clock_reads(mods: &BTreeMap<String, String>) -> Vec<(String, usize)> {
    let outside = |m: &str| m == "sim" || m.starts_with("sim::");
    let mut found = Vec::new();
    for (m, text) in mods {
        if m == "clock" || outside(m) {
            continue;
        }
        let code = without_test_items(&code_only(text));
        for (n, line) in code.lines().enumerate() {
            if line.contains("Instant::now") || line.contains(".elapsed()") {
                found.push((m.clone(), n + 1));
            }
        }
    }
    found
}

#[test]
fn every_clock_read_goes_through_the_deployments_clock() {
    let mods = modules();
    let found = direct_clock_reads(&mods);
    assert!(
        found.is_empty(),
        "clock reads outside clock.rs (use the deployment's clock): {found:?}"
    );
}

#[test]
fn the_clock_checker_finds_a_planted_read() {
    let mut mods = BTreeMap::new();
    mods.insert(
        "runtime::x".to_owned(),
        "fn f(c: &dyn Clock) -> Instant {\n    c.now()\n}\nfn g() -> Duration {\n    let t = c.now();\n    t.elapsed()\n}\nfn h() { let s = \"Instant::now()\"; }\n// Instant::now()\n#[cfg(test)]\nmod tests {\n    fn t() { let _ = Instant::now(); }\n}\n#[cfg(test)]\nfn u() { Instant::now(); }\nfn late() -> Instant { Instant::now() }\n"
            .to_owned(),
    );
    mods.insert(
        "clock".to_owned(),
        "fn now() -> Instant { Instant::now() }".to_owned(),
    );
    assert_eq!(
        direct_clock_reads(&mods),
        vec![("runtime::x".to_owned(), 6), ("runtime::x".to_owned(), 16)]
    );
}

#[test]
fn the_checker_finds_a_cycle() {
    let mut mods = BTreeMap::new();
    mods.insert("a".to_owned(), "use crate::b::X;".to_owned());
    mods.insert("b".to_owned(), "use crate::c::Y;".to_owned());
    mods.insert("c".to_owned(), "fn f() { crate::a::z(); }".to_owned());
    mods.insert("d".to_owned(), "use crate::a;".to_owned());
    let edges = edges(&mods);
    assert_eq!(cycles(&edges), vec![vec!["a", "b", "c"]]);
}

#[test]
fn the_checker_reads_grouped_imports() {
    let mut mods = BTreeMap::new();
    mods.insert(
        "p".to_owned(),
        "use crate::{\n    error::E,\n    q::{Q1, inner::{self, Q2}},\n};".to_owned(),
    );
    mods.insert("q".to_owned(), "use crate::p::P;".to_owned());
    mods.insert("q::inner".to_owned(), String::new());
    mods.insert("error".to_owned(), String::new());
    let edges = edges(&mods);
    assert_eq!(
        edges["p"].iter().copied().collect::<Vec<_>>(),
        ["error", "q", "q::inner"]
    );
    assert_eq!(cycles(&edges), vec![vec!["p", "q"]]);
}

#[test]
fn the_checker_reads_super_imports() {
    let mut mods = BTreeMap::new();
    // `super::` in a file module, twice over, and inside an inline module,
    // where it names the file module itself.
    mods.insert("r::s".to_owned(), "use super::t::T;".to_owned());
    mods.insert(
        "r::t".to_owned(),
        "use super::super::u::U;\nmod tests { use super::*; use super::super::s; }".to_owned(),
    );
    mods.insert("u".to_owned(), "fn f() { super::r::s::g(); }".to_owned());
    let edges = edges(&mods);
    assert_eq!(
        edges["r::t"].iter().copied().collect::<Vec<_>>(),
        ["r::s", "u"]
    );
    assert_eq!(cycles(&edges), vec![vec!["r::s", "r::t", "u"]]);
}

#[test]
fn the_checker_ignores_paths_in_comments_and_strings() {
    let mut mods = BTreeMap::new();
    mods.insert(
        "a".to_owned(),
        "/// see crate::b\nfn f() { let s = \"crate::b {\"; /* super::b */ let c = '{'; }\nuse crate::c::C;"
            .to_owned(),
    );
    mods.insert("b".to_owned(), "use crate::a::A;".to_owned());
    mods.insert("c".to_owned(), String::new());
    let edges = edges(&mods);
    assert_eq!(edges["a"].iter().copied().collect::<Vec<_>>(), ["c"]);
    assert!(cycles(&edges).is_empty());
}
