//! The Kubernetes manifests (`deploy/kubernetes/`) agree with the router: the ConfigMap's
//! `router.toml` is a valid configuration, the Deployment points `CUSTOM_ROUTER_CONFIG` at the
//! mounted file, sets only known variables, probes the health endpoint and gives SIGTERM's drain
//! enough time. The manifests' schemas are checked by `kubernetes-validate` in `.ci/run`.

use custom_router::config::{CONFIG_FILE_ENV, Config, ENV_VARS};
use figment::Figment;
use figment::providers::{Format, Toml};

fn read(path: &str) -> String {
    std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR")))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The text of the YAML block scalar under `key: |` (its indentation removed), or `None`.
fn block_scalar(yaml: &str, key: &str) -> Option<String> {
    let mut lines = yaml.lines();
    let header = lines.find(|line| line.trim() == format!("{key}: |"))?;
    let parent = header.len() - header.trim_start().len();
    let mut indent = None;
    let mut text = String::new();
    for line in lines {
        if line.trim().is_empty() {
            text.push('\n');
            continue;
        }
        let depth = line.len() - line.trim_start().len();
        if depth <= parent {
            break;
        }
        let indent = *indent.get_or_insert(depth);
        assert!(
            depth >= indent,
            "{key}: a line indented less than the first"
        );
        text.push_str(&line[indent..]);
        text.push('\n');
    }
    Some(text.trim_end().to_owned() + "\n")
}

/// The scalar value of the first `key: value` line after `after` (quotes removed).
fn scalar_after(yaml: &str, after: &str, key: &str) -> Option<String> {
    let start = yaml.find(after)?;
    yaml[start..].lines().find_map(|line| {
        let rest = line.trim().trim_start_matches("- ").strip_prefix(key)?;
        let value = rest.strip_prefix(':')?.trim();
        Some(value.trim_matches('"').to_owned())
    })
}

fn router_toml() -> String {
    block_scalar(&read("deploy/kubernetes/configmap.yaml"), "router.toml")
        .expect("configmap.yaml has no `router.toml: |` block")
}

#[test]
fn the_block_scalar_extraction_keeps_the_whole_block() {
    let yaml = "data:\n  router.toml: |\n    a = 1\n\n    [t]\n      b = 2\n  other: x\n";
    assert_eq!(
        block_scalar(yaml, "router.toml").unwrap(),
        "a = 1\n\n[t]\n  b = 2\n"
    );
    assert_eq!(block_scalar(yaml, "missing"), None);
}

#[test]
fn the_configmap_holds_a_valid_router_config() {
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "custom-router-deploy-configmap-{}.toml",
        std::process::id()
    ));
    std::fs::write(&path, router_toml()).unwrap();
    let loaded = custom_router::config::load(Some(&path));
    let _ = std::fs::remove_file(&path);
    if let Err(error) = loaded {
        panic!("router.toml in deploy/kubernetes/configmap.yaml: {error}");
    }
}

#[test]
fn the_grace_period_covers_the_drain() {
    let toml = router_toml();
    let figment = Figment::from(Toml::string(&toml));
    let defaults = Config::default();
    let seconds = |key: &str, default: std::time::Duration| {
        if figment.contains(key) {
            figment.extract_inner::<f64>(key).unwrap()
        } else {
            default.as_secs_f64()
        }
    };
    let drain = seconds(
        "shutdown.pre_drain_delay",
        defaults.shutdown.pre_drain_delay,
    ) + seconds("shutdown.timeout", defaults.shutdown.timeout);
    let deployment = read("deploy/kubernetes/deployment.yaml");
    let grace: f64 = scalar_after(&deployment, "spec:", "terminationGracePeriodSeconds")
        .expect("deployment.yaml sets no terminationGracePeriodSeconds")
        .parse()
        .unwrap();
    assert!(
        grace > drain,
        "terminationGracePeriodSeconds {grace} is not above shutdown.pre_drain_delay + shutdown.timeout {drain}"
    );
}

#[test]
fn the_deployment_reads_the_mounted_config_and_probes_health() {
    let deployment = read("deploy/kubernetes/deployment.yaml");
    let config = scalar_after(&deployment, &format!("name: {CONFIG_FILE_ENV}"), "value")
        .expect("deployment.yaml does not set CUSTOM_ROUTER_CONFIG");
    assert_eq!(config, "/etc/custom-router/router.toml");
    let mount = scalar_after(&deployment, "volumeMounts:", "mountPath").unwrap();
    assert!(
        config == format!("{mount}/router.toml") || config == mount,
        "CUSTOM_ROUTER_CONFIG {config} is not in the mount {mount}"
    );
    for probe in ["readinessProbe:", "livenessProbe:"] {
        assert_eq!(
            scalar_after(&deployment, probe, "path").as_deref(),
            Some("/_custom_router/health"),
            "{probe}"
        );
    }
    assert_eq!(
        scalar_after(&deployment, "ports:", "containerPort").as_deref(),
        Some("3000")
    );
}

#[test]
fn the_deployment_sets_only_known_variables() {
    let deployment = read("deploy/kubernetes/deployment.yaml");
    for line in deployment.lines() {
        let Some(name) = line.trim().strip_prefix("- name: CUSTOM_ROUTER_") else {
            continue;
        };
        let name = format!("CUSTOM_ROUTER_{name}");
        assert!(
            name == CONFIG_FILE_ENV || ENV_VARS.iter().any(|var| var.name == name),
            "deployment.yaml sets {name}, which the router does not read"
        );
    }
}
