//! The modules of `src/` import one another in one direction only (DESIGN §7):
//! leaves, then connections, the pure core, the runtime, the primitives and the
//! coordinator. Read from the `crate::` paths in the sources.

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

/// `crate::` paths in a source text (`crate::a::b`, also inside `use crate::{…}`
/// only as far as the first segment, which is what the layering needs).
fn crate_paths(text: &str) -> Vec<String> {
    // Comments and docs name modules without importing them.
    let code: String = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = Vec::new();
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        let tail = &rest[i + "crate::".len()..];
        let path: String = tail
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
            .collect();
        let path = path.trim_end_matches(':').to_owned();
        if !path.is_empty() {
            out.push(path);
        }
        rest = tail;
    }
    out
}

fn edges(mods: &BTreeMap<String, String>) -> BTreeMap<&str, BTreeSet<&str>> {
    let mut edges: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (m, text) in mods {
        let set = edges.entry(m.as_str()).or_default();
        for path in crate_paths(text) {
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
            "error" | "keys" | "token" | "scripts" | "cancel" | "clock" | "report" => 1,
            "conn" => 2,
            "core" => 3,
            "runtime" => 4,
            _ => 5,
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
