//! The Kubernetes manifests in `k8s/`: every document carries what the API server and the
//! Kubeflow operator require; probes, ports, scrape annotations and grace periods agree
//! with the agent's own flags; and the agent, given exactly the environment the Kubeflow
//! v1 operator injects into a worker pod, resolves the rendezvous the manifest asks for.
//! Every document also matches the upstream schema of its kind (Kubernetes 1.31, Kubeflow
//! training-operator v1.9.0), as strictly as the API server's strict field validation.

// Not tests/schema.rs: cargo would build that as a test target of its own.
#[path = "k8s/schema.rs"]
mod schema;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use fsdp_tests::{TempDir, agent_bin, workspace_file};
use schema::Schemas;
use serde_json::{Value, json};

/// The agent's default `--status-addr` port and `--term-timeout`.
const DEFAULT_STATUS_PORT: u64 = 29450;
const DEFAULT_TERM_TIMEOUT_S: f64 = 30.0;

/// One YAML document of one manifest file.
struct Doc {
    file: String,
    value: Value,
}

impl Doc {
    fn kind(&self) -> &str {
        self.value["kind"].as_str().unwrap_or("")
    }

    fn name(&self) -> &str {
        self.value["metadata"]["name"].as_str().unwrap_or("")
    }

    fn what(&self) -> String {
        format!("{}: {} {}", self.file, self.kind(), self.name())
    }
}

fn manifest_files() -> Vec<PathBuf> {
    let dir = workspace_file("k8s");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("read k8s/")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no manifests in {}", dir.display());
    files
}

/// Every non-empty document of one file. Documents are separated by `---` lines, the only
/// separator the manifests use.
fn parse_file(path: &Path) -> Vec<Doc> {
    let text = std::fs::read_to_string(path).expect("read manifest");
    let file = format!("k8s/{}", path.file_name().unwrap().to_string_lossy());
    let mut docs = Vec::new();
    let mut chunk = String::new();
    let mut flush = |chunk: &mut String| {
        let value: Value = serde_yaml_ng::from_str(chunk)
            .unwrap_or_else(|e| panic!("{file}: not valid YAML: {e}"));
        chunk.clear();
        if !value.is_null() {
            assert!(value.is_object(), "{file}: a document is not a mapping");
            docs.push(Doc {
                file: file.clone(),
                value,
            });
        }
    };
    for line in text.lines() {
        if line.trim_end() == "---" {
            flush(&mut chunk);
        } else {
            chunk.push_str(line);
            chunk.push('\n');
        }
    }
    flush(&mut chunk);
    docs
}

fn all_docs() -> Vec<Doc> {
    manifest_files()
        .iter()
        .flat_map(|p| parse_file(p))
        .collect()
}

/// RFC 1123 label: what Kubernetes accepts for most object and container names.
fn dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// IANA service name: what a container port's `name` must be (at most 15 characters).
fn port_name(s: &str) -> bool {
    dns_label(s) && s.len() <= 15 && s.bytes().any(|b| b.is_ascii_lowercase()) && !s.contains("--")
}

fn as_port(v: &Value) -> Option<u64> {
    v.as_u64().filter(|p| (1..=65535).contains(p))
}

/// The pod templates of a workload, by a name for messages.
fn pod_templates(doc: &Doc) -> Vec<(String, &Value)> {
    let v = &doc.value;
    match doc.kind() {
        "Deployment" | "StatefulSet" | "Job" | "DaemonSet" => {
            vec![(doc.what(), &v["spec"]["template"])]
        }
        "PyTorchJob" => v["spec"]["pytorchReplicaSpecs"]
            .as_object()
            .map(|specs| {
                specs
                    .iter()
                    .map(|(role, spec)| (format!("{} {role}", doc.what()), &spec["template"]))
                    .collect()
            })
            .unwrap_or_default(),
        _ => Vec::new(),
    }
}

fn containers(template: &Value) -> Vec<&Value> {
    template["spec"]["containers"]
        .as_array()
        .map(|c| c.iter().collect())
        .unwrap_or_default()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|s| {
                    s.as_str()
                        .unwrap_or_else(|| panic!("not a string: {s} (quote numbers in args)"))
                        .to_owned()
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The value of `--flag V` or `--flag=V` in `args`, for any of the flag's spellings.
fn flag(args: &[String], names: &[&str]) -> Option<String> {
    for (i, a) in args.iter().enumerate() {
        for n in names {
            if a == n {
                return args.get(i + 1).cloned();
            }
            if let Some(v) = a.strip_prefix(&format!("{n}=")) {
                return Some(v.to_owned());
            }
        }
    }
    None
}

/// A literal `value` of the container's env.
fn env_value(container: &Value, name: &str) -> Option<String> {
    container["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str().map(str::to_owned))
}

/// The agent's arguments before the training program: the flags the agent reads.
fn agent_flags(args: &[String]) -> &[String] {
    let end = args
        .iter()
        .position(|a| a == "--no-python" || a == "--no_python")
        .unwrap_or(args.len());
    &args[..end]
}

/// The port the agent's status server listens on, as the agent resolves it.
fn status_port(container: &Value) -> Option<u64> {
    let args = strings(&container["args"]);
    let addr = flag(agent_flags(&args), &["--status-addr", "--status_addr"])
        .or_else(|| env_value(container, "FSDP_STATUS_ADDR"));
    match addr.as_deref() {
        None => Some(DEFAULT_STATUS_PORT),
        Some("off") => None,
        Some(a) => Some(
            a.rsplit_once(':')
                .and_then(|(_, p)| p.parse().ok())
                .unwrap_or_else(|| panic!("--status-addr {a} has no port")),
        ),
    }
}

/// Seconds of a `--term-timeout` value: `30`, `30s`, `500ms`, `2m`.
fn seconds(v: &str) -> f64 {
    let (num, scale) = if let Some(n) = v.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix('m') {
        (n, 60.0)
    } else {
        (v, 1.0)
    };
    num.trim()
        .parse::<f64>()
        .unwrap_or_else(|_| panic!("cannot read duration {v}"))
        * scale
}

/// The grace the agent gives its workers after SIGTERM, as the agent resolves it.
fn term_timeout(container: &Value) -> f64 {
    let args = strings(&container["args"]);
    flag(
        agent_flags(&args),
        &[
            "--term-timeout",
            "--term_timeout",
            "--shutdown-timeout",
            "--shutdown_timeout",
        ],
    )
    .or_else(|| env_value(container, "PET_SHUTDOWN_TIMEOUT"))
    .or_else(|| env_value(container, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"))
    .map_or(DEFAULT_TERM_TIMEOUT_S, |v| seconds(&v))
}

fn is_agent(container: &Value) -> bool {
    strings(&container["command"])
        .first()
        .is_some_and(|c| c == "fsdp-agent" || c.ends_with("/fsdp-agent"))
}

/// `$(VAR)` references in a string (kubelet's expansion syntax; `$$` escapes).
fn var_refs(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        let after = &rest[i + 1..];
        if let Some(a) = after.strip_prefix('$') {
            rest = a;
        } else if let Some(body) = after.strip_prefix('(') {
            match body.find(')') {
                Some(end) => {
                    out.push(body[..end].to_owned());
                    rest = &body[end + 1..];
                }
                None => break,
            }
        } else {
            rest = after;
        }
    }
    out
}

/// Expands `$(VAR)` as the kubelet does: defined variables are replaced, `$$` becomes `$`,
/// anything else stays as written.
fn expand(s: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(a) = after.strip_prefix('$') {
            out.push('$');
            rest = a;
        } else if let Some((name, tail)) = after
            .strip_prefix('(')
            .and_then(|b| b.split_once(')'))
            .filter(|(n, _)| env.contains_key(*n))
        {
            out.push_str(&env[name]);
            rest = tail;
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// The generic checks every container gets; returns its port names and numbers.
fn check_container(what: &str, c: &Value, volumes: &BTreeSet<String>) -> BTreeMap<String, u64> {
    let name = c["name"].as_str().unwrap_or("");
    assert!(
        dns_label(name),
        "{what}: container name '{name}' is not a DNS label"
    );
    let what = format!("{what} container {name}");
    let image = c["image"].as_str().unwrap_or("");
    assert!(!image.is_empty(), "{what}: no image");
    assert!(
        !image.contains(char::is_whitespace),
        "{what}: image '{image}' has spaces"
    );

    let mut ports = BTreeMap::new();
    for p in c["ports"].as_array().into_iter().flatten() {
        let n = as_port(&p["containerPort"])
            .unwrap_or_else(|| panic!("{what}: bad containerPort {}", p["containerPort"]));
        if let Some(pn) = p["name"].as_str() {
            assert!(
                port_name(pn),
                "{what}: port name '{pn}' is not a valid (<= 15 chars) name"
            );
            assert!(
                ports.insert(pn.to_owned(), n).is_none(),
                "{what}: port name {pn} twice"
            );
        }
    }

    let mut env_names = BTreeSet::new();
    for e in c["env"].as_array().into_iter().flatten() {
        let n = e["name"].as_str().unwrap_or("");
        assert!(!n.is_empty(), "{what}: env entry without a name");
        assert!(env_names.insert(n.to_owned()), "{what}: env {n} twice");
        let literal = e.get("value").is_some();
        let from = e.get("valueFrom").is_some();
        assert!(
            literal != from,
            "{what}: env {n} needs exactly one of value, valueFrom"
        );
        if literal {
            assert!(
                e["value"].is_string(),
                "{what}: env {n} must be a string (quote it)"
            );
        }
    }
    // The kubelet leaves an undefined $(VAR) in the command line as it is: a silent bug.
    for s in strings(&c["command"]).iter().chain(&strings(&c["args"])) {
        for r in var_refs(s) {
            assert!(
                env_names.contains(&r),
                "{what}: '{s}' uses $({r}), which env does not define"
            );
        }
    }

    for m in c["volumeMounts"].as_array().into_iter().flatten() {
        let v = m["name"].as_str().unwrap_or("");
        assert!(volumes.contains(v), "{what}: volumeMount {v} has no volume");
        assert!(
            m["mountPath"].as_str().is_some_and(|p| p.starts_with('/')),
            "{what}: volumeMount {v} needs an absolute mountPath"
        );
    }

    for probe in ["livenessProbe", "readinessProbe", "startupProbe"] {
        let p = &c[probe];
        if p.is_null() {
            continue;
        }
        let handlers: Vec<&str> = ["httpGet", "tcpSocket", "grpc", "exec"]
            .into_iter()
            .filter(|h| !p[*h].is_null())
            .collect();
        assert_eq!(
            handlers.len(),
            1,
            "{what}: {probe} needs exactly one handler"
        );
        let port = &p[handlers[0]]["port"];
        match handlers[0] {
            // gRPC probes take a number only.
            "grpc" => assert!(as_port(port).is_some(), "{what}: {probe} grpc port {port}"),
            "exec" => {}
            _ => match port.as_str() {
                Some(named) => assert!(
                    ports.contains_key(named),
                    "{what}: {probe} uses port {named}, which the container does not name"
                ),
                None => assert!(as_port(port).is_some(), "{what}: {probe} port {port}"),
            },
        }
    }
    ports
}

/// The volumes a pod template defines (plus a StatefulSet's claim templates).
fn volumes(doc: &Doc, template: &Value) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for v in template["spec"]["volumes"].as_array().into_iter().flatten() {
        let n = v["name"].as_str().unwrap_or("");
        assert!(dns_label(n), "{}: volume name '{n}'", doc.what());
        assert!(out.insert(n.to_owned()), "{}: volume {n} twice", doc.what());
    }
    for v in doc.value["spec"]["volumeClaimTemplates"]
        .as_array()
        .into_iter()
        .flatten()
    {
        out.insert(v["metadata"]["name"].as_str().unwrap_or("").to_owned());
    }
    out
}

/// Checks for a container that runs `fsdp-agent`: probes, ports and the grace period agree
/// with the agent's flags.
fn check_agent_container(what: &str, template: &Value, c: &Value, ports: &BTreeMap<String, u64>) {
    let port = status_port(c)
        .unwrap_or_else(|| panic!("{what}: --status-addr off leaves nothing for the probes"));
    assert!(
        ports.values().any(|p| *p == port),
        "{what}: the status port {port} is not a containerPort"
    );

    let live = &c["livenessProbe"]["grpc"];
    assert_eq!(
        live["port"], port,
        "{what}: livenessProbe must be gRPC on the status port"
    );
    let svc = live["service"].as_str().unwrap_or("");
    assert!(
        svc.is_empty() || svc == "liveness",
        "{what}: liveness probe asks for health service '{svc}'"
    );
    let ready = &c["readinessProbe"]["grpc"];
    assert_eq!(
        ready["port"], port,
        "{what}: readinessProbe must be gRPC on the status port"
    );
    assert_eq!(
        ready["service"], "readiness",
        "{what}: readinessProbe must ask for the 'readiness' health service"
    );

    let ann = &template["metadata"]["annotations"];
    if ann["prometheus.io/scrape"] == "true" {
        assert_eq!(
            ann["prometheus.io/port"],
            port.to_string(),
            "{what}: prometheus.io/port must be the status port"
        );
        assert_eq!(ann["prometheus.io/path"], "/metrics", "{what}: scrape path");
    }

    // The kubelet SIGKILLs the container when the grace period ends: it must outlast the
    // agent's own SIGTERM → SIGKILL grace for the workers, plus time to leave the run.
    let term = term_timeout(c);
    let grace = template["spec"]["terminationGracePeriodSeconds"]
        .as_f64()
        .unwrap_or(30.0);
    assert!(
        grace >= term + 5.0,
        "{what}: terminationGracePeriodSeconds {grace} must exceed --term-timeout {term} by a margin"
    );

    // An advertised address from the downward API must come from the pod's IP.
    let args = strings(&c["args"]);
    if let Some(addr) = flag(agent_flags(&args), &["--local-addr", "--local_addr"]) {
        for r in var_refs(&addr) {
            let e = c["env"]
                .as_array()
                .and_then(|env| env.iter().find(|e| e["name"] == r.as_str()))
                .unwrap();
            assert_eq!(
                e["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP",
                "{what}: --local-addr $({r}) must be the pod IP"
            );
        }
    }

    // The container default of 64 MiB /dev/shm is too small for PyTorch.
    let shm = c["volumeMounts"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m["mountPath"] == "/dev/shm"))
        .unwrap_or_else(|| panic!("{what}: no volume at /dev/shm"));
    let vol = template["spec"]["volumes"]
        .as_array()
        .and_then(|v| v.iter().find(|v| v["name"] == shm["name"]))
        .unwrap();
    assert_eq!(
        vol["emptyDir"]["medium"], "Memory",
        "{what}: /dev/shm must be an emptyDir in memory"
    );
}

fn labels_match(selector: &Value, labels: &Value) -> bool {
    selector
        .as_object()
        .is_some_and(|s| !s.is_empty() && s.iter().all(|(k, v)| labels[k] == *v))
}

#[test]
fn every_manifest_has_the_fields_kubernetes_requires() {
    let docs = all_docs();
    let mut seen = BTreeSet::new();
    for doc in &docs {
        let v = &doc.value;
        let api = v["apiVersion"].as_str().unwrap_or("");
        assert!(!api.is_empty(), "{}: no apiVersion", doc.file);
        assert!(!doc.kind().is_empty(), "{}: no kind", doc.file);
        assert!(
            dns_label(doc.name()),
            "{}: metadata.name '{}' is not a DNS label",
            doc.what(),
            doc.name()
        );
        let expected_api = match doc.kind() {
            "Service" => Some("v1"),
            "Deployment" | "StatefulSet" => Some("apps/v1"),
            "PyTorchJob" => Some("kubeflow.org/v1"),
            _ => None,
        };
        if let Some(e) = expected_api {
            assert_eq!(api, e, "{}: apiVersion", doc.what());
        }
        // The same object twice in one file would be applied twice.
        assert!(
            seen.insert((
                doc.file.clone(),
                doc.kind().to_owned(),
                doc.name().to_owned()
            )),
            "{} defined twice",
            doc.what()
        );

        for (what, template) in pod_templates(doc) {
            assert!(template.is_object(), "{what}: no pod template");
            let vols = volumes(doc, template);
            let cs = containers(template);
            assert!(!cs.is_empty(), "{what}: no containers");
            for c in cs {
                let ports = check_container(&what, c, &vols);
                if is_agent(c) {
                    check_agent_container(&what, template, c, &ports);
                }
            }
        }

        match doc.kind() {
            "Deployment" | "StatefulSet" => {
                let sel = &v["spec"]["selector"]["matchLabels"];
                let labels = &v["spec"]["template"]["metadata"]["labels"];
                assert!(
                    labels_match(sel, labels),
                    "{}: selector {sel} does not match the template labels {labels}",
                    doc.what()
                );
            }
            "Service" => {
                let ports = v["spec"]["ports"].as_array();
                assert!(
                    ports.is_some_and(|p| !p.is_empty()),
                    "{}: no ports",
                    doc.what()
                );
                for p in ports.into_iter().flatten() {
                    assert!(
                        as_port(&p["port"]).is_some(),
                        "{}: port {}",
                        doc.what(),
                        p["port"]
                    );
                }
            }
            _ => {}
        }
    }
}

#[test]
fn services_and_statefulsets_point_at_each_other() {
    let files = manifest_files();
    for path in files {
        // Objects that are applied together, from one file.
        let docs = parse_file(&path);
        let workloads: Vec<&Doc> = docs
            .iter()
            .filter(|d| matches!(d.kind(), "Deployment" | "StatefulSet"))
            .collect();
        for svc in docs.iter().filter(|d| d.kind() == "Service") {
            let sel = &svc.value["spec"]["selector"];
            let targets: Vec<&&Doc> = workloads
                .iter()
                .filter(|w| labels_match(sel, &w.value["spec"]["template"]["metadata"]["labels"]))
                .collect();
            assert!(
                !targets.is_empty(),
                "{}: selector {sel} matches no pods",
                svc.what()
            );
            for p in svc.value["spec"]["ports"].as_array().into_iter().flatten() {
                let Some(named) = p["targetPort"].as_str() else {
                    continue;
                };
                for w in &targets {
                    let names: Vec<&Value> = containers(&w.value["spec"]["template"])
                        .iter()
                        .flat_map(|c| c["ports"].as_array().into_iter().flatten())
                        .map(|p| &p["name"])
                        .collect();
                    assert!(
                        names.iter().any(|n| *n == named),
                        "{}: targetPort {named} is not a port of {}",
                        svc.what(),
                        w.what()
                    );
                }
            }
        }
        for sts in docs.iter().filter(|d| d.kind() == "StatefulSet") {
            let svc_name = sts.value["spec"]["serviceName"].as_str().unwrap_or("");
            let svc = docs
                .iter()
                .find(|d| d.kind() == "Service" && d.name() == svc_name)
                .unwrap_or_else(|| {
                    panic!("{}: serviceName '{svc_name}' is not defined", sts.what())
                });
            assert_eq!(
                svc.value["spec"]["clusterIP"],
                "None",
                "{}: a StatefulSet's governing Service must be headless",
                sts.what()
            );
        }
    }
}

/// The PyTorchJobs of `k8s/`, with their file.
fn pytorch_jobs() -> Vec<Doc> {
    let jobs: Vec<Doc> = all_docs()
        .into_iter()
        .filter(|d| d.kind() == "PyTorchJob")
        .collect();
    assert!(!jobs.is_empty(), "no PyTorchJob in k8s/");
    jobs
}

#[test]
fn pytorchjobs_are_elastic_on_etcd_and_find_a_shipped_etcd() {
    let services: Vec<Doc> = all_docs()
        .into_iter()
        .filter(|d| d.kind() == "Service")
        .collect();
    for job in pytorch_jobs() {
        let what = job.what();
        let spec = &job.value["spec"];
        let worker = &spec["pytorchReplicaSpecs"]["Worker"];
        assert!(worker["template"].is_object(), "{what}: no Worker template");
        // The operator's webhook insists on a container named `pytorch`.
        let c = containers(&worker["template"])
            .into_iter()
            .find(|c| c["name"] == "pytorch")
            .unwrap_or_else(|| panic!("{what}: no container named pytorch"));
        assert!(
            is_agent(c),
            "{what}: the pytorch container must run fsdp-agent"
        );
        assert!(
            matches!(
                worker["restartPolicy"].as_str(),
                None | Some("Always" | "OnFailure" | "Never" | "ExitCode")
            ),
            "{what}: restartPolicy {}",
            worker["restartPolicy"]
        );

        let ep = &spec["elasticPolicy"];
        assert_eq!(ep["rdzvBackend"], "etcd", "{what}: rdzvBackend");
        assert!(
            ep["rdzvId"].as_str().is_some_and(|s| !s.is_empty()),
            "{what}: rdzvId must be set (the agent refuses to share a default)"
        );
        let (min, max) = (ep["minReplicas"].as_u64(), ep["maxReplicas"].as_u64());
        let replicas = worker["replicas"].as_u64().unwrap_or(1);
        if let (Some(min), Some(max)) = (min, max) {
            assert!(
                min >= 1 && min <= max,
                "{what}: minReplicas {min} maxReplicas {max}"
            );
            assert!(
                (min..=max).contains(&replicas),
                "{what}: Worker replicas {replicas} outside {min}..={max}"
            );
        }
        assert!(
            spec["nprocPerNode"].is_string(),
            "{what}: spec.nprocPerNode must be a string"
        );

        // rdzvHost:rdzvPort is a Service shipped in k8s/ with that port.
        let host = ep["rdzvHost"].as_str().unwrap_or("");
        let port = ep["rdzvPort"].as_u64();
        let found = services.iter().any(|s| {
            s.name() == host
                && s.value["spec"]["ports"]
                    .as_array()
                    .is_some_and(|ps| ps.iter().any(|p| p["port"].as_u64() == port))
        });
        assert!(
            found,
            "{what}: no Service {host} with port {port:?} in k8s/"
        );
    }
}

/// What the Kubeflow training operator (v1, `setPodEnv`) injects into a worker container
/// of an elastic job, computed from the job.
fn operator_env(job: &Value, container: &Value) -> BTreeMap<String, String> {
    let spec = &job["spec"];
    let specs = &spec["pytorchReplicaSpecs"];
    let mut env = BTreeMap::new();
    env.insert("PYTHONUNBUFFERED".into(), "1".into());
    // MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK and PET_NODE_RANK only come with a Master.
    assert!(
        specs["Master"].is_null(),
        "the elastic jobs here are worker-only: node ranks come from the rendezvous"
    );
    // The defaulter sets nprocPerNode to `auto` when neither it nor the deprecated
    // elasticPolicy.nProcPerNode is given.
    let nproc = spec["nprocPerNode"].as_str().unwrap_or("auto");
    env.insert("PET_NPROC_PER_NODE".into(), nproc.into());

    let ep = &spec["elasticPolicy"];
    assert!(ep.is_object(), "not an elastic job");
    let replicas = specs["Worker"]["replicas"].as_u64().unwrap_or(1);
    let (min, max) = match (ep["minReplicas"].as_u64(), ep["maxReplicas"].as_u64()) {
        (Some(a), Some(b)) => (a, b),
        (Some(a), None) | (None, Some(a)) => (a, a),
        (None, None) => (replicas, replicas),
    };
    env.insert("PET_NNODES".into(), format!("{min}:{max}"));

    let job_name = job["metadata"]["name"].as_str().unwrap();
    let host = ep["rdzvHost"]
        .as_str()
        .map_or_else(|| format!("{job_name}-worker-0"), str::to_owned);
    let named_port = container["ports"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "pytorchjob-port"))
        .and_then(|p| p["containerPort"].as_u64());
    let port = ep["rdzvPort"].as_u64().or(named_port).unwrap_or(23456);
    env.insert("PET_RDZV_ENDPOINT".into(), format!("{host}:{port}"));
    env.insert(
        "PET_RDZV_BACKEND".into(),
        ep["rdzvBackend"].as_str().unwrap_or("c10d").into(),
    );
    if let Some(n) = ep["maxRestarts"].as_u64() {
        env.insert("PET_MAX_RESTARTS".into(), n.to_string());
    }
    if let Some(id) = ep["rdzvId"].as_str() {
        env.insert("PET_RDZV_ID".into(), id.into());
    }
    if let Some(conf) = ep["rdzvConf"].as_array() {
        let joined: Vec<String> = conf
            .iter()
            .map(|kv| {
                format!(
                    "{}={}",
                    kv["key"].as_str().unwrap(),
                    kv["value"].as_str().unwrap()
                )
            })
            .collect();
        env.insert("PET_RDZV_CONF".into(), joined.join(","));
    }
    if ep["standalone"] == true {
        env.insert("PET_STANDALONE".into(), String::new());
    }
    env
}

/// The container's own env as the kubelet resolves it in one made-up pod; the downward
/// API gives that pod's fields.
fn container_env(container: &Value, pod_ip: &str) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for e in container["env"].as_array().into_iter().flatten() {
        let name = e["name"].as_str().unwrap().to_owned();
        let value = if let Some(v) = e["value"].as_str() {
            expand(v, &env)
        } else {
            match e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                Some("metadata.name") => "fsdp-job-worker-1".into(),
                Some("metadata.namespace") => "default".into(),
                Some("metadata.uid") => "3f1c2a9e-5b7d-4c1e-9a0b-2d6e8f4a7c31".into(),
                Some("status.podIP") => pod_ip.into(),
                Some("spec.nodeName") => "node-a".into(),
                // The made-up pod carries the zone label (copied from its node).
                Some("metadata.labels['topology.kubernetes.io/zone']") => "us-east-1a".into(),
                other => panic!("env {name}: no stand-in for fieldRef {other:?}"),
            }
        };
        env.insert(name, value);
    }
    env
}

/// Runs `fsdp-agent --print-config --log-format json <args>` with exactly `env` (and a
/// PATH holding a stand-in `fsdp-trainer`) and returns the parsed JSON.
fn print_config(args: &[String], env: &BTreeMap<String, String>) -> Value {
    let dir = TempDir::new().unwrap();
    // The image has the real trainer in /usr/local/bin; --no-python only needs one on PATH.
    let trainer = dir.path().join("fsdp-trainer");
    std::fs::write(&trainer, "#!/bin/sh\nexit 0\n").unwrap();
    let mut perms = std::fs::metadata(&trainer).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&trainer, perms).unwrap();

    // Nothing from the test runner's environment (PET_*, MASTER_*, TORCHELASTIC_*, FSDP_*)
    // may leak in: the pod sees the operator's variables and its own, nothing else.
    let out = Command::new(agent_bin())
        .env_clear()
        .envs(env)
        .env("PATH", format!("{}:/usr/bin:/bin", dir.path().display()))
        .args(["--print-config", "--log-format", "json"])
        .args(args)
        .output()
        .expect("run fsdp-agent");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "fsdp-agent --print-config {args:?} failed: {}\n{stdout}\n{stderr}",
        out.status
    );
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not JSON ({e}):\n{stdout}"))
}

/// `name → (value, source)` of the printed settings.
fn settings(cfg: &Value) -> BTreeMap<String, (String, String)> {
    cfg["settings"]
        .as_array()
        .expect("settings")
        .iter()
        .map(|s| {
            (
                s["name"].as_str().unwrap().to_owned(),
                (
                    s["value"].as_str().unwrap().to_owned(),
                    s["source"].as_str().unwrap().to_owned(),
                ),
            )
        })
        .collect()
}

#[test]
fn the_agent_resolves_the_operator_env_of_every_pytorchjob() {
    let cpu_checked = pytorch_jobs()
        .iter()
        .any(|j| j.file == "k8s/pytorchjob-cpu.yaml");
    assert!(cpu_checked, "k8s/pytorchjob-cpu.yaml has no PyTorchJob");
    for job in pytorch_jobs() {
        let what = job.what();
        let c = containers(&job.value["spec"]["pytorchReplicaSpecs"]["Worker"]["template"])
            .into_iter()
            .find(|c| c["name"] == "pytorch")
            .unwrap();
        let pod_ip = "10.244.1.17";
        let mut env = container_env(c, pod_ip);
        let injected = operator_env(&job.value, c);
        for k in injected.keys() {
            assert!(
                !env.contains_key(k),
                "{what}: the container sets {k}, which the operator owns"
            );
        }
        env.extend(injected.clone());
        for k in [
            "MASTER_ADDR",
            "MASTER_PORT",
            "WORLD_SIZE",
            "RANK",
            "PET_NODE_RANK",
        ] {
            assert!(
                !env.contains_key(k),
                "{what}: {k} in a worker-only elastic job"
            );
        }
        let args: Vec<String> = strings(&c["args"])
            .iter()
            .map(|a| expand(a, &env))
            .collect();

        let cfg = print_config(&args, &env);
        let set = settings(&cfg);
        let get = |name: &str| -> (&str, &str) {
            let (v, s) = set
                .get(name)
                .unwrap_or_else(|| panic!("{what}: {name} not printed:\n{cfg:#}"));
            (v.as_str(), s.as_str())
        };
        let ep = &job.value["spec"]["elasticPolicy"];

        // Every rendezvous setting comes from the operator's PET_* variables.
        assert_eq!(
            get("rdzv-backend"),
            ("etcd", "env PET_RDZV_BACKEND"),
            "{what}"
        );
        assert_eq!(
            get("nnodes"),
            (injected["PET_NNODES"].as_str(), "env PET_NNODES"),
            "{what}"
        );
        let (min, max) = (
            ep["minReplicas"].as_u64().unwrap(),
            ep["maxReplicas"].as_u64().unwrap(),
        );
        assert_eq!(injected["PET_NNODES"], format!("{min}:{max}"));
        assert_eq!(
            get("rdzv-endpoint"),
            (
                format!("{}:{}", ep["rdzvHost"].as_str().unwrap(), ep["rdzvPort"]).as_str(),
                "env PET_RDZV_ENDPOINT"
            ),
            "{what}"
        );
        assert_eq!(cfg["run_id"], ep["rdzvId"], "{what}");
        assert_eq!(get("rdzv-id").1, "env PET_RDZV_ID", "{what}");
        let nproc: u64 = job.value["spec"]["nprocPerNode"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(cfg["nproc_per_node"], nproc, "{what}");
        assert_eq!(get("nproc-per-node").1, "env PET_NPROC_PER_NODE", "{what}");
        assert_eq!(cfg["max_restarts"], ep["maxRestarts"], "{what}");
        assert_eq!(get("max-restarts").1, "env PET_MAX_RESTARTS", "{what}");
        assert_eq!(get("rdzv-conf").1, "env PET_RDZV_CONF", "{what}");

        // The etcd rendezvous the agent will run: the endpoint, the bounds, the pod IP it
        // advertises (from --local-addr $(POD_IP)) and the lease TTL from rdzvConf.
        let (rdzv, _) = get("rendezvous");
        let expected = format!(
            "etcd endpoints={}:{} nnodes={min}:{max} addr={pod_ip}",
            ep["rdzvHost"].as_str().unwrap(),
            ep["rdzvPort"]
        );
        assert!(
            rdzv.starts_with(&expected),
            "{what}: rendezvous '{rdzv}', expected '{expected}…'"
        );
        for kv in ep["rdzvConf"].as_array().into_iter().flatten() {
            if kv["key"] == "keep_alive_ttl" {
                let ttl = format!("lease_ttl={}s", kv["value"].as_str().unwrap());
                assert!(
                    rdzv.contains(&ttl),
                    "{what}: rendezvous '{rdzv}' lacks {ttl}"
                );
            }
        }

        // The pod's place, from its label through the downward API.
        if env.contains_key("FSDP_AGENT_SEGMENT") {
            assert_eq!(
                get("segment"),
                (env["FSDP_AGENT_SEGMENT"].as_str(), "env FSDP_AGENT_SEGMENT"),
                "{what}"
            );
        }

        // The flags the manifest passes the agent itself.
        assert_eq!(
            get("status-addr"),
            (
                format!("0.0.0.0:{}", status_port(c).unwrap()).as_str(),
                "flag --status-addr"
            ),
            "{what}"
        );
        let (term, src) = get("term-timeout");
        assert_eq!(seconds(term), term_timeout(c), "{what}");
        assert_eq!(src, "flag --term-timeout", "{what}");
        // The trainer, found on PATH, with the manifest's arguments unchanged.
        let program = args.iter().position(|a| a == "fsdp-trainer").unwrap();
        let (entry, _) = get("entrypoint");
        let (path, rest) = entry.split_once(' ').unwrap_or((entry, ""));
        assert!(
            path.ends_with("/fsdp-trainer"),
            "{what}: entrypoint {entry}"
        );
        assert_eq!(
            rest,
            args[program + 1..].join(" "),
            "{what}: trainer arguments"
        );
        assert_eq!(cfg["warnings"], serde_json::json!([]), "{what}: warnings");
    }
}

#[test]
fn docs_name_only_manifests_that_exist() {
    let shipped: BTreeSet<String> = manifest_files()
        .iter()
        .map(|p| format!("k8s/{}", p.file_name().unwrap().to_string_lossy()))
        .collect();
    for doc in [
        "docs/kubernetes.md",
        "docs/troubleshooting.md",
        "docs/architecture.md",
    ] {
        let text = std::fs::read_to_string(workspace_file(doc)).unwrap();
        for word in text.split(|c: char| c.is_whitespace() || "`()[]<>\"',;".contains(c)) {
            let Some(at) = word.find("k8s/") else {
                continue;
            };
            let name = word[at..].trim_end_matches(['.', ':']);
            if name.ends_with(".yaml") || name.ends_with(".yml") {
                assert!(
                    shipped.contains(name),
                    "{doc} names {name}, which k8s/ does not have"
                );
            }
        }
    }
}

#[test]
fn every_manifest_document_matches_its_upstream_schema() {
    let schemas = Schemas::get();
    let mut failures = Vec::new();
    for doc in all_docs() {
        for e in schemas.check(&doc.value) {
            failures.push(format!("{}: {e}", doc.what()));
        }
    }
    assert!(
        failures.is_empty(),
        "manifests the API server would refuse:\n{}",
        failures.join("\n")
    );
}

/// The first document of `kind` in `k8s/<file>`.
fn manifest_doc(file: &str, kind: &str) -> Value {
    parse_file(&workspace_file(&format!("k8s/{file}")))
        .into_iter()
        .find(|d| d.kind() == kind)
        .unwrap_or_else(|| panic!("no {kind} in k8s/{file}"))
        .value
}

/// Renames the field at JSON pointer `at` to `to`, keeping its value.
fn rename(doc: &mut Value, at: &str, to: &str) {
    let (parent, name) = at.rsplit_once('/').unwrap();
    let obj = doc
        .pointer_mut(parent)
        .and_then(Value::as_object_mut)
        .unwrap_or_else(|| panic!("{parent} is not a mapping"));
    let value = obj.remove(name).unwrap_or_else(|| panic!("no {at}"));
    obj.insert(to.to_owned(), value);
}

/// Sets the field at JSON pointer `at`.
fn set(doc: &mut Value, at: &str, value: Value) {
    *doc.pointer_mut(at).unwrap_or_else(|| panic!("no {at}")) = value;
}

/// Asserts that `doc` fails the schema check with an error on the field `path`.
fn assert_refused(doc: &Value, path: &str) {
    let errors = Schemas::get().check(doc);
    assert!(
        errors.iter().any(|e| e.starts_with(&format!("{path}: "))),
        "expected an error on {path}, got: {errors:#?}"
    );
}

#[test]
fn a_misspelled_field_fails_the_schema_check_naming_its_path() {
    let cases = [
        (
            "pytorchjob-cpu.yaml",
            "PyTorchJob",
            "/spec/pytorchReplicaSpecs",
            "pytorchReplicaSpec",
            "spec.pytorchReplicaSpec",
        ),
        (
            "pytorchjob-cpu.yaml",
            "PyTorchJob",
            "/spec/pytorchReplicaSpecs/Worker/template/spec/containers/0/image",
            "imagee",
            "spec.pytorchReplicaSpecs.Worker.template.spec.containers[0].imagee",
        ),
        (
            "pytorchjob-gpu.yaml",
            "PyTorchJob",
            "/spec/elasticPolicy/rdzvBackend",
            "rdzvBackEnd",
            "spec.elasticPolicy.rdzvBackEnd",
        ),
        // A custom resource's metadata is checked as the ObjectMeta it is.
        (
            "pytorchjob-gpu.yaml",
            "PyTorchJob",
            "/metadata/labels",
            "lables",
            "metadata.lables",
        ),
        (
            "etcd.yaml",
            "StatefulSet",
            "/spec/volumeClaimTemplates/0/spec/accessModes",
            "accessMode",
            "spec.volumeClaimTemplates[0].spec.accessMode",
        ),
        (
            "etcd.yaml",
            "Service",
            "/spec/ports/0/targetPort",
            "targetport",
            "spec.ports[0].targetport",
        ),
        (
            "etcd-deployment.yaml",
            "Deployment",
            "/spec/template/spec/containers/0/livenessProbe/httpGet",
            "httpget",
            "spec.template.spec.containers[0].livenessProbe.httpget",
        ),
    ];
    for (file, kind, at, to, path) in cases {
        let mut doc = manifest_doc(file, kind);
        assert!(
            Schemas::get().check(&doc).is_empty(),
            "k8s/{file} {kind} must pass as shipped"
        );
        rename(&mut doc, at, to);
        assert_refused(&doc, path);
    }
    // The CRD leaves the misspelled Worker field to be pruned; the pods made from it are
    // refused too.
    let mut job = manifest_doc("pytorchjob-cpu.yaml", "PyTorchJob");
    rename(
        &mut job,
        "/spec/pytorchReplicaSpecs/Worker/template/spec/containers/0/image",
        "imagee",
    );
    let errors = Schemas::get().check(&job);
    assert!(
        errors.iter().any(|e| e.contains("core/v1 PodTemplateSpec")),
        "{errors:#?}"
    );
}

#[test]
fn quantities_and_int_or_strings_are_read_as_the_api_server_reads_them() {
    let job = manifest_doc("pytorchjob-gpu.yaml", "PyTorchJob");
    let gpu = "/spec/pytorchReplicaSpecs/Worker/template/spec/containers/0/resources/limits";
    let sts = manifest_doc("etcd.yaml", "StatefulSet");
    let etcd = "/spec/template/spec/containers/0";
    let svc = manifest_doc("etcd-deployment.yaml", "Service");

    // Refused: not a quantity, not an int-or-string, not an int32, not an integer.
    let refused = [
        (
            &job,
            format!("{gpu}/memory"),
            json!("1500GB"),
            "spec.pytorchReplicaSpecs.Worker.template.spec.containers[0].resources.limits.memory",
        ),
        (
            &sts,
            format!("{etcd}/resources/requests/memory"),
            json!("128 Mi"),
            "spec.template.spec.containers[0].resources.requests.memory",
        ),
        (
            &sts,
            format!("{etcd}/resources/limits/memory"),
            json!(true),
            "spec.template.spec.containers[0].resources.limits.memory",
        ),
        (
            &svc,
            "/spec/ports/0/targetPort".to_owned(),
            json!(2379.5),
            "spec.ports[0].targetPort",
        ),
        (
            &svc,
            "/spec/ports/0/targetPort".to_owned(),
            json!(4_294_967_296_u64),
            "spec.ports[0].targetPort",
        ),
        (
            &sts,
            format!("{etcd}/ports/0/containerPort"),
            json!(4_294_967_296_u64),
            "spec.template.spec.containers[0].ports[0].containerPort",
        ),
        (
            &sts,
            "/spec/replicas".to_owned(),
            json!("1"),
            "spec.replicas",
        ),
        (
            &job,
            "/spec/pytorchReplicaSpecs/Worker/replicas".to_owned(),
            json!("4"),
            "spec.pytorchReplicaSpecs.Worker.replicas",
        ),
    ];
    for (doc, at, value, path) in refused {
        let mut doc = doc.clone();
        set(&mut doc, &at, value.clone());
        assert_refused(&doc, path);
    }

    // Accepted: every spelling the API server decodes.
    let accepted = [
        (&job, format!("{gpu}/memory"), json!("1.5Ti")),
        (&job, format!("{gpu}/memory"), json!("1e12")),
        (&job, format!("{gpu}/nvidia.com~1gpu"), json!("8")),
        (&sts, format!("{etcd}/resources/requests/cpu"), json!(0.5)),
        (&sts, format!("{etcd}/resources/requests/cpu"), json!(".5")),
        (
            &sts,
            format!("{etcd}/resources/requests/memory"),
            json!(134_217_728),
        ),
        (
            &svc,
            "/spec/ports/0/targetPort".to_owned(),
            json!("etcd-client"),
        ),
        (&svc, "/spec/ports/0/targetPort".to_owned(), json!(2379)),
    ];
    for (doc, at, value) in accepted {
        let mut doc = doc.clone();
        set(&mut doc, &at, value.clone());
        let errors = Schemas::get().check(&doc);
        assert!(errors.is_empty(), "{at} = {value}: {errors:#?}");
    }
}

#[test]
fn a_kind_without_a_vendored_schema_fails_naming_it() {
    let job = json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "x"},
    });
    let errors = Schemas::get().check(&job);
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert!(
        errors[0].starts_with("batch/v1 Job: no vendored schema"),
        "{}",
        errors[0]
    );
}
