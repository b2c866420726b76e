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

{{/*
Environment that defines REDIS_PASSWORD (from the Secret) and the Redis URL in `name`; Kubernetes
expands $(REDIS_PASSWORD) inside the URL. The password must be URL-safe (or stored percent-encoded).
(dict "root" $ "name" "SPLITSERVE_REDIS_URL")
*/}}
{{- define "splitserve.redisEnv" -}}
{{- $r := .root.Values.redis -}}
{{- $scheme := ternary "rediss" "redis" (and (not $r.enabled) $r.external.tls) -}}
{{- $port := ternary 6379 $r.external.port $r.enabled -}}
{{- $db := ternary 0 $r.external.db $r.enabled -}}
{{- if $r.auth.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "splitserve.redisSecretName" .root }}
      key: {{ $r.auth.existingSecretKey }}
- name: {{ .name }}
  value: {{ printf "%s://:$(REDIS_PASSWORD)@%s:%v/%v" $scheme (include "splitserve.redisHost" .root) $port $db | quote }}
{{- else }}
- name: {{ .name }}
  value: {{ printf "%s://%s:%v/%v" $scheme (include "splitserve.redisHost" .root) $port $db | quote }}
{{- end }}
{{- end -}}

{{/* Settings map -> env list: (dict "prefix" "SPLITSERVE_" "map" .Values.engine) */}}
{{- define "splitserve.settingsEnv" -}}
{{- range $k, $v := .map }}
- name: {{ printf "%s%s" $.prefix (upper $k) }}
  value: {{ $v | toString | quote }}
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
