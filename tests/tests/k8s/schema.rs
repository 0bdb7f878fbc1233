//! The upstream schemas of the kinds `k8s/` uses (vendored in `tests/data/k8s-schemas`,
//! see its README), applied as the API server would with strict field validation
//! (`kubectl apply --validate=strict`): a field no schema names is an error, and
//! quantities and int-or-strings are read by Kubernetes' own grammar.

use std::sync::LazyLock;

use fsdp_tests::workspace_file;
use jsonschema::error::ValidationErrorKind;
use jsonschema::{Registry, Validator};
use serde_json::{Value, json};

const SCHEMAS: &str = "tests/data/k8s-schemas";
const KUBERNETES: &str = "kubernetes-v1.31.0-strict";
/// The `$id` of Kubernetes' shared definitions, which the kinds' `$ref`s name.
const DEFINITIONS: &str = "https://kubernetes.io/api/_definitions.json";

/// A kind `k8s/` may use: its `apiVersion`, `kind` and schema file under [`SCHEMAS`].
const KINDS: &[(&str, &str, &str)] = &[
    ("v1", "Service", "kubernetes-v1.31.0-strict/service-v1.json"),
    (
        "apps/v1",
        "Deployment",
        "kubernetes-v1.31.0-strict/deployment-apps-v1.json",
    ),
    (
        "apps/v1",
        "StatefulSet",
        "kubernetes-v1.31.0-strict/statefulset-apps-v1.json",
    ),
    (
        "kubeflow.org/v1",
        "PyTorchJob",
        "kubeflow-training-operator-v1.9.0/pytorchjob-kubeflow.org-v1.json",
    ),
];

/// resource.Quantity as the API server reads it (the pattern Kubernetes gives quantities
/// in CRD schemas): a decimal, then a binary (Ki..Ei) or decimal (n, u, m, k, M..E) suffix
/// or an exponent. `1Gi`, `100m`, `1e3`; not `1GB` nor `1 Gi`.
pub const QUANTITY: &str = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$";

/// A quantity: a JSON number also decodes (`nvidia.com/gpu: 8`), a string must parse.
pub fn quantity_schema() -> Value {
    json!({"anyOf": [{"type": "number"}, {"type": "string", "pattern": QUANTITY}]})
}

/// An IntOrString: a JSON string, or an integer that fits the int32 it decodes into.
pub fn int_or_string_schema() -> Value {
    json!({"anyOf": [
        {"type": "integer", "minimum": i32::MIN, "maximum": i32::MAX},
        {"type": "string"},
    ]})
}

/// Makes a schema as strict as the API server with strict field validation:
/// - an object schema that lists `properties` and says nothing of others gets
///   `additionalProperties: false` (the server prunes, and under strict validation
///   rejects, such fields), unless it keeps unknown fields
///   (`x-kubernetes-preserve-unknown-fields`);
/// - an `int32` integer gets int32's bounds (a larger number does not decode).
///
/// Walks subschemas only, so a property that happens to be named `properties` is safe.
pub fn strict(schema: &mut Value) {
    let Some(obj) = schema.as_object_mut() else {
        return;
    };
    let keeps_unknown = obj.get("x-kubernetes-preserve-unknown-fields") == Some(&json!(true));
    if obj.contains_key("properties") && !obj.contains_key("additionalProperties") && !keeps_unknown
    {
        obj.insert("additionalProperties".into(), json!(false));
    }
    if obj.get("format") == Some(&json!("int32")) {
        obj.entry("minimum").or_insert(json!(i32::MIN));
        obj.entry("maximum").or_insert(json!(i32::MAX));
    }
    for key in ["properties", "patternProperties", "$defs", "definitions"] {
        for sub in obj.get_mut(key).and_then(Value::as_object_mut).into_iter() {
            sub.values_mut().for_each(strict);
        }
    }
    for key in ["items", "additionalProperties", "not"] {
        if let Some(sub) = obj.get_mut(key) {
            strict(sub);
        }
    }
    for key in ["allOf", "anyOf", "oneOf", "prefixItems"] {
        for sub in obj.get_mut(key).and_then(Value::as_array_mut).into_iter() {
            sub.iter_mut().for_each(strict);
        }
    }
}

/// A JSON pointer into `instance` as a manifest reader writes it:
/// `/spec/template/spec/containers/0` → `spec.template.spec.containers[0]`.
pub fn field_path(instance: &Value, pointer: &str) -> String {
    let mut out = String::new();
    let mut at = Some(instance);
    for raw in pointer.split('/').skip(1) {
        let seg = raw.replace("~1", "/").replace("~0", "~");
        match at {
            Some(Value::Array(items)) => {
                out.push_str(&format!("[{seg}]"));
                at = seg.parse::<usize>().ok().and_then(|i| items.get(i));
            }
            _ => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(&seg);
                at = at.and_then(|v| v.get(&seg));
            }
        }
    }
    out
}

fn read(rel: &str) -> Value {
    let path = workspace_file(&format!("{SCHEMAS}/{rel}"));
    let text = std::fs::read_to_string(&path).expect("read schema");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Kubernetes' shared definitions, strict, with the API server's quantity and
/// int-or-string.
fn definitions() -> Value {
    let mut defs = read(&format!("{KUBERNETES}/_definitions.json"));
    strict(&mut defs);
    let d = &mut defs["$defs"];
    d["io.k8s.apimachinery.pkg.api.resource.Quantity"] = quantity_schema();
    d["io.k8s.apimachinery.pkg.util.intstr.IntOrString"] = int_or_string_schema();
    defs
}

fn definition(name: &str) -> Value {
    json!({"$ref": format!("{DEFINITIONS}#/$defs/{name}")})
}

/// The schema of one kind, strict. A custom resource's schema leaves `metadata` open; the
/// API server checks it as the ObjectMeta it is.
fn kind_schema(file: &str) -> Value {
    let mut schema = read(file);
    strict(&mut schema);
    if file.starts_with("kubeflow") {
        schema["properties"]["metadata"] =
            definition("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta");
    }
    schema
}

pub struct Schemas {
    kinds: Vec<(&'static str, &'static str, &'static str, Validator)>,
    /// The pods the training operator makes from a PyTorchJob's replica templates.
    pod_template: Validator,
}

fn build(registry: &Registry<'_>, schema: &Value, what: &str) -> Validator {
    jsonschema::options()
        .with_registry(registry)
        .should_validate_formats(true)
        .build(schema)
        .unwrap_or_else(|e| panic!("schema {what}: {e}"))
}

impl Schemas {
    fn load() -> Self {
        let registry = Registry::new()
            .add(DEFINITIONS, definitions())
            .and_then(|b| b.prepare())
            .expect("Kubernetes definitions");
        let kinds = KINDS
            .iter()
            .map(|&(api, kind, file)| (api, kind, file, build(&registry, &kind_schema(file), file)))
            .collect();
        let pod_template = build(
            &registry,
            &definition("io.k8s.api.core.v1.PodTemplateSpec"),
            "PodTemplateSpec",
        );
        Schemas {
            kinds,
            pod_template,
        }
    }

    /// Loaded once for all the tests of this binary.
    pub fn get() -> &'static Schemas {
        static SCHEMAS: LazyLock<Schemas> = LazyLock::new(Schemas::load);
        &SCHEMAS
    }

    /// Every way `doc` breaks its kind's schema, one line each, starting with the field's
    /// path; empty when it passes. A kind with no vendored schema is one such line.
    pub fn check(&self, doc: &Value) -> Vec<String> {
        let api = doc["apiVersion"].as_str().unwrap_or("");
        let kind = doc["kind"].as_str().unwrap_or("");
        let Some((_, _, file, validator)) = self
            .kinds
            .iter()
            .find(|(a, k, _, _)| *a == api && *k == kind)
        else {
            return vec![format!(
                "{api} {kind}: no vendored schema for this kind; add it to {SCHEMAS} \
                 (vendor.py) and to KINDS in tests/tests/k8s/schema.rs"
            )];
        };
        let against = format!("the {api} {kind} schema, {SCHEMAS}/{file}");
        let mut out = errors(validator, doc, "", &against);
        if kind == "PyTorchJob" {
            for (role, spec) in doc["spec"]["pytorchReplicaSpecs"]
                .as_object()
                .into_iter()
                .flatten()
            {
                let prefix = format!("spec.pytorchReplicaSpecs.{role}.template");
                out.extend(errors(
                    &self.pod_template,
                    &spec["template"],
                    &prefix,
                    "the core/v1 PodTemplateSpec schema of the pods the operator makes from it",
                ));
            }
        }
        out
    }
}

/// `instance`'s errors under `validator`, with paths under `prefix`.
fn errors(validator: &Validator, instance: &Value, prefix: &str, against: &str) -> Vec<String> {
    let join = |path: String| match (prefix.is_empty(), path.is_empty()) {
        (true, _) => path,
        (false, true) => prefix.to_owned(),
        (false, false) => format!("{prefix}.{path}"),
    };
    let mut out = Vec::new();
    for e in validator.iter_errors(instance) {
        let at = join(field_path(instance, e.instance_path().as_str()));
        match e.kind() {
            ValidationErrorKind::AdditionalProperties { unexpected } => {
                for field in unexpected {
                    let path = if at.is_empty() {
                        field.clone()
                    } else {
                        format!("{at}.{field}")
                    };
                    out.push(format!("{path}: unknown field (not in {against})"));
                }
            }
            _ => out.push(format!(
                "{}: {e} (under {against})",
                if at.is_empty() { "." } else { &at }
            )),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_closes_objects_that_list_properties_and_nothing_else() {
        let mut s = json!({
            "type": "object",
            "properties": {
                // A property named like a keyword is a property, not a schema.
                "properties": {"type": "object", "properties": {"a": {"type": "string"}}},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "free": {"type": "object", "properties": {"b": {}}, "x-kubernetes-preserve-unknown-fields": true},
                "list": {"type": "array", "items": {"properties": {"c": {"format": "int32", "type": "integer"}}}},
                "either": {"anyOf": [{"properties": {"d": {}}}]},
            },
        });
        strict(&mut s);
        let p = &s["properties"];
        assert_eq!(s["additionalProperties"], false);
        assert_eq!(p["properties"]["additionalProperties"], false);
        assert_eq!(
            p["labels"]["additionalProperties"],
            json!({"type": "string"})
        );
        assert!(p["free"].get("additionalProperties").is_none());
        let item = &p["list"]["items"];
        assert_eq!(item["additionalProperties"], false);
        assert_eq!(item["properties"]["c"]["maximum"], i32::MAX);
        assert_eq!(item["properties"]["c"]["minimum"], i32::MIN);
        assert_eq!(p["either"]["anyOf"][0]["additionalProperties"], false);
    }

    #[test]
    fn quantities_follow_kubernetes_grammar() {
        let v = jsonschema::validator_for(&quantity_schema()).unwrap();
        for ok in [
            json!("1Gi"),
            json!("100m"),
            json!("5120Mi"),
            json!("1e3"),
            json!("1E-3"),
            json!("0.5"),
            json!(".5"),
            json!("+2k"),
            json!("10n"),
            json!(8),
            json!(0.25),
        ] {
            assert!(v.is_valid(&ok), "{ok} refused");
        }
        for bad in [
            json!("1GB"),
            json!("1 Gi"),
            json!("1gi"),
            json!("1K"),
            json!("Gi"),
            json!(""),
            json!("1.5.0"),
            json!(true),
        ] {
            assert!(!v.is_valid(&bad), "{bad} accepted");
        }
    }

    #[test]
    fn int_or_strings_are_strings_or_int32s() {
        let v = jsonschema::validator_for(&int_or_string_schema()).unwrap();
        for ok in [json!(8080), json!("http"), json!("25%"), json!(i32::MAX)] {
            assert!(v.is_valid(&ok), "{ok} refused");
        }
        for bad in [
            json!(1.5),
            json!(2_147_483_648_u64),
            json!(true),
            json!(null),
        ] {
            assert!(!v.is_valid(&bad), "{bad} accepted");
        }
    }

    #[test]
    fn field_paths_read_like_manifests() {
        let doc =
            json!({"spec": {"containers": [{"name": "a"}], "labels": {"a/b": "x", "0": "y"}}});
        assert_eq!(field_path(&doc, ""), "");
        assert_eq!(
            field_path(&doc, "/spec/containers/0/name"),
            "spec.containers[0].name"
        );
        assert_eq!(field_path(&doc, "/spec/labels/a~1b"), "spec.labels.a/b");
        assert_eq!(field_path(&doc, "/spec/labels/0"), "spec.labels.0");
    }
}
