{{/* Names and labels. */}}
{{- define "splitserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "splitserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "splitserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: splitserve
{{- end -}}

{{/* (dict "root" $ "component" "router") */}}
{{- define "splitserve.componentSelector" -}}
{{ include "splitserve.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "splitserve.componentLabels" -}}
{{ include "splitserve.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "splitserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "splitserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* Redis: host, the password Secret's name and key, and whether there is a password. */}}
{{- define "splitserve.redisHost" -}}
{{- if .Values.redis.enabled -}}
{{ include "splitserve.fullname" . }}-redis
{{- else -}}
{{ required "redis.external.host is required when redis.enabled is false" .Values.redis.external.host }}
{{- end -}}
{{- end -}}

{{- define "splitserve.redisSecretName" -}}
{{- default (printf "%s-redis" (include "splitserve.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{/* Whether the in-chart Redis has one ACL user per component (router, worker; deploy/redis-start.sh):
"true" or "". Needs the chart's own password Secret (an existingSecret would have to carry router-password
and worker-password too: redis.auth.acl=false for one that does not). */}}
{{- define "splitserve.redisACL" -}}
{{- $r := .Values.redis -}}
{{- if and $r.enabled $r.auth.enabled $r.auth.acl (not $r.auth.existingSecret) -}}true{{- end -}}
{{- end -}}

{{/* Whether the in-chart Redis serves TLS (with the release's certificate): "true" or "". */}}
{{- define "splitserve.redisTLS" -}}
{{- if and .Values.redis.enabled .Values.tls.enabled .Values.tls.redis -}}true{{- end -}}
{{- end -}}

{{/*
Environment that defines REDIS_PASSWORD (from the Secret) and the Redis URL in `name`; Kubernetes
expands $(REDIS_PASSWORD) inside the URL. The password must be URL-safe (or stored percent-encoded).
The in-chart Redis over TLS is verified against the release's CA (ssl_ca_certs, read by redis-py).
With the in-chart Redis' ACL users, `user` (router | worker) names the user and its password's key.
(dict "root" $ "name" "SPLITSERVE_REDIS_URL" "user" "worker")
*/}}
{{- define "splitserve.redisEnv" -}}
{{- $r := .root.Values.redis -}}
{{- $inChartTLS := include "splitserve.redisTLS" .root -}}
{{- $scheme := ternary "rediss" "redis" (or (and (not $r.enabled) $r.external.tls) (eq $inChartTLS "true")) -}}
{{- $port := ternary 6379 $r.external.port $r.enabled -}}
{{- $db := ternary 0 $r.external.db $r.enabled -}}
{{- $query := ternary (printf "?ssl_ca_certs=%s/ca.crt" (include "splitserve.tlsDir" .root)) "" (eq $inChartTLS "true") -}}
{{- $acl := include "splitserve.redisACL" .root -}}
{{- $user := ternary (required "splitserve.redisEnv: user" .user) "" (eq $acl "true") -}}
{{- if $r.auth.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "splitserve.redisSecretName" .root }}
      key: {{ ternary (printf "%s-password" $user) $r.auth.existingSecretKey (eq $acl "true") }}
- name: {{ .name }}
  value: {{ printf "%s://%s:$(REDIS_PASSWORD)@%s:%v/%v%s" $scheme $user (include "splitserve.redisHost" .root) $port $db $query | quote }}
{{- else }}
- name: {{ .name }}
  value: {{ printf "%s://%s:%v/%v%s" $scheme (include "splitserve.redisHost" .root) $port $db $query | quote }}
{{- end }}
{{- end -}}

{{/* ---- Secrets and TLS (docs/security.md) ---- */}}

{{- define "splitserve.internalSecretName" -}}
{{- default (printf "%s-internal" (include "splitserve.fullname" .)) .Values.auth.internalSecret.existingSecret -}}
{{- end -}}

{{- define "splitserve.tlsSecretName" -}}
{{- if .Values.tls.secretName -}}
{{- .Values.tls.secretName -}}
{{- else if .Values.tls.certManager.issuerRef -}}
{{- printf "%s-tls" (include "splitserve.fullname" .) -}}
{{- else -}}
{{- fail "tls.enabled needs tls.secretName (a kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt) or tls.certManager.issuerRef" -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.tlsDir" -}}/etc/splitserve/tls{{- end -}}

{{/* Whether `component`'s own HTTP port serves HTTPS: "true" or "". (dict "root" $ "component" "router") */}}
{{- define "splitserve.servesTLS" -}}
{{- $tls := .root.Values.tls -}}
{{- if and $tls.enabled (or (ne .component "router") $tls.router) -}}true{{- end -}}
{{- end -}}

{{/*
The auth/TLS environment of a router, prefill or decode container: the internal secret as a file
(every process), API keys (router), certificates (HTTPS on its port; the router verifies the services
against ca.crt). (dict "root" $ "component" "router")
*/}}
{{- define "splitserve.securityEnv" -}}
{{- $v := .root.Values -}}
{{- $tlsDir := include "splitserve.tlsDir" .root -}}
- name: SPLITSERVE_INTERNAL_SECRET_FILE
  value: /etc/splitserve/secrets/internal/secret
{{- if $v.auth.internalSecret.acceptExistingSecret }}
- name: SPLITSERVE_INTERNAL_SECRET_ACCEPT_FILE
  value: /etc/splitserve/secrets/internal-accept/secret
{{- end }}
{{- if eq .component "router" }}
{{- if and $v.auth.requireApiKey $v.auth.allowUnauthenticated }}
{{- fail "auth.requireApiKey and auth.allowUnauthenticated contradict each other: turn one off" }}
{{- end }}
- name: SPLITSERVE_ROUTER_REQUIRE_API_KEY
  value: {{ $v.auth.requireApiKey | toString | quote }}
{{- if $v.auth.allowUnauthenticated }}
- name: SPLITSERVE_ROUTER_ALLOW_UNAUTHENTICATED
  value: "true"
{{- end }}
{{- if $v.auth.apiKeysSecret }}
- name: SPLITSERVE_ROUTER_API_KEYS_FILE
  value: /etc/splitserve/secrets/api-keys/keys
{{- end }}
{{- if $v.tls.enabled }}
{{- if include "splitserve.servesTLS" . }}
- name: SPLITSERVE_ROUTER_SSL_CERTFILE
  value: {{ $tlsDir }}/tls.crt
- name: SPLITSERVE_ROUTER_SSL_KEYFILE
  value: {{ $tlsDir }}/tls.key
{{- end }}
- name: SPLITSERVE_ROUTER_INTERNAL_CA_FILE
  value: {{ $tlsDir }}/ca.crt
# services register their pod IPs, which no certificate names: the chain to the release's CA is checked
- name: SPLITSERVE_ROUTER_INTERNAL_TLS_CHECK_HOSTNAME
  value: "false"
{{- end }}
{{- else if $v.tls.enabled }}
- name: SPLITSERVE_SSL_CERTFILE
  value: {{ $tlsDir }}/tls.crt
- name: SPLITSERVE_SSL_KEYFILE
  value: {{ $tlsDir }}/tls.key
{{- end }}
{{- end -}}

{{/* The secret files' mounts, read-only. (dict "root" $ "component" "router") */}}
{{- define "splitserve.securityVolumeMounts" -}}
{{- $v := .root.Values -}}
- name: internal-secret
  mountPath: /etc/splitserve/secrets/internal
  readOnly: true
{{- if $v.auth.internalSecret.acceptExistingSecret }}
- name: internal-secret-accept
  mountPath: /etc/splitserve/secrets/internal-accept
  readOnly: true
{{- end }}
{{- if and (eq .component "router") $v.auth.apiKeysSecret }}
- name: api-keys
  mountPath: /etc/splitserve/secrets/api-keys
  readOnly: true
{{- end }}
{{- if $v.tls.enabled }}
- name: tls
  mountPath: {{ include "splitserve.tlsDir" .root }}
  readOnly: true
{{- end }}
{{- end -}}

{{/*
The volumes behind securityVolumeMounts: Secrets, readable by the pod's group (fsGroup) only. A
router that does not serve HTTPS itself gets only the CA of the certificate Secret.
(dict "root" $ "component" "router")
*/}}
{{- define "splitserve.securityVolumes" -}}
{{- $v := .root.Values -}}
- name: internal-secret
  secret:
    secretName: {{ include "splitserve.internalSecretName" .root }}
    items:
      - key: {{ $v.auth.internalSecret.existingSecretKey }}
        path: secret
    defaultMode: 0440
{{- if $v.auth.internalSecret.acceptExistingSecret }}
- name: internal-secret-accept
  secret:
    secretName: {{ $v.auth.internalSecret.acceptExistingSecret }}
    items:
      - key: {{ $v.auth.internalSecret.acceptExistingSecretKey }}
        path: secret
    defaultMode: 0440
{{- end }}
{{- if and (eq .component "router") $v.auth.apiKeysSecret }}
- name: api-keys
  secret:
    secretName: {{ $v.auth.apiKeysSecret }}
    items:
      - key: {{ $v.auth.apiKeysSecretKey }}
        path: keys
    defaultMode: 0440
{{- end }}
{{- if $v.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "splitserve.tlsSecretName" .root }}
    {{- if not (include "splitserve.servesTLS" .) }}
    items:
      - key: ca.crt
        path: ca.crt
    {{- end }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/* The probes' httpGet for `component` (HTTPS where it serves TLS). (dict "root" $ "component" "router") */}}
{{- define "splitserve.healthGet" -}}
{path: /health, port: http{{ if include "splitserve.servesTLS" . }}, scheme: HTTPS{{ end }}}
{{- end -}}

{{/* Settings map -> env list: (dict "prefix" "SPLITSERVE_" "map" .Values.engine); a map value (e.g.
tenant_weights) as JSON, which the services read */}}
{{- define "splitserve.settingsEnv" -}}
{{- range $k, $v := .map }}
- name: {{ printf "%s%s" $.prefix (upper $k) }}
  value: {{ ternary (toJson $v) (toString $v) (kindIs "map" $v) | quote }}
{{- end }}
{{- end -}}

{{- define "splitserve.modelVolumeMount" -}}
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "splitserve.modelVolume" -}}
{{- if .Values.model.volume }}
- name: model
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}
{{- end -}}
