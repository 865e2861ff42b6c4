# syntax=docker/dockerfile:1

# Build stage: compile the release binary from the locked dependency set.
FROM rust:1.95-slim-bookworm AS builder
WORKDIR /build
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/build/target \
    cargo build --release --locked \
    && install -D -m 0755 target/release/custom-router /out/custom-router

# Runtime stage: the binary, CA certificates and the example configuration files.
FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 1001 router \
    && useradd --uid 1001 --gid 1001 --no-create-home --shell /usr/sbin/nologin router
COPY --from=builder /out/custom-router /usr/local/bin/custom-router
COPY config/ /etc/custom-router/
USER 1001:1001
ENV CUSTOM_ROUTER_PORT=3000
EXPOSE 3000
ENTRYPOINT ["/usr/local/bin/custom-router"]
