#!/bin/sh
# Helm post-renderer (Helm 3's --post-renderer; Helm 4 runs it through plugin.yaml): reads the chart's
# rendered manifests on standard input and writes them with the kvobs sidecar added to the engine
# Deployments (kustomization.yaml here) on standard output. Needs kubectl (its built-in kustomize).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$here/kustomization.yaml" "$here/kvobs-sidecar.yaml" "$work/"
cat > "$work/chart.yaml"
kubectl kustomize "$work"
