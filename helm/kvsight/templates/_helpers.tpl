{{/* Names and labels. */}}
{{- define "kvsight.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The prefix of every object name. At most 50 characters: objects append up to 13
("-router-quic", "-selfsigned") and Service names stop at 63. Too long fails rendering instead
of being cut, since two cut names could collide. */}}
{{- define "kvsight.fullname" -}}
{{- $full := "" -}}
{{- if .Values.fullnameOverride -}}
{{- $full = .Values.fullnameOverride -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- $full = .Release.Name -}}
{{- else -}}
{{- $full = printf "%s-%s" .Release.Name $name -}}
{{- end -}}
{{- end -}}
{{- $full = trimSuffix "-" $full -}}
{{- if gt (len $full) 50 -}}
{{- fail (printf "the object-name prefix %q is %d characters, over 50 (Service names stop at 63 and objects add suffixes): use a shorter release name or set fullnameOverride" $full (len $full)) -}}
{{- end -}}
{{- $full -}}
{{- end -}}

{{- define "kvsight.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvsight
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{/* Selector labels of the router pods (the NetworkPolicies and Services select by these). */}}
{{- define "kvsight.routerSelectorLabels" -}}
app.kubernetes.io/name: {{ include "kvsight.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end -}}

{{/* Selector labels of every model pod of this release. An operator's own vLLM Deployment
that includes "kvsight.sidecar" must carry them too, or the router NetworkPolicy refuses its
sidecar's QUIC traffic and the model NetworkPolicy does not fence it. */}}
{{- define "kvsight.modelSelectorLabels" -}}
app.kubernetes.io/name: {{ include "kvsight.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: model-server
{{- end -}}

{{- define "kvsight.routerName" -}}{{ include "kvsight.fullname" . }}-router{{- end -}}
{{/* The headless Service every sidecar resolves to all router replicas. */}}
{{- define "kvsight.routerQuicService" -}}{{ include "kvsight.fullname" . }}-router-quic{{- end -}}

{{/* The router name sidecars dial: also the TLS server name they check (the sidecar uses the
host part of KVSIGHT_ROUTERS as SNI and verification name), so it must be one of the router
certificate's dnsNames. */}}
{{- define "kvsight.routerDialHost" -}}
{{ include "kvsight.routerQuicService" . }}.{{ .Release.Namespace }}.svc.{{ .Values.clusterDomain }}
{{- end -}}

{{/* Every name of the headless Service a client may use: the certificate's dnsNames. */}}
{{- define "kvsight.routerDnsNames" -}}
{{- $svc := include "kvsight.routerQuicService" . -}}
- {{ $svc }}
- {{ $svc }}.{{ .Release.Namespace }}
- {{ $svc }}.{{ .Release.Namespace }}.svc
- {{ include "kvsight.routerDialHost" . }}
{{- end -}}

{{- define "kvsight.image" -}}
{{- $tag := .image.tag | default .root.Chart.AppVersion -}}
{{ .image.repository }}:{{ $tag }}
{{- end -}}

{{/* The name routers require on sidecar certificates (empty: no pin). */}}
{{- define "kvsight.sidecarName" -}}
{{- if .Values.tls.sidecarName -}}
{{- .Values.tls.sidecarName -}}
{{- else if eq .Values.tls.mode "certManager" -}}
kvsight-sidecar.{{ .Release.Namespace }}
{{- end -}}
{{- end -}}

{{/* TLS Secret names, whichever mode; required values fail rendering here. */}}
{{- define "kvsight.routerTlsSecret" -}}
{{- if eq .Values.tls.mode "existingSecrets" -}}
{{- required "tls.existingSecrets.router is required when tls.mode is existingSecrets (a Secret with tls.crt, tls.key and ca.crt)" .Values.tls.existingSecrets.router -}}
{{- else -}}
{{ include "kvsight.fullname" . }}-router-tls
{{- end -}}
{{- end -}}

{{/* A model server's sidecar Secret: {root, server}. In certManager mode each model server
has its own (its certificate grants only its pods' names). */}}
{{- define "kvsight.sidecarTlsSecret" -}}
{{- $v := .root.Values -}}
{{- if eq $v.tls.mode "existingSecrets" -}}
{{- required "tls.existingSecrets.sidecar is required when tls.mode is existingSecrets (a Secret with tls.crt, tls.key and ca.crt)" $v.tls.existingSecrets.sidecar -}}
{{- else -}}
{{ include "kvsight.modelServerName" . }}-sidecar-tls
{{- end -}}
{{- end -}}

{{/* A model server's Deployment name: {root, server}. */}}
{{- define "kvsight.modelServerName" -}}
{{- printf "%s-%s" (include "kvsight.fullname" .root) .server.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The URI SAN granting a model server's sidecars their pods' names: {root, server}. Pods of a
Deployment are named <deployment>-<hash>-<suffix>, the start cut to 58 characters; 46 keep the
deployment's name and its dash whole below that. */}}
{{- define "kvsight.podGrant" -}}
kvsight://pod/{{ .root.Release.Namespace }}/{{ printf "%s-" (include "kvsight.modelServerName" .) | trunc 46 }}*
{{- end -}}

{{- define "kvsight.restrictedSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/*
The vLLM arguments that publish KV-cache events where the sidecar listens, from the one
kvEvents value. For your own vLLM Deployments: append these to vLLM's args.
*/}}
{{- define "kvsight.vllmKvEventsArgs" -}}
{{- $cfg := dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int .Values.kvEvents.port)) "replay_endpoint" (printf "tcp://*:%d" (int .Values.kvEvents.replayPort)) "topic" .Values.kvEvents.topic -}}
- --kv-events-config
- {{ toJson $cfg | quote }}
{{- end -}}

{{/*
The kvsight sidecar container. Include it in any vLLM pod:

  containers:
    - name: vllm
      ...
    {{- include "kvsight.sidecar" (dict "root" $ "maxNumSeqs" 256 "podLabels" (dict "kvsight.io/pool" "short")) | nindent 4 }}
  volumes:
    {{- include "kvsight.sidecarVolumes" (dict "root" $ "server" (dict "name" "my-server")) | nindent 4 }}

(certManager mode issues the sidecar Secret of each entry of modelServers only: a pod outside
them needs a certificate of its own whose URI SAN kvsight://pod/<namespace>/<name> grants its
pod's name.)

Keys: root (the chart context, required), maxNumSeqs (required: vLLM's --max-num-seqs),
maxNumBatchedTokens, podLabels (labels routers select pools by), vllmPort (default 8000),
modelMount ({name, mountPath}: the model volume, mounted read-only so the sidecar reads
tokenizer.json from vLLM's model root), tokenizerDir (where tokenizer.json is when it is not
vLLM's model root). The pod also needs the labels of
"kvsight.modelSelectorLabels" and the vLLM preStop hook of "kvsight.vllmPreStop".

It is an ordinary container, not a native (init) sidecar, on purpose: native sidecars are
stopped after the main containers, but kvsight must tell routers "Draining" at the very start
of termination, while vLLM still serves.
*/}}
{{- define "kvsight.sidecar" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $port := int $v.sidecar.port -}}
{{- $labels := list -}}
{{- range $k, $val := (.podLabels | default dict) -}}
{{- $labels = append $labels (printf "%s=%s" $k $val) -}}
{{- end -}}
- name: kvsight-sidecar
  image: {{ include "kvsight.image" (dict "image" $v.sidecar.image "root" $root) | quote }}
  imagePullPolicy: {{ $v.sidecar.image.pullPolicy }}
  args:
    - --listen=0.0.0.0:{{ $port }}
    {{- with $v.sidecar.debugListen }}
    - --debug-listen={{ . }}
    {{- end }}
  env:
    - name: RUST_LOG
      value: {{ $v.sidecar.logLevel | quote }}
    - name: POD_IP
      valueFrom: {fieldRef: {fieldPath: status.podIP}}
    - name: KVSIGHT_POD_NAME
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
    - name: KVSIGHT_POD_NAMESPACE
      valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
    - name: KVSIGHT_VLLM_URL
      value: "http://127.0.0.1:{{ int (.vllmPort | default 8000) }}"
    - name: KVSIGHT_KV_EVENTS_ENDPOINT
      value: "tcp://127.0.0.1:{{ int $v.kvEvents.port }}"
    - name: KVSIGHT_KV_EVENTS_REPLAY_ENDPOINT
      value: "tcp://127.0.0.1:{{ int $v.kvEvents.replayPort }}"
    - name: KVSIGHT_KV_EVENTS_TOPIC
      value: {{ $v.kvEvents.topic | quote }}
    - name: KVSIGHT_ROUTERS
      value: "{{ include "kvsight.routerDialHost" $root }}:4433"
    - name: KVSIGHT_POD_LABELS
      value: {{ join "," $labels | quote }}
    - name: KVSIGHT_TLS_CERT
      value: /etc/kvsight/tls/tls.crt
    - name: KVSIGHT_TLS_KEY
      value: /etc/kvsight/tls/tls.key
    - name: KVSIGHT_TLS_CA
      value: /etc/kvsight/tls/ca.crt
    - name: KVSIGHT_DRAIN_GRACE
      value: "{{ int $v.sidecar.drainGraceSeconds }}s"
    - name: KVSIGHT_MAX_NUM_SEQS
      value: {{ required "kvsight.sidecar: maxNumSeqs is required (vLLM's --max-num-seqs)" .maxNumSeqs | int | quote }}
    {{- with .maxNumBatchedTokens }}
    - name: KVSIGHT_MAX_NUM_BATCHED_TOKENS
      value: {{ int . | quote }}
    {{- end }}
    {{- with .tokenizerDir }}
    - name: KVSIGHT_TOKENIZER_DIR
      value: {{ . | quote }}
    {{- end }}
    {{- with $v.sidecar.warmup }}
    - name: KVSIGHT_WARMUP
      value: {{ . | quote }}
    {{- end }}
    {{- with $v.sidecar.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: sidecar-http
      containerPort: {{ $port }}
      protocol: TCP
  # Ready only after vLLM is up AND the warm-up has run (and 503 again while draining): the pod
  # joins Service endpoints, and routers pick it, only when its first requests are fast.
  readinessProbe:
    httpGet: {path: /ready, port: sidecar-http}
    periodSeconds: 2
    failureThreshold: 1
    successThreshold: 1
  livenessProbe:
    httpGet: {path: /live, port: sidecar-http}
    periodSeconds: 10
    failureThreshold: 3
  resources:
    {{- toYaml $v.sidecar.resources | nindent 4 }}
  securityContext:
    {{- include "kvsight.restrictedSecurityContext" $root | nindent 4 }}
  volumeMounts:
    - name: kvsight-sidecar-tls
      mountPath: /etc/kvsight/tls
      readOnly: true
    {{- with .modelMount }}
    - name: {{ .name }}
      mountPath: {{ .mountPath }}
      readOnly: true
    {{- end }}
{{- end -}}

{{/* The volumes "kvsight.sidecar" mounts. */}}
{{- define "kvsight.sidecarVolumes" -}}
- name: kvsight-sidecar-tls
  secret:
    secretName: {{ include "kvsight.sidecarTlsSecret" . }}
    # Readable by the sidecar's user without an fsGroup on the pod (an fsGroup would make the
    # kubelet chown the model volume); only this container mounts it.
    defaultMode: 0444
{{- end -}}

{{/*
vLLM's preStop hook: the termination order. On pod deletion the kubelet runs this hook and, at
the same moment, sends SIGTERM to the sidecar (which has no hook). The sidecar tells every
router "Draining" at once and waits up to drainGraceSeconds for vLLM to finish its running
requests, then exits. This hook keeps vLLM serving meanwhile: it waits at least drainMinSeconds
(requests a router picked just before it heard Draining are still arriving), then until the
sidecar has exited (its /live stops answering), at most drainGraceSeconds + drainMinSeconds.
Only then does vLLM get SIGTERM. The pod's terminationGracePeriodSeconds covers the hook plus
vLLM's own shutdown. Python is in every vLLM image; no curl needed.
*/}}
{{- define "kvsight.vllmPreStop" -}}
{{- $v := .root.Values -}}
{{- $min := int .drainMinSeconds -}}
{{- $max := add $min (int $v.sidecar.drainGraceSeconds) -}}
preStop:
  exec:
    command:
      - python3
      - -c
      - |
        import time, urllib.error, urllib.request
        # No proxy: GPU clusters often set http_proxy for model downloads; loopback must not use it.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        start = time.time()
        time.sleep({{ $min }})
        while time.time() - start < {{ $max }}:
            try:
                opener.open("http://127.0.0.1:{{ int $v.sidecar.port }}/live", timeout=1).close()
            except urllib.error.URLError as e:
                # Refused: the sidecar has exited, its drain is over. Anything else (an HTTP
                # error, a slow answer) is not an exit: keep waiting.
                if isinstance(e.reason, ConnectionRefusedError):
                    break
            except OSError:
                pass
            time.sleep(1)
{{- end -}}
