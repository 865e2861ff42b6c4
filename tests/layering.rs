//! The import graph of `src/` and `strategies/` against the floors `docs/architecture.md` names in
//! its Layers table: every `crate::` path outside unit tests, taken per top-level module, must
//! point to a module of the importing module's own floor or of a floor its row says it may
//! import; the floors themselves import one way, and no modules import each other in a circle.
//! The table is read from the document, so the two cannot drift apart.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The attribute that marks an item as test-only.
const TEST_ONLY: &str = "#[cfg(test)]";

/// One floor of the Layers table.
#[derive(Debug)]
struct Floor {
    /// The top-level modules that stand on it.
    modules: Vec<String>,
    /// The floors below it that its modules may import.
    may_import: Vec<String>,
}

/// The Layers table, by floor name.
type Floors = BTreeMap<String, Floor>;

/// Each top-level module with the top-level modules it imports.
type Graph = BTreeMap<String, BTreeSet<String>>;

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

/// The import graph of `src/` and `strategies/`: every top-level module, with what it imports.
fn the_graph() -> Graph {
    let mut files = Vec::new();
    sources(Path::new(&format!("{ROOT}/src")), &mut files);
    sources(Path::new(&format!("{ROOT}/strategies")), &mut files);
    let mut graph = Graph::new();
    for file in &files {
        let Some(module) = module_of(file) else {
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        let edges = graph.entry(module.clone()).or_default();
        edges.extend(imports(&code(&text)).into_iter().filter(|t| *t != module));
    }
    graph
}

/// The code of a file without its comments and without the items marked `#[cfg(test)]` (unit
/// tests and their helpers, wherever they stand in the file). String literals stay: a path in
/// `#[serde(with = "crate::forms::seconds")]` is an import too.
fn code(text: &str) -> String {
    let text: Vec<char> = text.chars().collect();
    let marker: Vec<char> = TEST_ONLY.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    while at < text.len() {
        if let Some(end) = literal_end(&text, at) {
            out.extend(&text[at..end]);
            at = end;
        } else if text[at..].starts_with(&['/', '/']) {
            at = text[at..]
                .iter()
                .position(|&c| c == '\n')
                .map_or(text.len(), |line_end| at + line_end);
        } else if text[at..].starts_with(&['/', '*']) {
            at = block_comment_end(&text, at);
        } else if text[at..].starts_with(&marker) {
            at = item_end(&text, at + marker.len());
        } else {
            out.push(text[at]);
            at += 1;
        }
    }
    out
}

/// Where the string or character literal starting at `at` ends (the index after it), if one
/// starts there (a lifetime's `'` starts none).
fn literal_end(text: &[char], at: usize) -> Option<usize> {
    let ident = |c: &char| c.is_alphanumeric() || *c == '_';
    let byte_prefix = at > 0 && text[at - 1] == 'b' && (at < 2 || !ident(&text[at - 2]));
    let after_ident = at > 0 && ident(&text[at - 1]) && !byte_prefix;
    match text[at] {
        '"' => {
            let mut i = at + 1;
            while i < text.len() && text[i] != '"' {
                i += if text[i] == '\\' { 2 } else { 1 };
            }
            Some((i + 1).min(text.len()))
        }
        'r' if !after_ident => {
            let hashes = text[at + 1..].iter().take_while(|&&c| c == '#').count();
            if text.get(at + 1 + hashes) != Some(&'"') {
                return None;
            }
            let close: Vec<char> = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            let from = at + 2 + hashes;
            let end = text[from..]
                .windows(close.len())
                .position(|window| window == close.as_slice())
                .map_or(text.len(), |found| from + found + close.len());
            Some(end)
        }
        '\'' => match (text.get(at + 1), text.get(at + 2)) {
            (Some('\\'), _) => text
                .iter()
                .skip(at + 3)
                .position(|&c| c == '\'')
                .map(|found| at + 3 + found + 1),
            (Some(_), Some('\'')) => Some(at + 3),
            _ => None,
        },
        _ => None,
    }
}

/// The end of the (nested) block comment starting at `at`.
fn block_comment_end(text: &[char], mut at: usize) -> usize {
    let mut depth = 0;
    while at < text.len() {
        if text[at..].starts_with(&['/', '*']) {
            depth += 1;
            at += 2;
        } else if text[at..].starts_with(&['*', '/']) {
            depth -= 1;
            at += 2;
            if depth == 0 {
                return at;
            }
        } else {
            at += 1;
        }
    }
    at
}

/// The end of the item starting at `at`: after its `;` or its block, or before the `,` or `}`
/// that ends it as a field, variant or the last item of a block.
fn item_end(text: &[char], mut at: usize) -> usize {
    let mut depth = 0;
    while at < text.len() {
        if let Some(end) = literal_end(text, at) {
            at = end;
            continue;
        }
        match text[at] {
            ';' | ',' if depth == 0 => return at + 1,
            '}' if depth == 0 => return at,
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return at + 1;
                }
            }
            _ => {}
        }
        at += 1;
    }
    at
}

/// The top-level modules a file's code names through `crate::` paths, groups included at any
/// depth: `crate::{a::{b, c}, d}` names `a` and `d`.
fn imports(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let own_crate = !rest[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_');
        rest = &rest[at + "crate::".len()..];
        if !own_crate {
            continue;
        }
        match rest.strip_prefix('{') {
            Some(group) => found.extend(group_items(group).into_iter().filter_map(first_name)),
            None => found.extend(first_name(rest)),
        }
    }
    found
}

/// The items of a `{...}` group, from just after its `{`: split at its own commas, nested groups
/// kept whole inside their item.
fn group_items(group: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (at, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                items.push(&group[start..at]);
                return items;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&group[start..at]);
                start = at + 1;
            }
            _ => {}
        }
    }
    items.push(&group[start..]);
    items
}

/// The first name of a path (`backend` of `backend::{Backend, X}`).
fn first_name(path: &str) -> Option<String> {
    let name: String = path
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some(name)
}

/// The Layers table of a document like `docs/architecture.md`: one row per floor, its modules
/// in backticks, then the floors it may import, separated by commas.
fn floors(doc: &str) -> Floors {
    let start = doc
        .find("## Layers")
        .expect("the document has a Layers section");
    let ticked = |cell: &str| -> Vec<String> {
        cell.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect()
    };
    let rows = doc[start..]
        .lines()
        .skip_while(|line| !line.starts_with('|'))
        .take_while(|line| line.starts_with('|'))
        // The header and the rule under it.
        .skip(2);
    let mut floors = Floors::new();
    for row in rows {
        let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
        assert!(cells.len() >= 3, "a Layers row has three cells: {row}");
        let may_import = cells[2]
            .split(',')
            .map(|floor| floor.trim().trim_matches('*').to_owned())
            .filter(|floor| !floor.is_empty())
            .collect();
        let floor = Floor {
            modules: ticked(cells[1]),
            may_import,
        };
        floors.insert(cells[0].trim_matches('*').to_owned(), floor);
    }
    assert!(!floors.is_empty(), "the Layers table is empty");
    floors
}

/// Everything in `graph` and `floors` that breaks the floors: a module on no floor or on two, a
/// floor naming a module or a floor that does not exist, floors that import in a circle, an
/// import a module's floor does not allow, modules that import in a circle.
fn problems(graph: &Graph, floors: &Floors) -> Vec<String> {
    let mut problems = Vec::new();
    let mut floor_of: BTreeMap<&str, &str> = BTreeMap::new();
    for (name, floor) in floors {
        for module in &floor.modules {
            if let Some(other) = floor_of.insert(module, name) {
                problems.push(format!(
                    "module `{module}` is on two floors: {other} and {name}"
                ));
            }
            if !graph.contains_key(module) {
                problems.push(format!(
                    "the {name} floor names `{module}`, which is no module"
                ));
            }
        }
        for below in &floor.may_import {
            if !floors.contains_key(below) {
                problems.push(format!(
                    "the {name} floor may import `{below}`, which is no floor"
                ));
            }
        }
    }
    let floor_graph: Graph = floors
        .iter()
        .map(|(name, floor)| (name.clone(), floor.may_import.iter().cloned().collect()))
        .collect();
    problems.extend(
        circles(&floor_graph)
            .into_iter()
            .map(|circle| format!("floors import in a circle: {circle}")),
    );
    for (module, targets) in graph {
        let Some(&floor) = floor_of.get(module.as_str()) else {
            problems.push(format!(
                "module `{module}` is on no floor of docs/architecture.md"
            ));
            continue;
        };
        for target in targets {
            match floor_of.get(target.as_str()) {
                None => problems.push(format!(
                    "`{module}` imports `{target}`, which is on no floor"
                )),
                Some(&to) if to == floor || floors[floor].may_import.iter().any(|f| f == to) => {}
                Some(&to) => problems.push(format!(
                    "`{module}` ({floor}) imports `{target}` ({to}): not allowed"
                )),
            }
        }
    }
    problems.extend(
        circles(graph)
            .into_iter()
            .map(|circle| format!("modules import in a circle: {circle}")),
    );
    problems
}

/// The circles of `graph`, each as `a -> b -> a`: a depth-first search.
fn circles(graph: &Graph) -> Vec<String> {
    fn visit(
        node: &str,
        graph: &Graph,
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
    for node in graph.keys() {
        visit(node, graph, &mut Vec::new(), &mut done, &mut circles);
    }
    circles
}

#[test]
fn modules_import_only_downward_and_never_in_a_circle() {
    let doc = std::fs::read_to_string(format!("{ROOT}/docs/architecture.md")).unwrap();
    let problems = problems(&the_graph(), &floors(&doc));
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

#[test]
fn a_nested_group_yields_every_module_it_names() {
    let text = "use crate::{backend::{Backend, X}, prompt::{self, Y}, strategy};";
    let found = imports(&code(text));
    assert_eq!(
        found.into_iter().collect::<Vec<_>>(),
        ["backend", "prompt", "strategy"]
    );
}

#[test]
fn a_test_item_amid_the_code_hides_only_itself() {
    let text = r#"
#[cfg(test)]
mod testing;
use crate::pool;
#[cfg(test)]
fn helper() { let brace = '}'; let text = "}"; crate::admin::x(); }
struct S {
    #[cfg(test)]
    seen: crate::server::Seen,
    kept: u8,
}
#[serde(with = "crate::forms::seconds")]
/* crate::proxy */ fn f<'a>(_: &'a str) { let url = "http://x"; crate::body::y(); }
"#;
    let found = imports(&code(text));
    assert_eq!(
        found.into_iter().collect::<Vec<_>>(),
        ["body", "forms", "pool"]
    );
}

/// A small table of three floors, as the document writes it.
const SMALL_TABLE: &str = "## Layers

| Floor | Modules | May import |
|---|---|---|
| model | `backend`, `prompt` | |
| admission | `balancer` | model |
| strategies | `strategies` | model |
";

fn graph_of(edges: &[(&str, &[&str])]) -> Graph {
    edges
        .iter()
        .map(|(module, targets)| {
            let targets = targets.iter().map(|t| (*t).to_owned()).collect();
            ((*module).to_owned(), targets)
        })
        .collect()
}

#[test]
fn a_strategy_importing_a_module_off_the_model_floor_is_reported() {
    let graph = graph_of(&[
        ("backend", &["prompt"]),
        ("prompt", &[]),
        ("balancer", &["backend"]),
        ("strategies", &["backend", "balancer"]),
    ]);
    assert_eq!(
        problems(&graph, &floors(SMALL_TABLE)),
        ["`strategies` (strategies) imports `balancer` (admission): not allowed"]
    );
}

#[test]
fn floors_or_modules_in_a_circle_and_modules_on_no_floor_are_reported() {
    let table = SMALL_TABLE.replace(
        "| `backend`, `prompt` | |",
        "| `backend`, `prompt` | admission |",
    );
    let graph = graph_of(&[
        ("backend", &["prompt"]),
        ("prompt", &["backend"]),
        ("balancer", &[]),
        ("strategies", &[]),
        ("stray", &[]),
    ]);
    assert_eq!(
        problems(&graph, &floors(&table)),
        [
            "floors import in a circle: admission -> model -> admission",
            "module `stray` is on no floor of docs/architecture.md",
            "modules import in a circle: backend -> prompt -> backend",
        ]
    );
}
