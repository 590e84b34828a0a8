#!/usr/bin/env bash
# Build the Go example: examples/go/build.sh [OUTPUT] (default: examples/go/agentarium-go).
# Offline with Debian's packages (apt-get install golang-go golang-github-nats-io-go-nats-dev,
# which ops/setup.sh --test installs): GOPATH mode against /usr/share/gocode. Elsewhere, module
# mode (go.mod), which fetches nats.go once.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/agentarium-go}"
cd "$here"
if [ -d /usr/share/gocode/src/github.com/nats-io/nats.go ]; then
  GO111MODULE=off GOPATH=/usr/share/gocode go build -o "$out" main.go
else
  [ -f go.sum ] || go mod tidy
  go build -o "$out" .
fi
