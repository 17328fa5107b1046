# syntax=docker/dockerfile:1
#
# Images for the two programs a cluster runs, and for the vLLM simulator the chart runs with
# `simulate: true` (no GPU):
#
#   docker build --target router  -t kvsight-router:0.1.0  .
#   docker build --target sidecar -t kvsight-sidecar:0.1.0 .
#   docker build --target sim     -t kvsight-vllm-sim:0.1.0 .
#
# One builder stage compiles both binaries (they share almost every dependency), and each runtime
# stage copies one binary onto distroless/cc: glibc and libgcc only, no shell, no package
# manager, user 65532 (the chart's securityContext expects exactly that uid). Neither binary
# links OpenSSL: TLS is rustls with ring, and reqwest is built without TLS (vLLM is plain HTTP
# inside the NetworkPolicy fence).

ARG RUST_VERSION=1.95

FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
# The cache mounts keep the registry and target/ between builds on the same builder; the binaries
# are copied out of the mounted target/ in the same step, since it is not part of the layer.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p kvsight-router -p kvsight-sidecar \
 && install -D -m 0755 target/release/kvsight-router /out/kvsight-router \
 && install -D -m 0755 target/release/kvsight-sidecar /out/kvsight-sidecar

FROM gcr.io/distroless/cc-debian12:nonroot AS router
COPY --from=build /out/kvsight-router /usr/local/bin/kvsight-router
USER 65532:65532
# HTTP (the gateway's backend) and QUIC from sidecars.
EXPOSE 8080/tcp 4433/udp
ENTRYPOINT ["/usr/local/bin/kvsight-router"]

FROM gcr.io/distroless/cc-debian12:nonroot AS sidecar
COPY --from=build /out/kvsight-sidecar /usr/local/bin/kvsight-sidecar
USER 65532:65532
# Health, readiness (warm-up finished) and metrics.
EXPOSE 9090/tcp
ENTRYPOINT ["/usr/local/bin/kvsight-sidecar"]

# vllm-sim (sim/, crate kvsight-sim): its own build step, so the router and sidecar images
# never wait for the simulator. The project's own tokenizer is trained here once and baked in; the chart's init
# container exports it (`--export-tokenizer`) for the pod's sidecar to offer routers.
FROM build AS build-sim
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p kvsight-sim --bin vllm-sim \
 && install -D -m 0755 target/release/vllm-sim /out/vllm-sim \
 && /out/vllm-sim --export-tokenizer /out/tokenizer

FROM gcr.io/distroless/cc-debian12:nonroot AS sim
COPY --from=build-sim /out/vllm-sim /usr/local/bin/vllm-sim
COPY --from=build-sim /out/tokenizer /opt/kvsight/tokenizer
USER 65532:65532
# vLLM's OpenAI API and /metrics; KV events (ZMQ PUB) and their replay.
EXPOSE 8000/tcp 5557/tcp 5558/tcp
ENTRYPOINT ["/usr/local/bin/vllm-sim"]
