// Validates rendered HTTPRoute and Istio (WasmPlugin, EnvoyFilter, DestinationRule) manifests against schemas generated from the
// upstream CRDs (npm @kubernetes-models/gateway-api and @kubernetes-models/istio, which ship
// ajv validators built from Gateway API's and Istio's CRD OpenAPI schemas).
//
// Usage: node validate-crds.mjs <dir with node_modules> <manifest.json>...
// Each manifest file holds one object as JSON. Prints one line per object; exits 1 on any
// invalid object or any kind it has no schema for.
import { readFileSync } from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const [modulesDir, ...files] = process.argv.slice(2);
// The packages are ES modules: import their files by path from the given node_modules.
const model = (pkg, file, name) => async () =>
  (await import(pathToFileURL(path.join(modulesDir, "node_modules", pkg, file)).href))[name];
const models = {
  "gateway.networking.k8s.io/v1/HTTPRoute": model("@kubernetes-models/gateway-api", "gateway.networking.k8s.io/v1/HTTPRoute.js", "HTTPRoute"),
  "extensions.istio.io/v1alpha1/WasmPlugin": model("@kubernetes-models/istio", "extensions.istio.io/v1alpha1/WasmPlugin.js", "WasmPlugin"),
  "networking.istio.io/v1alpha3/EnvoyFilter": model("@kubernetes-models/istio", "networking.istio.io/v1alpha3/EnvoyFilter.js", "EnvoyFilter"),
  "networking.istio.io/v1/DestinationRule": model("@kubernetes-models/istio", "networking.istio.io/v1/DestinationRule.js", "DestinationRule"),
};

let failed = 0;
for (const f of files) {
  const doc = JSON.parse(readFileSync(f, "utf8"));
  const key = `${doc.apiVersion}/${doc.kind}`;
  const name = `${key} ${doc.metadata?.name}`;
  const load = models[key];
  if (!load) {
    console.log(`FAIL ${name}: no schema for this kind`);
    failed++;
    continue;
  }
  try {
    new (await load())(doc).validate();
    console.log(`ok   ${name}`);
  } catch (e) {
    console.log(`FAIL ${name}: ${e.message}`);
    failed++;
  }
}
process.exit(failed ? 1 : 0);
