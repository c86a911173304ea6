{{/* Names */}}
{{- define "swarmgate.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "swarmgate.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "swarmgate.dhtName" -}}{{ include "swarmgate.fullname" . }}-dht{{- end -}}
{{- define "swarmgate.nodeName" -}}{{ include "swarmgate.fullname" . }}-node{{- end -}}
{{- define "swarmgate.gatewayName" -}}{{ include "swarmgate.fullname" . }}-gateway{{- end -}}
{{- define "swarmgate.redisName" -}}{{ include "swarmgate.fullname" . }}-redis{{- end -}}

{{/* Labels; pass (dict "ctx" $ "component" "gateway") */}}
{{- define "swarmgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "swarmgate.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "swarmgate.labels" -}}
{{ include "swarmgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: swarmgate
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "swarmgate.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* libp2p multiaddrs: listen on every interface of the pod network's family; announce a pod's own IP */}}
{{- define "swarmgate.listenMaddr" -}}
{{- if eq .Values.swarm.ipFamily "IPv6" -}}/ip6/::/tcp/{{ .Values.swarm.p2pPort }}{{- else -}}/ip4/0.0.0.0/tcp/{{ .Values.swarm.p2pPort }}{{- end -}}
{{- end -}}

{{- define "swarmgate.podIpMaddr" -}}
{{- if eq .Values.swarm.ipFamily "IPv6" -}}/ip6{{- else -}}/ip4{{- end -}}/$(POD_IP)/tcp/{{ .Values.swarm.p2pPort }}
{{- end -}}

{{/* Where DHT replica pods resolve: <pod>.<headless service>.<namespace>.svc */}}
{{- define "swarmgate.dhtPodDomain" -}}
{{ include "swarmgate.dhtName" . }}-headless.{{ .Release.Namespace }}.svc
{{- end -}}

{{/* Every DHT replica's published multiaddr, as space-separated URLs (swarmgate-entrypoint reads them all) */}}
{{- define "swarmgate.bootstrapUrls" -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.dht.replicas) -}}
{{- $urls = append $urls (printf "http://%s-%d.%s:%d/initial-peers.json" (include "swarmgate.dhtName" $) $i (include "swarmgate.dhtPodDomain" $) (int $.Values.dht.publishPort)) -}}
{{- end -}}
{{ join " " $urls }}
{{- end -}}

{{/* A pod's own name and StatefulSet index, for args that name them ($(POD_NAME), $(POD_INDEX)) */}}
{{- define "swarmgate.podIdentityEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_INDEX
  valueFrom:
    fieldRef:
      fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
{{- end -}}

{{/* Env every swarm member (node, gateway) gets: where to learn the bootstrap's address, the swarm secret */}}
{{- define "swarmgate.memberEnv" -}}
- name: SWARMGATE_BOOTSTRAP_URL
  value: {{ include "swarmgate.bootstrapUrls" . | quote }}
{{- include "swarmgate.secretEnv" . }}
{{- with .Values.model.hfToken.existingSecret }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.model.hfToken.key }}
{{- end }}
{{- end -}}

{{- define "swarmgate.secretEnv" -}}
{{- with .Values.swarm.secret.existingSecret }}
- name: SWARMGATE_SWARM_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.swarm.secret.key }}
{{- end }}
{{- end -}}

{{/* Volumes every swarmgate container writes to; the root filesystem stays read-only */}}
{{- define "swarmgate.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: 64Mi
{{- end -}}

{{- define "swarmgate.podSecurityContext" -}}
{{ toYaml .Values.podSecurityContext }}
{{- end -}}

{{- define "swarmgate.containerSecurityContext" -}}
{{ toYaml .Values.containerSecurityContext }}
{{- end -}}

{{/* The Redis URL the gateways get, as an EnvVar list (its password or the whole URL come from Secrets) */}}
{{- define "swarmgate.redisEnv" -}}
{{- if eq .Values.redis.mode "embedded" -}}
{{- $host := printf "%s.%s.svc:6379" (include "swarmgate.redisName" .) .Release.Namespace -}}
{{- with .Values.redis.embedded.auth.existingSecret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.redis.embedded.auth.key }}
- name: SWARMGATE_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s/0" $host | quote }}
{{- else }}
- name: SWARMGATE_REDIS_URL
  value: {{ printf "redis://%s/0" $host | quote }}
{{- end }}
{{- else if .Values.redis.external.existingSecret }}
- name: SWARMGATE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.key }}
{{- else if .Values.redis.external.url }}
- name: SWARMGATE_REDIS_URL
  value: {{ .Values.redis.external.url | quote }}
{{- else }}
{{- fail "redis.mode is external: set redis.external.url or redis.external.existingSecret" }}
{{- end }}
{{- end -}}
