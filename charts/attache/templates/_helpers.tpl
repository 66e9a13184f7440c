{{/* The chart name, truncated to a DNS label. */}}
{{- define "attache.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name: <release>-<chart>, or the release alone when it contains the chart name. */}}
{{- define "attache.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "attache.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every object carries (Kubernetes recommended labels). */}}
{{- define "attache.labels" -}}
helm.sh/chart: {{ include "attache.chart" . }}
app.kubernetes.io/name: {{ include "attache.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: attache
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels for one component: include with (dict "ctx" $ "component" "host"). */}}
{{- define "attache.selectorLabels" -}}
app.kubernetes.io/name: {{ include "attache.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "attache.componentLabels" -}}
{{ include "attache.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "attache.hostName" -}}
{{- printf "%s-host" (include "attache.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "attache.gatewayName" -}}
{{- printf "%s-gateway" (include "attache.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "attache.serviceAccountName" -}}
{{- if .Values.host.serviceAccount.create }}
{{- default (include "attache.hostName" .) .Values.host.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.host.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The host Service's cluster DNS name. */}}
{{/* The headless Service that resolves to every host replica (peers, and the gateways' host
cluster, which fails over between them). */}}
{{- define "attache.hostPeersName" -}}
{{- printf "%s-host-peers" (include "attache.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "attache.hostPeersFQDN" -}}
{{- printf "%s.%s.svc.%s" (include "attache.hostPeersName" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{- define "attache.hostFQDN" -}}
{{- printf "%s.%s.svc.%s" (include "attache.hostName" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{/* The namespace discovery watches: "" means all namespaces. */}}
{{- define "attache.watchNamespace" -}}
{{- if eq .Values.discovery.namespace "*" }}{{- else }}{{ default .Release.Namespace .Values.discovery.namespace }}{{- end }}
{{- end }}

{{- define "attache.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}

{{/* The InferencePool name the chart serves or creates. */}}
{{- define "attache.poolName" -}}
{{- default (include "attache.fullname" .) .Values.pool.name }}
{{- end }}

{{/*
The scheduler filter's JSON configuration; `subscribeCluster` names the Envoy cluster of the
host (each worker subscribes itself: no bootstrap singleton). `scoringContext` turns on the
context custom scorers read (when scorer slots exist). `rolloutArm` makes it the stable arm of
scheduler rollouts (the gateway's chain, where the host publishes a canary scheduler in front of
it), unless the values give a `rollout` of their own.
*/}}
{{- define "attache.schedulerConfig" -}}
{{- $cfg := deepCopy .ctx.Values.scheduler.config }}
{{- $_ := set $cfg "role" "scheduler" }}
{{- if .scoringContext }}
{{- $scoring := default (dict) (get $cfg "scoring") }}
{{- $_ := set $scoring "context" true }}
{{- $_ := set $cfg "scoring" $scoring }}
{{- end }}
{{- if and .rolloutArm (not (get $cfg "rollout")) }}
{{- $_ := set $cfg "rollout" (dict "arm" "stable" "version" "bootstrap") }}
{{- end }}
{{- if .subscribeCluster }}
{{- $_ := set $cfg "subscribe" (dict "cluster" .subscribeCluster "idle_timeout_ms" 5000 "tick_ms" 500) }}
{{- end }}
{{- toJson $cfg }}
{{- end }}

{{/*
Whether the chart's own Envoy gateway is rendered ("true" or ""): `gateway.enabled` when set;
unset (null, the default), on except in Gateway API mode, where the user's Gateway takes the
traffic and Attaché's endpoint picker makes the pick.
*/}}
{{- define "attache.gatewayEnabled" -}}
{{- if kindIs "invalid" .Values.gateway.enabled }}
{{- if not .Values.gatewayApi.enabled }}true{{ end }}
{{- else if .Values.gateway.enabled }}true{{ end }}
{{- end }}

{{/*
Whether the host serves the endpoint picker ("true" or ""): `epp.enabled` when set; unset
(null, the default), in Gateway API mode unless the scheduler runs in the gateway's own Envoy
(Istio or Envoy Gateway mode).
*/}}
{{- define "attache.eppEnabled" -}}
{{- if kindIs "invalid" .Values.epp.enabled }}
{{- $inEnvoy := or (and .Values.istio.enabled (ne .Values.istio.mode "picker")) .Values.envoyGateway.enabled }}
{{- if and .Values.gatewayApi.enabled (not $inEnvoy) }}true{{ end }}
{{- else if .Values.epp.enabled }}true{{ end }}
{{- end }}

{{/* The Secret holding the picker's TLS certificate (tls.crt, tls.key). */}}
{{- define "attache.eppTlsSecretName" -}}
{{- default (printf "%s-epp-tls" (include "attache.hostName" .)) .Values.epp.tls.secretName }}
{{- end }}

{{/*
The endpoint picker's scheduler configuration: `epp.config` laid over `scheduler.config` (the
same document as the filter's; keys in `epp.config` win), without the filter-only `role` and
`subscribe`.
*/}}
{{- define "attache.eppConfig" -}}
{{- $cfg := mergeOverwrite (deepCopy (default (dict) .Values.scheduler.config)) (deepCopy (default (dict) .Values.epp.config)) }}
{{- $_ := unset $cfg "role" }}
{{- $_ := unset $cfg "subscribe" }}
{{- toYaml $cfg }}
{{- end }}

{{/* An Envoy Gateway Wasm code source from {url, sha256}: an OCI image for oci://, else HTTP. */}}
{{- define "attache.egCode" -}}
{{- if hasPrefix "oci://" .url -}}
type: Image
image: {url: {{ .url | quote }}, sha256: {{ .sha256 | quote }}}
{{- else -}}
type: HTTP
http: {url: {{ .url | quote }}, sha256: {{ .sha256 | quote }}}
{{- end }}
{{- end }}

{{/* Where the Istio objects go: the gateway pods' namespace. */}}
{{- define "attache.istioNamespace" -}}
{{- default (default .Release.Namespace .Values.gatewayApi.parentRef.namespace) .Values.istio.namespace }}
{{- end }}

{{/*
The picker filter's JSON configuration: the scheduler configuration's `scoring` section (the
response header, the decision log's rate; as attache.schedulerConfig gives it) and its
`fleet.lookup_cluster`, where the picker sends logged decisions.
*/}}
{{- define "attache.pickerConfig" -}}
{{- $sched := include "attache.schedulerConfig" (dict "ctx" .ctx "scoringContext" true) | fromJson }}
{{- $cfg := dict "role" "picker" "scoring" (get $sched "scoring") }}
{{- $fleet := default (dict) (get $sched "fleet") }}
{{- if hasKey $fleet "lookup_cluster" }}
{{- $_ := set $cfg "fleet" (dict "lookup_cluster" (get $fleet "lookup_cluster")) }}
{{- end }}
{{- toJson $cfg }}
{{- end }}
