//! The admin API, the configuration and the reload path at their edges: text variables that are
//! not UTF-8 and admin tokens no client could send refused at start, the shipped default file
//! holding the built-in defaults and every key, the documented unknown-key error, numbers in
//! exponent form from the environment, `Allow` on a 405; malformed set-backends bodies, the
//! token and allow-list, health's fields, one-line configuration errors and reloads of the admin
//! settings.
//!
//! House rules: a configuration error exits 2 with one line naming the key; a bad admin request
//! gets 400 with JSON naming the field and changes nothing; the docs match the code.

mod common;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::time::Duration;

use common::*;
use http::{Request, StatusCode};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn scratch_file(name: &str, text: &str) -> PathBuf {
    let path = scratch_dir("audit-admin").join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn repo_file(path: &str) -> String {
    std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

/// `--check-config` with a clean environment plus `env` (values as raw bytes) and `args`:
/// (exit code, stdout, stderr).
fn check_config_raw(args: &[&str], env: &[(&str, &[u8])]) -> (i32, String, String) {
    let mut command = router_command(&[]);
    for (key, value) in env {
        command.env(key, OsStr::from_bytes(value));
    }
    let output = command.arg("--check-config").args(args).output().unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn check_config(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let env: Vec<(&str, &[u8])> = env.iter().map(|(k, v)| (*k, v.as_bytes())).collect();
    check_config_raw(args, &env)
}

/// Leaf keys of a `--check-config` document (`strategy.params` kept whole).
fn leaf_keys(value: &Value, prefix: &str, out: &mut Vec<String>) {
    match value {
        Value::Object(map) if prefix != "strategy.params" => {
            for (key, inner) in map {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                leaf_keys(inner, &path, out);
            }
        }
        _ => out.push(prefix.to_owned()),
    }
}

/// Sends one raw HTTP/1.1 request and returns the status code of the answer.
async fn raw_status(addr: std::net::SocketAddr, request: &[u8]) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut buffer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut buffer)).await;
    let text = String::from_utf8_lossy(&buffer).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    (status, text)
}

/// A set-backends request with `Connection: close`, the `Authorization` value given as bytes.
fn set_backends_request(authorization: Option<&[u8]>, body: &str) -> Vec<u8> {
    let mut request = format!(
        "POST /_custom_router/set-backends HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    )
    .into_bytes();
    if let Some(value) = authorization {
        request.extend_from_slice(b"Authorization: ");
        request.extend_from_slice(value);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"\r\n");
    request.extend_from_slice(body.as_bytes());
    request
}

async fn health_backends(addr: std::net::SocketAddr) -> Value {
    get_json(&format!("http://{addr}/_custom_router/health"))
        .await
        .1["backends"]
        .clone()
}

// ---------------------------------------------------------------------------------------------
// Values refused at start, the shipped files and the 405.

/// A text-valued variable whose value is not UTF-8 exits 2 naming the variable, as a number's
/// does: skipped, it would leave the router without its admin token (set-backends open to
/// anyone), listening on all interfaces, or without its extra CA.
#[test]
fn non_utf8_text_variables_are_configuration_errors_not_ignored() {
    // Control: a non-text variable with a non-UTF-8 value is refused.
    let (code, _, err) = check_config_raw(&[], &[("CUSTOM_ROUTER_PORT", b"80\xff")]);
    assert_eq!(code, 2, "{err}");
    let mut failures = Vec::new();
    for (var, value) in [
        ("CUSTOM_ROUTER_ADMIN_TOKEN", &b"s3cr\xffet"[..]),
        ("CUSTOM_ROUTER_HOST", b"127.0.0.1\xff"),
        ("CUSTOM_ROUTER_STRATEGY", b"round-robin\xff"),
        ("CUSTOM_ROUTER_HEALTH_CHECK_PATH", b"/health\xff"),
        ("CUSTOM_ROUTER_TLS_CA_FILE", b"/etc/ca\xff.pem"),
        ("CUSTOM_ROUTER_DEADLINE_HEADER", b"x-deadline\xff"),
        ("CUSTOM_ROUTER_ENGINE_METRICS_PATH", b"/metrics\xff"),
    ] {
        let (code, out, err) = check_config_raw(&[], &[(var, value)]);
        let one_line_naming = code == 2 && err.trim_end().lines().count() == 1 && err.contains(var);
        if !one_line_naming {
            let key = custom_router::config::ENV_VARS
                .iter()
                .find(|v| v.name == var)
                .unwrap()
                .key;
            let in_effect = serde_json::from_str::<Value>(&out)
                .ok()
                .and_then(|c| key.split('.').try_fold(c, |v, p| v.get(p).cloned()))
                .unwrap_or(Value::Null);
            failures.push(format!(
                "{var}={:?}: exit {code} (expected 2 naming it); {key} in effect: {in_effect}",
                String::from_utf8_lossy(value)
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// An admin token no client could present (a trailing newline, as a Kubernetes secret written
/// from a file keeps; a leading space; a non-ASCII character: the header is read as visible
/// ASCII, trimmed) exits 2 naming the variable, rather than start a router whose every
/// set-backends is 401.
#[tokio::test]
async fn an_admin_token_no_request_can_present_is_refused_at_start() {
    let mut failures = Vec::new();
    for token in ["s3cret\n", " s3cret", "pässwort"] {
        let (code, _, err) = check_config(&[], &[("CUSTOM_ROUTER_ADMIN_TOKEN", token)]);
        if code == 2 && err.contains("CUSTOM_ROUTER_ADMIN_TOKEN") {
            continue;
        }
        let router = spawn_router_process(&[("CUSTOM_ROUTER_ADMIN_TOKEN", token)]);
        let presented = format!("Bearer {}", token.trim());
        let (status, answer) = raw_status(
            router.addr,
            &set_backends_request(Some(presented.as_bytes()), r#"{"backends":[]}"#),
        )
        .await;
        if status != 200 {
            failures.push(format!(
                "token {token:?}: accepted at start (exit {code}) but `Authorization: {presented}` \
                 gets {status}: {}",
                answer.lines().last().unwrap_or_default()
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// config/default.toml lists "every configuration key with its built-in default": loading it (it
/// is in the image under /etc/custom-router/) changes nothing.
#[test]
fn default_toml_holds_the_builtin_defaults() {
    let (code, builtin, err) = check_config(&[], &[]);
    assert_eq!(code, 0, "{err}");
    let file = format!("{}/config/default.toml", env!("CARGO_MANIFEST_DIR"));
    let (code, from_file, err) = check_config(&["--config", &file], &[]);
    assert_eq!(code, 0, "{err}");
    let builtin: Value = serde_json::from_str(&builtin).unwrap();
    let from_file: Value = serde_json::from_str(&from_file).unwrap();
    let mut keys = Vec::new();
    leaf_keys(&builtin, "", &mut keys);
    let at = |v: &Value, key: &str| {
        key.split('.')
            .try_fold(v.clone(), |v, part| v.get(part).cloned())
    };
    let differing: Vec<String> = keys
        .iter()
        .filter(|key| at(&builtin, key) != at(&from_file, key))
        .map(|key| {
            format!(
                "{key}: built-in {:?}, config/default.toml {:?}",
                at(&builtin, key),
                at(&from_file, key)
            )
        })
        .collect();
    assert!(differing.is_empty(), "{differing:#?}");
}

/// config/default.toml holds every key (set, or commented out where the default is unset).
#[test]
fn default_toml_lists_every_key() {
    let (code, builtin, err) = check_config(&[], &[]);
    assert_eq!(code, 0, "{err}");
    let builtin: Value = serde_json::from_str(&builtin).unwrap();
    let mut keys = Vec::new();
    leaf_keys(&builtin, "", &mut keys);
    let text = repo_file("config/default.toml");
    let mut listed = Vec::new();
    let mut section = String::new();
    for line in text.lines() {
        let line = line.trim();
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.to_owned();
            listed.push(section.clone());
            continue;
        }
        let body = line.trim_start_matches('#').trim();
        if let Some((key, _)) = body.split_once('=') {
            let key = key.trim();
            if !key.is_empty() && key.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                listed.push(if section.is_empty() {
                    key.to_owned()
                } else {
                    format!("{section}.{key}")
                });
            }
        }
    }
    let missing: Vec<&String> = keys.iter().filter(|k| !listed.contains(k)).collect();
    assert!(
        missing.is_empty(),
        "config/default.toml lacks (not even commented out): {missing:?}"
    );
}

/// The error docs/configuration.md quotes for an unknown top-level key is the one printed.
#[test]
fn the_documented_unknown_key_error_is_what_the_router_prints() {
    let docs = repo_file("docs/configuration.md");
    let documented = docs
        .lines()
        .find(|line| {
            line.starts_with("custom-router: configuration error: key `foo` in router.toml")
        })
        .expect("example in docs")
        .to_owned();
    let dir = scratch_dir("audit-admin").join("unknown-key");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("router.toml"), "foo = 1\n").unwrap();
    let output = router_command(&[])
        .current_dir(&dir)
        .args(["--config", "router.toml", "--check-config"])
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&output.stderr)
        .trim_end()
        .to_owned();
    assert_eq!(output.status.code(), Some(2));
    assert_eq!(
        printed, documented,
        "docs/configuration.md example is stale"
    );
}

/// A number in exponent form reads the same from the environment as from the file
/// (`CUSTOM_ROUTER_QUEUE_TIMEOUT=1e3` and `timeout = 1e3`).
#[test]
fn exponent_numbers_from_the_environment_are_read_as_in_the_file() {
    let file = scratch_file("exp.toml", "[queue]\ntimeout = 1e3\n");
    let (code, out, err) = check_config(&["--config", file.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "file: {err}");
    let from_file: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(from_file["queue"]["timeout"], 1000.0);
    let (code, out, err) = check_config(&[], &[("CUSTOM_ROUTER_QUEUE_TIMEOUT", "1e3")]);
    assert_eq!(code, 0, "environment: {err}");
    let from_env: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(from_env["queue"]["timeout"], 1000.0);
}

/// `HEAD` is accepted where `GET` is, and a 405 there says so: `Allow: GET, HEAD` (RFC 9110
/// §10.2.1: `Allow` lists the methods the resource supports).
#[tokio::test]
async fn allow_lists_head_where_head_is_accepted() {
    let router = start_router(round_robin()).await;
    let head = Request::head(router.url("/_custom_router/health"))
        .body(full(""))
        .unwrap();
    assert_eq!(send(head).await.0, StatusCode::OK, "HEAD is accepted");
    for path in ["/_custom_router/health", "/_custom_router/metrics"] {
        let request = Request::post(router.url(path)).body(full("")).unwrap();
        let (status, headers, _) = send(request).await;
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
        let allow = headers["allow"].to_str().unwrap().to_owned();
        assert!(
            allow.split(',').any(|m| m.trim() == "HEAD"),
            "{path}: Allow: {allow}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// set-backends, health, configuration errors and reloads.

/// More malformed set-backends bodies than tests/admin.rs and tests/config_input.rs cover: each
/// is 400 with a JSON `error`, and the set (health) is unchanged.
#[tokio::test]
async fn more_malformed_bodies_are_400_and_change_nothing() {
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &["127.0.0.1:9001".to_owned()]).await;
    let before = health_backends(router.addr).await;
    let deep = format!("{{\"backends\":{}{}}}", "[".repeat(200), "]".repeat(200));
    let mut bodies: Vec<Vec<u8>> = vec![
        br#"{"backends":[["127.0.0.1:1"]]}"#.to_vec(),
        br#"{"backends":[{"addr":"127.0.0.1:1"}]}"#.to_vec(),
        br#"{"backends":[8080]}"#.to_vec(),
        br#"{"backends":[true]}"#.to_vec(),
        br#"{"backends":[null]}"#.to_vec(),
        br#"{"backends":[1e999]}"#.to_vec(),
        br#"{"backends":{"0":"127.0.0.1:1"}}"#.to_vec(),
        br#"{"backends":["127.0.0.1:1"]} x"#.to_vec(),
        br#"{"backends":[]}{"backends":["127.0.0.1:1"]}"#.to_vec(),
        br#"{"backends":["127.0.0.1:1"],"backend\u0073":[]}"#.to_vec(),
        br#"{"backends":["127.0.0.1:1",]}"#.to_vec(),
        br#"{"backends":["127.0.0.1:1"] // c
        }"#
        .to_vec(),
        b"\xef\xbb\xbf{\"backends\":[\"127.0.0.1:1\"]}".to_vec(),
        b"{\"backends\":[\"127.0.0.1:1\xff\"]}".to_vec(),
        b"{\"backends\":[\"127.0.0.1:1\"]\xff}".to_vec(),
        br#"{"backends":["127.0.0.1:65536"]}"#.to_vec(),
        br#"{"backends":["127.0.0.1:99999999999"]}"#.to_vec(),
        br#"{"backends":["127.0.0.1:-1"]}"#.to_vec(),
        br#"{"backends":["127.0.0.1: 80"]}"#.to_vec(),
        br#"{"backends":["127.0.0.1:8 0"]}"#.to_vec(),
        br#"{"backends":["127.0.0.1:0x50"]}"#.to_vec(),
        br#"{"backends":["127.0.0.1:80#frag"]}"#.to_vec(),
        br#"{"backends":["http://127.0.0.1:80/?"]}"#.to_vec(),
        br#"{"backends":["http://user:pw@127.0.0.1:80"]}"#.to_vec(),
        br#"{"backends":["http://[::1]:80@evil.example:80"]}"#.to_vec(),
        br#"{"backends":["[fe80::1%25eth0]:80"]}"#.to_vec(),
        br#"{"backends":["fe80::1:80"]}"#.to_vec(),
        br#"{"backends":["[::1]"]}"#.to_vec(),
        br#"{"backends":["http://"]}"#.to_vec(),
        br#"{"backends":["http:///:80"]}"#.to_vec(),
        br#"{"backends":["HTTPS:/127.0.0.1:80"]}"#.to_vec(),
        br#"{"backends":["ws://127.0.0.1:80"]}"#.to_vec(),
        br#"{"backends":["127.1:80"]}"#.to_vec(),
        br#"{"backends":["2130706433:80"]}"#.to_vec(),
        br#"{"backends":["m\u00fcnchen.example:80"]}"#.to_vec(),
        br#"{"backends":["a\u0000b:80"]}"#.to_vec(),
        br#"{"backends":["   "]}"#.to_vec(),
        deep.into_bytes(),
        b"".to_vec(),
        b"null".to_vec(),
        b"\"backends\"".to_vec(),
    ];
    bodies.push(format!("{{\"backends\":[\"{}.example:80\"]}}", "a".repeat(254)).into_bytes());
    for body in bodies {
        let shown = String::from_utf8_lossy(&body)
            .chars()
            .take(80)
            .collect::<String>();
        let request = Request::post(router.url("/_custom_router/set-backends"))
            .header("content-type", "application/json")
            .body(full(body))
            .unwrap();
        let (status, headers, answer) = send(request).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{shown}: {answer:?}");
        assert_eq!(headers["content-type"], "application/json");
        let answer: Value = serde_json::from_slice(&answer).unwrap();
        assert!(answer["error"].is_string(), "{shown}: {answer}");
        assert_eq!(health_backends(router.addr).await, before, "{shown}");
    }
}

/// Accepted forms are written back canonically: upper-case schemes and hosts lowered, ports with
/// leading zeros read as decimal, spaces around an entry ignored, an extra top-level field
/// ignored; the answer is `{"ok": true, "backends": [...]}` as README says.
#[tokio::test]
async fn accepted_forms_and_the_answer() {
    let router = start_router(round_robin()).await;
    let (status, answer) = post_json(
        &router.url("/_custom_router/set-backends?x=1"),
        r#"{"backends":["HTTP://Replica.Example:0080/"," 10.0.0.1:81 ","HTTPS://[::FFFF:10.0.0.2]:443","replica.example:80"],"extra":1}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(
        answer,
        json!({"ok": true, "backends": ["replica.example:80", "10.0.0.1:81", "https://[::ffff:10.0.0.2]:443"]})
    );
    // Any content type is taken (README's curl example sends form encoding).
    let request = Request::post(router.url("/_custom_router/set-backends"))
        .header("content-type", "text/plain")
        .body(full(r#"{"backends":[]}"#))
        .unwrap();
    assert_eq!(send(request).await.0, StatusCode::OK);
}

/// Token: 401 with `WWW-Authenticate: Bearer` and JSON for a missing, wrong, wrong-length or
/// wrong-scheme credential, before the body matters; the set is unchanged; the scheme is read in
/// any case (RFC 9110 §11.1); health and metrics need no token.
#[tokio::test]
async fn the_token_guards_set_backends_only() {
    let mut config = round_robin();
    config.admin.token = Some("s3cret".to_owned());
    let router = start_router(config).await;
    let good = r#"{"backends":["127.0.0.1:9001"]}"#;
    assert_eq!(
        raw_status(
            router.addr,
            &set_backends_request(Some(b"bearer s3cret"), good)
        )
        .await
        .0,
        200
    );
    let before = health_backends(router.addr).await;
    for authorization in [
        None,
        Some(&b"Bearer s3cre"[..]),
        Some(b"Bearer s3cret2"),
        Some(b"Bearer S3CRET"),
        Some(b"Basic s3cret"),
        Some(b"Bearers3cret"),
        Some(b"s3cret"),
        Some(b"Bearer"),
        Some(b"Bearer s3cr\xc3\xa9t"),
    ] {
        let (status, text) = raw_status(
            router.addr,
            &set_backends_request(authorization, r#"{"backends":[]}"#),
        )
        .await;
        assert_eq!(status, 401, "{authorization:?}: {text}");
        assert!(
            text.to_ascii_lowercase()
                .contains("www-authenticate: bearer"),
            "{text}"
        );
        assert!(text.contains("\"error\""), "{text}");
        assert_eq!(
            health_backends(router.addr).await,
            before,
            "{authorization:?}"
        );
    }
    assert_eq!(
        get(&router.url("/_custom_router/health")).await.0,
        StatusCode::OK
    );
    assert_eq!(
        get(&router.url("/_custom_router/metrics")).await.0,
        StatusCode::OK
    );
}

/// A 401 answered without reading the body does not let the body be read as a second request
/// on the same connection (no smuggling through the admin API).
#[tokio::test]
async fn an_unread_refused_body_is_not_a_second_request() {
    let backend = named_backend("smuggled").await;
    let mut config = round_robin();
    config.admin.token = Some("s3cret".to_owned());
    let router = start_router(config).await;
    set_backends_with(router.addr, &backend.host_port(), "s3cret").await;
    let inner = "GET /smuggled HTTP/1.1\r\nHost: r\r\n\r\n";
    let request = format!(
        "POST /_custom_router/set-backends HTTP/1.1\r\nHost: r\r\nContent-Length: {}\r\n\r\n{inner}",
        inner.len()
    );
    let mut stream = tokio::net::TcpStream::connect(router.addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut buffer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(3), stream.read_to_end(&mut buffer)).await;
    let text = String::from_utf8_lossy(&buffer);
    assert!(text.starts_with("HTTP/1.1 401"), "{text}");
    assert_eq!(text.matches("HTTP/1.1 ").count(), 1, "{text}");
    assert_eq!(backend.hits(), 0);
}

async fn set_backends_with(addr: std::net::SocketAddr, backend: &str, token: &str) {
    let (status, answer) = post_set_backends(
        addr,
        &json!({ "backends": [backend] }).to_string(),
        Some(token),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
}

/// A chunked set-backends body past 1 MiB is 413 and changes nothing.
#[tokio::test]
async fn a_chunked_oversized_body_is_413() {
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &["127.0.0.1:9001".to_owned()]).await;
    let (sender, body) = channel_body();
    let request = Request::post(router.url("/_custom_router/set-backends"))
        .body(body)
        .unwrap();
    let feeder = tokio::spawn(async move {
        let _ = sender
            .send(bytes::Bytes::from_static(
                b"{\"backends\":[\"127.0.0.1:9002\"]",
            ))
            .await;
        for _ in 0..20 {
            if sender
                .send(bytes::Bytes::from(vec![b' '; 64 * 1024]))
                .await
                .is_err()
            {
                break;
            }
        }
        let _ = sender.send(bytes::Bytes::from_static(b"}")).await;
    });
    let response = client().request(request).await;
    if let Ok(response) = response {
        assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    }
    feeder.abort();
    assert_eq!(listed_backends(router.addr).await, ["127.0.0.1:9001"]);
}

/// The allow-list: host names refused (even `localhost`), addresses outside refused, an
/// IPv4-mapped IPv6 address inside an IPv4 network accepted; one bad entry refuses the call
/// and nothing changes.
#[tokio::test]
async fn the_allow_list() {
    let mut config = round_robin();
    config.admin.backend_allow_cidrs =
        vec!["127.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()];
    let router = start_router(config).await;
    set_backends(router.addr, &["127.0.0.1:9001".to_owned()]).await;
    let before = health_backends(router.addr).await;
    for (entry, expected) in [
        ("localhost:80", "host name"),
        ("127.0.0.1.nip.io:80", "host name"),
        ("0x7f.1:80", "host name"),
        ("10.0.0.1:80", "outside"),
        ("[::1]:80", "outside"),
        ("[fe00::1]:80", "outside"),
        ("[::ffff:10.0.0.1]:80", "outside"),
        ("[::127.0.0.1]:80", "outside"),
    ] {
        let body = json!({ "backends": ["127.0.0.2:1", entry] }).to_string();
        let (status, answer) = post_json(&router.url("/_custom_router/set-backends"), body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{entry}: {answer}");
        let message = answer["error"].as_str().unwrap();
        assert!(
            message.starts_with("backends[1]") && message.contains(expected),
            "{entry}: {message}"
        );
        assert_eq!(health_backends(router.addr).await, before, "{entry}");
    }
    set_backends(
        router.addr,
        &[
            "[::ffff:127.0.0.9]:80".to_owned(),
            "[fd12::1]:80".to_owned(),
        ],
    )
    .await;
}

/// Health carries exactly the README's fields.
#[tokio::test]
async fn health_fields_match_the_readme() {
    let router = start_router(round_robin()).await;
    set_backends(router.addr, &["127.0.0.1:9001".to_owned()]).await;
    let (status, health) = get_json(&router.url("/_custom_router/health")).await;
    assert_eq!(status, StatusCode::OK);
    let mut top: Vec<&str> = health
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    top.sort_unstable();
    assert_eq!(
        top,
        [
            "backends",
            "draining",
            "ok",
            "panic_mode",
            "queue_depth",
            "strategy"
        ]
    );
    let mut per: Vec<&str> = health["backends"][0]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    per.sort_unstable();
    assert_eq!(
        per,
        [
            "addr",
            "completed",
            "ejected",
            "ewma_latency",
            "in_flight",
            "paused",
            "prefix_reach_tokens",
            "prefix_stale_kept"
        ]
    );
    assert_eq!(health["draining"], false);
    assert_eq!(health["panic_mode"], false);
}

/// More bad configuration values: each exits 2 with one line naming the variable or key.
#[test]
fn more_configuration_errors_are_one_line_naming_the_key() {
    for (var, value) in [
        ("CUSTOM_ROUTER_QUEUE_TIMEOUT", ""),
        ("CUSTOM_ROUTER_QUEUE_MAX_SIZE", "1.5"),
        ("CUSTOM_ROUTER_MAX_EJECTION_PERCENT", "NaN"),
        ("CUSTOM_ROUTER_MAX_EJECTION_PERCENT", "101"),
        ("CUSTOM_ROUTER_RETRY_BUDGET_PERCENT", "-1"),
        ("CUSTOM_ROUTER_RETRY_BUDGET_MIN_PER_SECOND", "inf"),
        ("CUSTOM_ROUTER_ENGINE_METRICS_INTERVAL", "11"),
        ("CUSTOM_ROUTER_ENGINE_METRICS_TIMEOUT", "0"),
        ("CUSTOM_ROUTER_ENGINE_METRICS", "bogus"),
        ("CUSTOM_ROUTER_HOST", "localhost"),
        ("CUSTOM_ROUTER_PORT", ""),
        ("CUSTOM_ROUTER_STRATEGY", "ROUND-ROBIN"),
        ("CUSTOM_ROUTER_ACCESS_LOG", "yes"),
        ("CUSTOM_ROUTER_TENANT_HEADER", " "),
        ("CUSTOM_ROUTER_RETRY_BODY_LIMIT", "67108865"),
        ("CUSTOM_ROUTER_HEALTH_CHECK_PATH", ""),
        ("CUSTOM_ROUTER_TLS_CA_FILE", ""),
        ("CUSTOM_ROUTER_QUEUE_PRIORITY_AGING", "0"),
        ("CUSTOM_ROUTER_CONSECUTIVE_FAILURES", "4294967296"),
        ("CUSTOM_ROUTER_BACKENDS", "10.0.0.1:80/x"),
    ] {
        let (code, _, err) = check_config(&[], &[(var, value)]);
        assert_eq!(code, 2, "{var}={value:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(err.contains(var), "{var}: {err}");
    }
    let cases = [
        ("[queue]\ntimeout = nan\n", "queue.timeout"),
        ("[queue]\ntimeout = inf\n", "queue.timeout"),
        ("[queue]\ntimeout = \"5\"\n", "queue.timeout"),
        ("[queue]\nbogus = 1\n", "queue.bogus"),
        ("[admin]\nbogus = 1\n", "admin.bogus"),
        ("[prefix_index]\nbogus = 1\n", "prefix_index.bogus"),
        ("[retry.budget]\nbogus = 1\n", "retry.budget.bogus"),
        ("[admin]\ntoken = true\n", "admin.token"),
        ("[admin]\ntoken = \"\"\n", "admin.token"),
        (
            "[strategy.params]\nload_bound = nan\n",
            "strategy.params.load_bound",
        ),
        (
            "[strategy]\nname = \"affinity\"\n[strategy.params]\nload_factor = inf\n",
            "strategy.params.load_factor",
        ),
        ("port = \"3000\"\n", "port"),
        ("strategy = \"round-robin\"\n", "strategy"),
    ];
    for (index, (text, key)) in cases.into_iter().enumerate() {
        let file = scratch_file(&format!("bad-{index}.toml"), text);
        let (code, _, err) = check_config(&["--config", file.to_str().unwrap()], &[]);
        assert_eq!(code, 2, "{text:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(err.contains(&format!("`{key}`")), "{text:?}: {err}");
    }
}

/// Reload: an invalid file changes nothing (the old token still works, the new one does not)
/// and is logged and counted; a valid one swaps the token and the allow-list for new requests;
/// a request in flight across both reloads finishes normally.
#[tokio::test]
async fn reload_keeps_or_swaps_the_admin_settings() {
    let (release_sender, release) = tokio::sync::watch::channel(false);
    let backend = spawn_backend(move |_request| {
        let mut release = release.clone();
        async move {
            let _ = release.wait_for(|go| *go).await;
            respond(StatusCode::OK, "done")
        }
    })
    .await;
    let file = scratch_file(
        "reload.toml",
        "[admin]\ntoken = \"one\"\nbackend_allow_cidrs = [\"127.0.0.0/8\"]\n",
    );
    let router = spawn_router_process(&[("CUSTOM_ROUTER_CONFIG", file.to_str().unwrap())]);
    set_backends_with(router.addr, &backend.host_port(), "one").await;
    let url = format!("http://{}/slow", router.addr);
    let in_flight = tokio::spawn(async move { get(&url).await });
    assert!(eventually(Duration::from_secs(5), async || backend.hits() == 1).await);
    let hangup = || {
        let status = std::process::Command::new("kill")
            .args(["-HUP", &router.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    };
    let reloads = |result: &str| {
        let needle = format!("custom_router_config_reloads_total{{result=\"{result}\"");
        let url = format!("http://{}/_custom_router/metrics", router.addr);
        async move {
            let (_, text) = get(&url).await;
            text.lines()
                .find(|line| line.starts_with(&needle))
                .and_then(|line| line.rsplit(' ').next())
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        }
    };
    std::fs::write(&file, "[admin]\ntoken = \"two\"\nbogus = 1\n").unwrap();
    hangup();
    assert!(
        eventually(Duration::from_secs(5), async || reloads("error").await
            == 1.0)
        .await
    );
    // The log line is read from the router's stderr by another thread: it may come a moment
    // after the metric.
    assert!(
        eventually(Duration::from_secs(5), async || router
            .logged("admin.bogus"))
        .await
    );
    let body = json!({ "backends": [backend.host_port()] }).to_string();
    assert_eq!(
        post_set_backends(router.addr, &body, Some("two")).await.0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        post_set_backends(router.addr, &body, Some("one")).await.0,
        StatusCode::OK
    );
    std::fs::write(
        &file,
        "[admin]\ntoken = \"two\"\nbackend_allow_cidrs = [\"10.0.0.0/8\"]\n",
    )
    .unwrap();
    hangup();
    assert!(eventually(Duration::from_secs(5), async || reloads("ok").await == 1.0).await);
    assert_eq!(
        post_set_backends(router.addr, &body, Some("one")).await.0,
        StatusCode::UNAUTHORIZED
    );
    let (status, answer) = post_set_backends(router.addr, &body, Some("two")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    assert!(
        answer["error"].as_str().unwrap().contains("outside"),
        "{answer}"
    );
    let _ = release_sender.send(true);
    assert_eq!(
        in_flight.await.unwrap(),
        (StatusCode::OK, "done".to_owned())
    );
    assert_eq!(
        post_set_backends(router.addr, r#"{"backends":["10.0.0.1:80"]}"#, Some("two"))
            .await
            .0,
        StatusCode::OK
    );
}
