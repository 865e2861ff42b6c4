//! The import graph of `src/` and `strategies/` against the layers `docs/architecture.md`
//! declares: every `crate::` path outside unit tests, taken per top-level module, must point to a
//! module of a layer the importing layer may use, and the modules must not import each other in
//! a circle. The layer table is read from the document, so the two cannot drift apart.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file belongs to (`None` for the crate root and the binary).
fn module_of(path: &Path) -> Option<String> {
    let relative = path.strip_prefix(ROOT).unwrap();
    let mut parts = relative.iter().map(|p| p.to_string_lossy().into_owned());
    match parts.next()?.as_str() {
        "strategies" => Some("strategies".to_owned()),
        "src" => {
            let first = parts.next()?;
            let name = first.trim_end_matches(".rs").to_owned();
            (name != "lib" && name != "main").then_some(name)
        }
        _ => None,
    }
}

/// The code of a file without its unit tests and comments.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]") {
        Some(at) => &text[..at],
        None => text,
    };
    text.lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level modules a file's code names through `crate::` paths (grouped `use` included).
fn imports(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let name: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    found.insert(name);
                }
            }
            continue;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            found.insert(name);
        }
    }
    found
}

/// The layer table of `docs/architecture.md`: layer → (modules, layers it may import).
fn layers() -> BTreeMap<String, (Vec<String>, Vec<String>)> {
    let doc = std::fs::read_to_string(format!("{ROOT}/docs/architecture.md")).unwrap();
    let start = doc
        .find("## Layers")
        .expect("docs/architecture.md has a Layers section");
    let ticked = |cell: &str| -> Vec<String> {
        cell.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect()
    };
    let mut table = BTreeMap::new();
    for line in doc[start..].lines().skip_while(|l| !l.starts_with('|')) {
        if !line.starts_with('|') {
            break;
        }
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        if cells.len() < 3 || cells[0] == "Layer" || cells[0].starts_with("---") {
            continue;
        }
        let may: Vec<String> = cells[2]
            .split(',')
            .map(|layer| layer.trim().trim_matches('*').to_owned())
            .filter(|layer| table_layer_name(layer))
            .collect();
        table.insert(
            cells[0].trim_matches('*').to_owned(),
            (ticked(cells[1]), may),
        );
    }
    assert!(!table.is_empty(), "the Layers table is empty");
    table
}

fn table_layer_name(text: &str) -> bool {
    !text.is_empty() && text.chars().all(|c| c.is_ascii_lowercase())
}

#[test]
fn modules_import_only_downward_and_never_in_a_circle() {
    let mut files = Vec::new();
    sources(Path::new(&format!("{ROOT}/src")), &mut files);
    sources(Path::new(&format!("{ROOT}/strategies")), &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let Some(module) = module_of(file) else {
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        let edges = graph.entry(module.clone()).or_default();
        for target in imports(&code(&text)) {
            if target != module {
                edges.insert(target);
            }
        }
    }
    let layers = layers();
    let layer_of: BTreeMap<&str, &str> = layers
        .iter()
        .flat_map(|(layer, (modules, _))| modules.iter().map(move |m| (m.as_str(), layer.as_str())))
        .collect();
    let mut problems = Vec::new();
    for (module, targets) in &graph {
        let Some(layer) = layer_of.get(module.as_str()) else {
            problems.push(format!(
                "module `{module}` is in no layer of docs/architecture.md"
            ));
            continue;
        };
        let allowed = &layers[*layer].1;
        for target in targets {
            let Some(target_layer) = layer_of.get(target.as_str()) else {
                problems.push(format!(
                    "`{module}` imports `{target}`, which is in no layer"
                ));
                continue;
            };
            if target_layer != layer && !allowed.iter().any(|a| a == target_layer) {
                problems.push(format!(
                    "`{module}` ({layer}) imports `{target}` ({target_layer}): not allowed"
                ));
            }
        }
    }
    // Circles: a depth-first search over the module graph.
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        stack: &mut Vec<String>,
        done: &mut BTreeSet<String>,
        circles: &mut Vec<String>,
    ) {
        if let Some(at) = stack.iter().position(|n| n == node) {
            let mut circle = stack[at..].to_vec();
            circle.push(node.to_owned());
            circles.push(circle.join(" -> "));
            return;
        }
        if done.contains(node) {
            return;
        }
        stack.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            visit(next, graph, stack, done, circles);
        }
        stack.pop();
        done.insert(node.to_owned());
    }
    let mut circles = Vec::new();
    let mut done = BTreeSet::new();
    for module in graph.keys() {
        visit(module, &graph, &mut Vec::new(), &mut done, &mut circles);
    }
    problems.extend(circles.into_iter().map(|c| format!("circle: {c}")));
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_import_reader_sees_grouped_and_nested_paths_and_skips_tests() {
    let text = "use crate::{h1, pool::Failure};\nfn f() { crate::backend::x(); }\n// crate::admin\n#[cfg(test)]\nmod tests { use crate::server; }";
    let found = imports(&code(text));
    assert_eq!(
        found.into_iter().collect::<Vec<_>>(),
        ["backend", "h1", "pool"]
    );
}
