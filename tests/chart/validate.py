"""Validate rendered Helm manifests against schemas, kubeconform-style, offline.

- Kubernetes built-in kinds: the Kubernetes OpenAPI JSON schemas bundled in PyPI's
  `kubernetes-validate`, in strict mode (unknown fields are errors), for each --kube-version.
- InferencePool / InferenceObjective and Envoy Gateway's policies: the CRDs in --crds (the project's reference copies),
  their openAPIV3Schema made strict (no unknown fields where the CRD does not preserve them),
  checked with PyPI's `check-jsonschema`. Every CRD file defining the object's
  group/version/kind is checked, so a pool must fit GIE v1.0.0 and the newer CRD alike.
  CEL rules (x-kubernetes-validations) are not evaluated.
- HTTPRoute, WasmPlugin, EnvoyFilter and DestinationRule: validate-crds.mjs (npm
  @kubernetes-models validators, generated from the Gateway API and Istio CRDs).

Any object of a kind with no schema fails. Usage:
  python validate.py --crds DIR --node-modules DIR [--kube-version 1.29.0 ...] manifest.yaml...
Exit 0 only if every object of every manifest is valid.
"""

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile

import kubernetes_validate
import yaml

NODE_KINDS = {
    "gateway.networking.k8s.io/v1/HTTPRoute",
    "extensions.istio.io/v1alpha1/WasmPlugin",
    "networking.istio.io/v1alpha3/EnvoyFilter",
    "networking.istio.io/v1/DestinationRule",
}


def strict(schema):
    """Forbid unknown fields wherever the CRD lists properties and does not preserve unknowns."""
    s = copy.deepcopy(schema)

    def walk(node):
        if not isinstance(node, dict):
            return
        if (
            node.get("type") == "object"
            and "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for key in ("properties", "patternProperties"):
            for child in node.get(key, {}).values():
                walk(child)
        for key in ("items", "additionalProperties"):
            walk(node.get(key))
        for key in ("allOf", "anyOf", "oneOf"):
            for child in node.get(key, []):
                walk(child)

    walk(s)
    return s


def crd_schemas(crd_dir):
    """{"group/version/Kind": [(file, json schema)]} from every CRD file in crd_dir."""
    out = {}
    for name in sorted(os.listdir(crd_dir)):
        if not name.endswith((".yaml", ".yml")):
            continue
        with open(os.path.join(crd_dir, name)) as f:
            for crd in yaml.safe_load_all(f):
                if not crd or crd.get("kind") != "CustomResourceDefinition":
                    continue
                group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
                for v in crd["spec"]["versions"]:
                    root = copy.deepcopy(v["schema"]["openAPIV3Schema"])
                    props = root.setdefault("properties", {})
                    props["apiVersion"] = {"const": f"{group}/{v['name']}"}
                    props["kind"] = {"const": kind}
                    props["metadata"] = {"type": "object"}
                    root["required"] = sorted(set(root.get("required", [])) | {"apiVersion", "kind", "metadata"})
                    schema = strict(root)
                    schema["$schema"] = "http://json-schema.org/draft-07/schema#"
                    out.setdefault(f"{group}/{v['name']}/{kind}", []).append((name, schema))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--crds", required=True)
    ap.add_argument("--node-modules", required=True)
    ap.add_argument("--kube-version", action="append", default=[])
    ap.add_argument("--check-jsonschema", default="check-jsonschema")
    ap.add_argument("manifests", nargs="+")
    a = ap.parse_args()
    versions = a.kube_version or ["1.29.0", "1.35.0"]
    crds = crd_schemas(a.crds)
    failures = 0
    tmp = tempfile.mkdtemp(prefix="attache-validate-")
    by_crd, for_node = {}, []
    for path in a.manifests:
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        for i, doc in enumerate(docs):
            key = f"{doc.get('apiVersion')}/{doc.get('kind')}"
            name = f"{os.path.basename(path)}: {key} {doc.get('metadata', {}).get('name')}"
            file = os.path.join(tmp, f"{len(os.listdir(tmp))}.json")
            with open(file, "w") as f:
                json.dump(doc, f)
            if key in crds:
                by_crd.setdefault(key, []).append((name, file))
            elif key in NODE_KINDS:
                for_node.append(file)
            else:
                for v in versions:
                    try:
                        kubernetes_validate.validate(doc, v, strict=True)
                        print(f"ok   {name} (Kubernetes {v}, strict)")
                    except kubernetes_validate.SchemaNotFoundError:
                        print(f"FAIL {name}: no schema for this kind in Kubernetes {v}")
                        failures += 1
                    except kubernetes_validate.ValidationError as e:
                        print(f"FAIL {name} (Kubernetes {v}): {e.message} at {'/'.join(map(str, e.path))}")
                        failures += 1
    for key, items in by_crd.items():
        for crd_file, schema in crds[key]:
            schema_file = os.path.join(tmp, f"schema-{len(os.listdir(tmp))}.json")
            with open(schema_file, "w") as f:
                json.dump(schema, f)
            for name, file in items:
                r = subprocess.run(
                    [a.check_jsonschema, "--schemafile", schema_file, file], capture_output=True, text=True
                )
                if r.returncode == 0:
                    print(f"ok   {name} (CRD {crd_file})")
                else:
                    print(f"FAIL {name} (CRD {crd_file}): {(r.stdout + r.stderr).strip()}")
                    failures += 1
    if for_node:
        r = subprocess.run(
            ["node", os.path.join(os.path.dirname(os.path.abspath(__file__)), "validate-crds.mjs"), a.node_modules]
            + for_node,
            capture_output=True,
            text=True,
        )
        sys.stdout.write(r.stdout + r.stderr)
        if r.returncode != 0:
            failures += 1
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
