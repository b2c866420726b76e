{{/*
A prefill or decode Deployment: (dict "root" $ "role" "prefill").
Each pod binds 0.0.0.0 and registers its pod IP (SPLITSERVE_ADVERTISE_HOST) and pod name (worker id)
in Redis, where the router and the other role find it.
*/}}
{{- define "splitserve.worker" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $c := index $root.Values $role -}}
{{- $ctx := dict "root" $root "component" $role -}}
{{- /*
Tensor parallelism: tensorParallelSize ranks, one process each, in this one pod (rank 0 the service,
1.. its worker processes). `gpus` is per rank: the pod requests gpus x tensorParallelSize. TP > 1 runs
on the CPU only for now (the engine refuses a CUDA device), so it needs gpus 0, and its pods are pinned
to the CPU (SPLITSERVE_DEVICE=cpu, unless <role>.engine.device says otherwise). A decode rank r
receives KV on kvPort + r: container ports kv (rank 0), kv-1 .. kv-<N-1>.
*/ -}}
{{- $tp := int ($c.tensorParallelSize | default 1) -}}
{{- $device := get ($c.engine | default dict) "device" | default (get ($root.Values.engine | default dict) "device") | default "" -}}
{{- if gt $tp 1 -}}
{{- if gt (int $c.gpus) 0 -}}
{{- fail (printf "%s.tensorParallelSize is %d with %s.gpus %d: tensor parallelism runs on CPU pods only for now: set gpus: 0 (or tensorParallelSize: 1 on GPUs)" $role $tp $role (int $c.gpus)) -}}
{{- end -}}
{{- if eq $device "cuda" -}}
{{- fail (printf "%s.tensorParallelSize is %d with engine device cuda: tensor parallelism runs on CPU pods only for now: set gpus: 0 and device cpu (or auto)" $role $tp) -}}
{{- end -}}
{{- if eq $role "decode" -}}
{{- $last := add (int $c.kvPort) (sub $tp 1) -}}
{{- if gt (int $last) 65535 -}}
{{- fail (printf "decode.kvPort %d + decode.tensorParallelSize %d - 1 = %d: past 65535 (rank r listens on kvPort + r)" (int $c.kvPort) $tp (int $last)) -}}
{{- end -}}
{{- if and (ge (int $c.port) (int $c.kvPort)) (le (int $c.port) (int $last)) -}}
{{- fail (printf "decode.port %d falls in the KV ports %d-%d (rank r listens on decode.kvPort + r, decode.tensorParallelSize %d): move one" (int $c.port) (int $c.kvPort) (int $last) $tp) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $res := deepCopy ($c.resources | default dict) -}}
{{- $limits := deepCopy (get $res "limits" | default dict) -}}
{{- if gt (int $c.gpus) 0 }}{{- $_ := set $limits "nvidia.com/gpu" (mul (int $c.gpus) $tp) -}}{{- end -}}
{{- if $c.rdma.enabled }}{{- $_ := set $limits $c.rdma.resourceName (int $c.rdma.count) -}}{{- end -}}
{{- if $limits }}{{- $_ := set $res "limits" $limits -}}{{- end -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "splitserve.fullname" $root }}-{{ $role }}
  labels:
    {{- include "splitserve.componentLabels" $ctx | nindent 4 }}
spec:
  {{- /* with the planner, <role>.replicas is the starting point only: an upgrade keeps what runs */}}
  {{- $replicas := $c.replicas }}
  {{- if $root.Values.planner.enabled }}
  {{- with lookup "apps/v1" "Deployment" $root.Release.Namespace (printf "%s-%s" (include "splitserve.fullname" $root) $role) }}
  {{- $replicas = .spec.replicas }}
  {{- end }}
  {{- end }}
  replicas: {{ $replicas }}
  strategy:
    {{- toYaml $c.updateStrategy | nindent 4 }}
  selector:
    matchLabels:
      {{- include "splitserve.componentSelector" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "splitserve.componentLabels" $ctx | nindent 8 }}
      annotations:
        checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
        {{- with $c.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "splitserve.serviceAccountName" $root }}
      automountServiceAccountToken: false
      {{- with $root.Values.image.pullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- if $c.hostIPC }}
      hostIPC: true
      {{- end }}
      {{- if $c.hostNetwork }}
      hostNetwork: true
      dnsPolicy: ClusterFirstWithHostNet
      {{- end }}
      terminationGracePeriodSeconds: {{ $c.terminationGracePeriodSeconds }}
      containers:
        - name: {{ $role }}
          image: {{ include "splitserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          # --port explicitly: the container port and the probes use the same value
          args: [{{ $role | quote }}, "--port", {{ $c.port | quote }}]
          securityContext:
            {{- $sc := deepCopy $root.Values.securityContext }}
            {{- if $c.rdma.enabled }}
            {{- $caps := deepCopy ($sc.capabilities | default dict) }}
            {{- $_ := set $caps "add" (list "IPC_LOCK") }}
            {{- $_ := set $sc "capabilities" $caps }}
            {{- end }}
            {{- toYaml $sc | nindent 12 }}
          ports:
            - name: http
              containerPort: {{ $c.port }}
              protocol: TCP
            {{- if eq $role "decode" }}
            - name: kv
              containerPort: {{ $c.kvPort }}
              protocol: TCP
            {{- range $r := untilStep 1 $tp 1 }}
            - name: kv-{{ $r }}
              containerPort: {{ add (int $c.kvPort) $r }}
              protocol: TCP
            {{- end }}
            {{- end }}
          envFrom:
            - configMapRef:
                name: {{ include "splitserve.fullname" $root }}-workers
          env:
            - name: SPLITSERVE_HOST
              value: "0.0.0.0"
            - name: SPLITSERVE_TENSOR_PARALLEL_SIZE
              value: {{ $tp | quote }}
            {{- if and (gt $tp 1) (not (hasKey ($c.engine | default dict) "device")) }}
            - name: SPLITSERVE_DEVICE
              value: cpu
            {{- end }}
            {{- if eq $role "decode" }}
            - name: SPLITSERVE_KV_PORT
              value: {{ $c.kvPort | quote }}
            {{- end }}
            - name: SPLITSERVE_ADVERTISE_HOST
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            - name: SPLITSERVE_WORKER_ID
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            # SIGTERM drains: requests in progress get the grace period less 10 s, then the rest are
            # ended (the router migrates them) before Kubernetes would kill the pod
            - name: SPLITSERVE_DRAIN_TIMEOUT_S
              value: {{ max 1 (sub (int $c.terminationGracePeriodSeconds) 10) | quote }}
            - name: OTEL_SERVICE_NAME
              value: splitserve-{{ $role }}
            {{- include "splitserve.securityEnv" $ctx | trim | nindent 12 }}
            {{- with include "splitserve.redisEnv" (dict "root" $root "name" "SPLITSERVE_REDIS_URL" "user" "worker") | trim }}{{ . | nindent 12 }}{{ end }}
            {{- with include "splitserve.settingsEnv" (dict "prefix" "SPLITSERVE_" "map" $c.engine) | trim }}{{ . | nindent 12 }}{{ end }}
            {{- with $c.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- $health := include "splitserve.healthGet" $ctx }}
          startupProbe:
            httpGet: {{ $health }}
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: {{ max 1 (div (int $c.startupTimeoutSeconds) 10) }}
          readinessProbe:
            httpGet: {{ $health }}
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 3
          livenessProbe:
            httpGet: {{ $health }}
            periodSeconds: 20
            timeoutSeconds: 10
            failureThreshold: 6
          {{- with $res }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            {{- if not $c.hostIPC }}
            - name: dshm
              mountPath: /dev/shm
            {{- end }}
            # the only writable place (readOnlyRootFilesystem): temporary files and every cache
            - name: tmp
              mountPath: /tmp
            {{- include "splitserve.securityVolumeMounts" $ctx | trim | nindent 12 }}
            {{- with include "splitserve.modelVolumeMount" $root | trim }}{{ . | nindent 12 }}{{ end }}
      volumes:
        {{- if not $c.hostIPC }}
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $c.shmSize }}
        {{- end }}
        - name: tmp
          emptyDir: {}
        {{- include "splitserve.securityVolumes" $ctx | trim | nindent 8 }}
        {{- with include "splitserve.modelVolume" $root | trim }}{{ . | nindent 8 }}{{ end }}
      {{- with $c.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $c.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $c.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}
