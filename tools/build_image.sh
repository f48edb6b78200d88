#!/usr/bin/env bash
# Build the aiperf image (the repository's Containerfile) as an air-gapped centre does: everything
# the build needs is gathered on the host first, and the build itself runs without network.
#
#   1. wheels: the host's pip, under constraints.txt, writes every wheel of aiperf[EXTRAS] and the
#      NumPy reference backend (plugins/aiperf-numpy) into the build context;
#   2. base: Debian 12 (Python 3.11) made by mmdebstrap from Debian's packages, no registry
#      (reused while OUT/base.tar exists);
#   3. build: the first builder found (Charliecloud's ch-image, else podman, else docker) imports
#      the base as aiperf-base and builds; the image installs the wheels with pip --no-index, in a
#      network namespace without interfaces where unshare allows one;
#   4. it prints the image's digest (its stamp, /etc/aiperf/image.json) and how to run it under
#      each runtime.
#
# Settings (environment; `make image` passes its IMAGE_* variables): EXTRAS (default search),
# IMAGE_NAME (aiperf), OUT (build/image), MOUNTS (mount points to create, e.g. "/scratch"),
# PYTHON (the host Python whose pip gathers the wheels: .venv/bin/python), BUILDER (ch-image,
# podman or docker: skip the search), BASE_TAR (a base made before: OUT/base.tar).
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS=${EXTRAS:-search}
IMAGE_NAME=${IMAGE_NAME:-aiperf}
OUT=${OUT:-build/image}
MOUNTS=${MOUNTS:-}
PYTHON=${PYTHON:-.venv/bin/python}
BASE_TAR=${BASE_TAR:-$OUT/base.tar}
export USER=${USER:-$(id -un)}  # ch-image and ch-run refuse to start without it
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CONTEXT=$OUT/context
started=$SECONDS
phase() { echo "== $1 ($((SECONDS - started)) s)"; }

phase "wheels of aiperf[$EXTRAS] and aiperf-numpy, by $PYTHON's pip under constraints.txt"
rm -rf "$CONTEXT"
mkdir -p "$CONTEXT/wheels"
"$PYTHON" -m pip wheel -q --disable-pip-version-check -c constraints.txt -w "$CONTEXT/wheels" \
    ".[$EXTRAS]" ./plugins/aiperf-numpy 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
cp constraints.txt "$CONTEXT/"
echo "$(ls "$CONTEXT/wheels" | wc -l) wheels, $(du -sh "$CONTEXT/wheels" | cut -f1)"

if [ ! -s "$BASE_TAR" ]; then
    phase "base: Debian 12 by mmdebstrap into $BASE_TAR"
    command -v mmdebstrap >/dev/null || { echo "mmdebstrap is not installed (apt-get install mmdebstrap)" >&2; exit 1; }
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$BASE_TAR.part"
    mv "$BASE_TAR.part" "$BASE_TAR"
else
    phase "base: $BASE_TAR (made before; delete it to make it again)"
fi

# ch-image runs with `env python3` and needs lark: Debian's python3-lark is for Debian's Python,
# which a pyenv or venv first on PATH would hide.
if ! python3 -c "import lark" 2>/dev/null && /usr/bin/python3 -c "import lark" 2>/dev/null; then
    mkdir -p "$OUT/debian-python"
    ln -sf /usr/bin/python3 "$OUT/debian-python/python3"
    export PATH="$OUT/debian-python:$PATH"
fi
if [ -z "${BUILDER:-}" ]; then
    if command -v ch-image >/dev/null && ch-image --version >/dev/null 2>&1; then BUILDER=ch-image
    elif command -v podman >/dev/null && podman info >/dev/null 2>&1; then BUILDER=podman
    elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then BUILDER=docker
    else
        echo "no image builder works here: install Charliecloud (apt-get install charliecloud python3-lark)," \
             "podman or docker" >&2
        exit 1
    fi
fi
NO_NETWORK=()
if unshare --net true 2>/dev/null; then
    NO_NETWORK=(unshare --net --)
fi
BUILD_ARGS=(--build-arg "EXTRAS=$EXTRAS" --build-arg "IMAGE_NAME=$IMAGE_NAME" --build-arg "MOUNTS=$MOUNTS")

phase "build with $BUILDER${NO_NETWORK:+, in a network namespace without interfaces (unshare --net)}"
case $BUILDER in
    ch-image)
        export CH_IMAGE_STORAGE=$OUT/charliecloud
        ch-image import "$BASE_TAR" aiperf-base
        "${NO_NETWORK[@]}" ch-image build -t "$IMAGE_NAME" -f Containerfile "${BUILD_ARGS[@]}" "$CONTEXT"
        rm -rf "${OUT:?}/$IMAGE_NAME"
        ch-convert -i ch-image -o dir "$IMAGE_NAME" "$OUT/$IMAGE_NAME" >/dev/null
        IMAGE=$OUT/$IMAGE_NAME
        STAMP=$(cat "$IMAGE/etc/aiperf/image.json")
        ;;
    podman|docker)
        "$BUILDER" import "$BASE_TAR" aiperf-base >/dev/null
        "$BUILDER" build --network=none -t "$IMAGE_NAME" -f Containerfile "${BUILD_ARGS[@]}" "$CONTEXT"
        IMAGE=$IMAGE_NAME
        STAMP=$("$BUILDER" run --rm "$IMAGE_NAME" cat /etc/aiperf/image.json)
        ;;
    *)
        echo "BUILDER=$BUILDER: give ch-image, podman or docker" >&2
        exit 1
        ;;
esac
DIGEST=$(printf '%s' "$STAMP" | "$PYTHON" -c "import json, sys; print(json.load(sys.stdin)['digest'])")
phase "done"

cat <<EOF
image   $IMAGE ($BUILDER)
digest  $DIGEST
extras  $EXTRAS
size    $(if [ -d "$IMAGE" ]; then du -sh "$IMAGE" | cut -f1; else "$BUILDER" image inspect --format '{{.Size}}' "$IMAGE"; fi)

Run it (docs/deploy.md; only Charliecloud is verified here):
EOF
if [ "$BUILDER" = ch-image ]; then
cat <<EOF
  Charliecloud  aiperf run --container $IMAGE --container-runtime charliecloud ...
                one file to copy to the nodes: ch-convert -i dir -o squash $IMAGE $IMAGE_NAME.sqfs
                NVIDIA GPUs: ch-fromhost --nvidia $IMAGE (once, on a node with the driver)
  Apptainer     apptainer build $IMAGE_NAME.sif $IMAGE
                aiperf run --container $IMAGE_NAME.sif --container-runtime apptainer ...
  podman        tar -C $IMAGE -c . | podman import - $IMAGE_NAME
                aiperf run --container $IMAGE_NAME --container-runtime podman ...
  enroot/pyxis  ch-convert -i dir -o squash $IMAGE $IMAGE_NAME.sqsh
                aiperf run --executor slurm --container \$PWD/$IMAGE_NAME.sqsh --container-runtime pyxis ...
EOF
else
cat <<EOF
  $BUILDER  aiperf run --container $IMAGE_NAME --container-runtime podman ...   (podman; docker: export it first)
  Apptainer     $BUILDER save -o $IMAGE_NAME.tar $IMAGE_NAME && apptainer build $IMAGE_NAME.sif docker-archive:$IMAGE_NAME.tar
  Charliecloud  ch-convert -i $BUILDER -o dir $IMAGE_NAME $IMAGE_NAME.dir
  enroot/pyxis  enroot import $( [ "$BUILDER" = podman ] && echo podman || echo dockerd )://$IMAGE_NAME   (writes a .sqsh)
EOF
fi
