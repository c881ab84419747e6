#!/usr/bin/env bash
# Build tokenfan's container images with whichever builder this machine has (`make image` calls this).
#
#   deploy/image.sh [build] [cpu|gpu]   build deploy/docker/Dockerfile.<cpu|gpu> (default cpu) as tokenfan:<cpu|gpu>
#   deploy/image.sh base                make the local base image from Debian's archive (buildah only)
#   deploy/image.sh gpu-dry             build Dockerfile.gpu FROM a stand-in for the vLLM image (see below)
#   deploy/image.sh tool                print the builder that would be used: docker, buildah, or none
#   deploy/image.sh hash [cpu|gpu]      the hash of the build's inputs (the image's tokenfan.source-hash label)
#   deploy/image.sh sources [cpu|gpu]   what the Dockerfile copies from the checkout (what the hash reads)
#   deploy/image.sh store               print the buildah storage directory
#   deploy/image.sh buildah-args        print buildah's storage options (--root … --storage-driver …)
#   deploy/image.sh clean               remove the build storage (buildah) and the build cache
#   deploy/image.sh prune               remove other checkouts' stores as a build does (see Disk, below)
#
# Builder: a working Docker daemon (`docker info` answers), else buildah (Debian's package; installed by
# `make image-deps`). With buildah the images live in their own storage, never in the system's: under
# $TOKENFAN_IMAGE_STORE (default $TOKENFAN_IMAGE_STORES/<checkout>-<hash>, one per checkout; the parent
# defaults to /var/tmp/tokenfan-image), so `make clean` can remove them and a test can start them with
# `buildah --root … run --isolation chroot`.
#
# Base image: the official one (python:3.11-slim, vllm/vllm-openai) when its registry answers. Where no
# registry is reachable, the CPU image is built FROM a base made here from Debian's archive with
# mmdebstrap (bookworm, Debian's Python 3.11 in a virtual environment at /opt/python on PATH, so `python`
# and `pip` behave as in python:3.11-slim). The GPU image has no such fallback (its base is the vLLM build
# with CUDA): there it stops with the reason. TOKENFAN_IMAGE_BASE=official|debian forces a choice.
#
# GPU dry build (where vllm/vllm-openai cannot be pulled): Dockerfile.gpu, unchanged, built FROM a
# stand-in made of the built CPU image with tokenfan, its user and its directories removed (so Python,
# pip, torch and vLLM 0.32 are there, as in the vLLM image, but the CPU build of them, Python 3.11 and
# Debian instead of the vLLM image's Ubuntu). It proves the Dockerfile's own steps (copy, the --no-deps
# install and its dependency list, the import check, the user, the entrypoint), not CUDA or a GPU.
#
# torch comes from the PyTorch CPU index (the Dockerfile's default). Where that index is not reachable but
# a local torch 2.13.0+cpu wheel is (pip's own find-links, e.g. /opt/wheels), that directory is mounted
# into the build and pip takes the wheel from it; everything else still comes from PyPI. pip's cache is a
# build cache mount (RUN --mount=type=cache): rebuilds reuse it, the image never holds it.
#
# Disk: a CPU build needs about 11 GiB free while it runs (measured here: the free space fell by 10.4 GiB
# at its peak: pip's downloads, the container's 3 GiB of site-packages and their committed copy) and keeps
# 3.1 GiB. Stores are per checkout, so clones would add up (a CI machine cloning each run filled its disk):
# before a build, the stores of checkouts that no longer exist are removed and, while the free space is
# below TOKENFAN_IMAGE_NEED_GIB (default 11), the least recently used stores of other checkouts not used
# for an hour; an outdated image of this checkout is removed before it is built again. Only stores under
# $TOKENFAN_IMAGE_STORES (default /var/tmp/tokenfan-image) are ever pruned, and only when this checkout's
# store is there too (never the siblings of a TOKENFAN_IMAGE_STORE).
#
# An image whose tokenfan.source-hash label matches the inputs (the Dockerfile and what it copies) is not
# built again (TOKENFAN_IMAGE_REBUILD=1 forces it). Prints the image's size and the build's wall time at
# the end (docs/deploy.md records them).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# One store per checkout: a `make clean` or a build in another clone on the same machine must not remove
# or retag this one's images (seen: a clean in one clone broke a build running in another).
STORES="${TOKENFAN_IMAGE_STORES:-/var/tmp/tokenfan-image}"
STORE="${TOKENFAN_IMAGE_STORE:-$STORES/$(basename "$ROOT")-$(printf %s "$ROOT" | sha256sum | cut -c1-8)}"
NEED_MIB=$(( ${TOKENFAN_IMAGE_NEED_GIB:-11} * 1024 ))
BASE_TAG="localhost/tokenfan-base:bookworm-python3.11"
DEBIAN_MIRROR="${TOKENFAN_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
TORCH_VERSION="2.13.0"
OFFICIAL_CPU_BASE="python:3.11-slim"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"

log() { printf 'image.sh: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

# buildah with its own storage (never the system's /var/lib/containers). The overlay driver where the
# kernel mounts overlayfs here (a container is then a thin layer: seconds to make), else vfs (each
# container a full copy of the image: about a minute for this one). TOKENFAN_IMAGE_DRIVER=vfs|overlay
# chooses. The build cache mounts go to $STORE/tmp (buildah puts them under TMPDIR).
driver() {
    if [ -n "${TOKENFAN_IMAGE_DRIVER:-}" ]; then echo "$TOKENFAN_IMAGE_DRIVER"; return; fi
    if [ -f "$STORE/driver" ]; then cat "$STORE/driver"; return; fi
    local d="$STORE/overlay-probe" found=vfs
    mkdir -p "$d"/{lower,upper,work,merged}
    if mount -t overlay overlay -o "lowerdir=$d/lower,upperdir=$d/upper,workdir=$d/work" "$d/merged" 2>/dev/null; then
        umount "$d/merged"
        found=overlay
    fi
    rm -rf "$d"
    echo "$found" > "$STORE/driver"
    echo "$found"
}

buildah_args() {
    local drv
    drv=$(driver)
    echo --root "$STORE/storage-$drv" --runroot "$STORE/run-$drv" --storage-driver "$drv"
}

bah() {
    mkdir -p "$STORE/tmp"
    mark_used
    # shellcheck disable=SC2046
    TMPDIR="$STORE/tmp" buildah $(buildah_args) "$@"
}

tool() {
    if [ -n "${TOKENFAN_IMAGE_TOOL:-}" ]; then echo "$TOKENFAN_IMAGE_TOOL"; return; fi
    if command -v docker >/dev/null 2>&1 && timeout 20 docker info >/dev/null 2>&1; then echo docker; return; fi
    if command -v buildah >/dev/null 2>&1; then echo buildah; return; fi
    echo none
}

# Does a registry answer? (a DNS failure or refusal answers at once; a hang is cut after 15 s)
reachable() { timeout 15 python3 -c "import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=12)
except urllib.error.HTTPError:
    pass  # an HTTP answer (401 from a registry) is an answer
" "$1" >/dev/null 2>&1; }

# The sources of a Dockerfile's COPY instructions from the build context (the repository root), one a line:
# read from the Dockerfile itself, so what is hashed is what is copied (a COPY --from= copies from another
# image, not the context). The JSON form and line continuations are refused, not misread.
copied_sources() {
    awk 'toupper($1) == "COPY" {
           if ($0 ~ /\[/ || $0 ~ /\\$/) { print "unsupported COPY: " $0 > "/dev/stderr"; bad = 1; next }
           from = 0; n = 0
           for (i = 2; i < NF; i++) { if ($i ~ /^--from=/) from = 1; else if ($i !~ /^--/) src[n++] = $i }
           if (!from) for (j = 0; j < n; j++) print src[j] }
         END { exit bad }' "$1"
}

# sha256 of the Dockerfile, its .dockerignore and every file its COPY instructions take from the context
# (less what the .dockerignore drops from them: __pycache__ and *.pyc)
source_hash() {
    local dockerfile="deploy/docker/Dockerfile.$1" sources
    sources=$(cd "$ROOT" && copied_sources "$dockerfile") || die "cannot read the COPY sources of $dockerfile"
    [ -n "$sources" ] || die "$dockerfile copies nothing from the build context"
    # shellcheck disable=SC2086  # the sources are paths without spaces, one per COPY argument
    (cd "$ROOT" && find "$dockerfile" "$dockerfile.dockerignore" $sources \
        -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum) \
        | sha256sum | cut -c1-16
}

# -- the stores: which checkout each belongs to, when it was last used, pruning -------------------------

mark_used() {
    mkdir -p "$STORE"
    printf '%s\n' "$ROOT" > "$STORE/checkout"
    touch "$STORE/used"
}

free_mib() { df -Pm "$1" | awk 'NR == 2 {print $4}'; }

remove_store() {
    local s="$1"
    grep -o " $s/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount 2>/dev/null || true
    chmod -R u+w "$s" 2>/dev/null || true   # vfs layers hold read-only directories
    rm -rf "$s"
}

# The other stores under $STORES, least recently used first: "<last use, epoch s> <dir>" (for a store made
# before stores recorded their use, its directory's time).
other_stores() {
    local s
    for s in "$STORES"/*/; do
        s="${s%/}"
        [ "$s" != "$STORE" ] || continue
        [ -f "$s/driver" ] || [ -f "$s/checkout" ] || continue   # a store, nothing else
        if [ -f "$s/used" ]; then echo "$(stat -c %Y "$s/used") $s"; else echo "$(stat -c %Y "$s") $s"; fi
    done | sort -n
}

prune_stores() {
    [ -z "${TOKENFAN_IMAGE_STORE:-}" ] && [ -d "$STORES" ] || return 0
    local t s owner
    while read -r t s; do
        [ -f "$s/checkout" ] || continue
        owner=$(cat "$s/checkout")
        [ -f "$owner/deploy/image.sh" ] && continue
        log "removing the image store of $owner (that checkout is gone): $s"
        remove_store "$s"
    done < <(other_stores)
    while read -r t s; do
        [ "$(free_mib "$STORES")" -lt "$NEED_MIB" ] || break
        [ $(( $(date +%s) - t )) -gt 3600 ] || break
        log "$(free_mib "$STORES") MiB free, a build needs about $NEED_MIB: removing the least recently used image store $s ($(du -sh "$s" 2>/dev/null | cut -f1), last used $(date -d "@$t" '+%F %T'))"
        remove_store "$s"
    done < <(other_stores)
}

# Before a build: prune, then say plainly when the disk is still short.
check_space() {
    prune_stores
    local free
    mkdir -p "$STORE"
    free=$(free_mib "$STORE")
    if [ "$free" -lt 4096 ]; then
        die "only $free MiB free under $STORE: the image alone takes 3.1 GiB and a build about $NEED_MIB MiB; free some space (other checkouts' \`deploy/image.sh clean\`) or set TOKENFAN_IMAGE_STORE"
    elif [ "$free" -lt "$NEED_MIB" ]; then
        log "warning: $free MiB free under $STORE, a build needs about $NEED_MIB MiB at its peak (TOKENFAN_IMAGE_NEED_GIB); trying anyway"
    fi
}

local_torch_wheel() {
    local dirs d
    dirs="${PIP_FIND_LINKS:-} $(pip config get global.find-links 2>/dev/null || true) /opt/wheels"
    for d in $dirs; do
        d="${d#file://}"
        ls "$d"/torch-"$TORCH_VERSION"+cpu-cp311-*.whl >/dev/null 2>&1 && { echo "$d"; return 0; }
    done
    return 1
}

make_base() {
    command -v mmdebstrap >/dev/null 2>&1 || die "mmdebstrap is not installed (make image-deps)"
    mkdir -p "$STORE"
    local tar="$STORE/base.tar" started=$SECONDS
    log "making $BASE_TAG from $DEBIAN_MIRROR (mmdebstrap bookworm + python3.11)"
    # minbase: Essential (passwd, util-linux, …) + apt; the venv is the python:3.11-slim layout's stand-in.
    mmdebstrap --variant=minbase --mode=root --format=tar \
        --include=python3.11,python3.11-venv,ca-certificates \
        --customize-hook='chroot "$1" python3.11 -m venv /opt/python' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
        bookworm "$tar" \
        "deb $DEBIAN_MIRROR bookworm main" \
        "deb $DEBIAN_MIRROR bookworm-updates main" \
        "deb ${DEBIAN_MIRROR%/debian}/debian-security bookworm-security main"
    local ctr
    bah rmi -f "$BASE_TAG" >/dev/null 2>&1 || true
    ctr=$(bah from scratch)
    bah add "$ctr" "$tar" / >/dev/null
    bah config --env PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 --cmd python3 \
        --label org.opencontainers.image.description="Debian bookworm + Python 3.11 (venv /opt/python)" "$ctr"
    bah commit --rm "$ctr" "$BASE_TAG" >/dev/null
    rm -f "$tar"
    log "base $BASE_TAG made in $((SECONDS - started)) s"
}

build() {
    local variant="${1:-cpu}" t base args=() started=$SECONDS
    local dockerfile="deploy/docker/Dockerfile.$variant" tag="tokenfan:$variant" hash
    [ -f "$ROOT/$dockerfile" ] || die "no $dockerfile"
    t=$(tool)
    [ "$t" != none ] || die "no image builder: neither a Docker daemon nor buildah (make image-deps installs buildah)"
    hash=$(source_hash "$variant")
    if [ -z "${TOKENFAN_IMAGE_REBUILD:-}" ] && [ "$(built_hash "$t" "$tag")" = "$hash" ]; then
        log "$tag is up to date (source hash $hash); TOKENFAN_IMAGE_REBUILD=1 builds it again"
        where_is "$t" "$tag"
        return 0
    fi
    args+=(--label "tokenfan.source-hash=$hash")
    if [ "$t" = buildah ]; then
        check_space
        # the outdated images: replaced by this build anyway, and their 3 GiB may be what it needs
        local outdated=("localhost/$tag")
        [ "$variant" != cpu ] || outdated+=(localhost/tokenfan:gpu-dry localhost/tokenfan-gpu-standin:vllm-cpu)
        bah rmi -f "${outdated[@]}" >/dev/null 2>&1 || true
    fi

    local want="${TOKENFAN_IMAGE_BASE:-auto}"
    if [ "$variant" = cpu ]; then
        if [ "$want" = auto ]; then
            if reachable https://registry-1.docker.io/v2/; then want=official; else want=debian; fi
        fi
        if [ "$want" = debian ]; then
            [ "$t" = buildah ] || die "the Debian base is made with buildah; use TOKENFAN_IMAGE_BASE=official with docker"
            if [ -n "${TOKENFAN_IMAGE_REBASE:-}" ] || ! bah inspect --type image "$BASE_TAG" >/dev/null 2>&1; then
                make_base
            fi
            base="$BASE_TAG"
            args+=(--build-arg "BASE_IMAGE=$base")
        else
            base="$OFFICIAL_CPU_BASE"
        fi
        if ! reachable "$TORCH_CPU_INDEX/torch/"; then
            local wheels
            wheels=$(local_torch_wheel) || die "the PyTorch CPU index is not reachable and no local torch $TORCH_VERSION+cpu wheel was found"
            [ "$t" = buildah ] || die "the PyTorch CPU index is not reachable; a local wheel can be mounted with buildah only"
            log "PyTorch CPU index not reachable: torch from $wheels (mounted read-only), the rest from PyPI"
            args+=(-v "$wheels:/mnt/wheels:ro" --build-arg "TORCH_INDEX_URL=https://pypi.org/simple"
                   --build-arg "PIP_FIND_LINKS=/mnt/wheels")
        fi
    else
        if [ "$want" = debian ] || { [ "$want" = auto ] && ! reachable https://registry-1.docker.io/v2/; }; then
            die "the GPU image's base (vllm/vllm-openai) cannot be pulled here: no registry reachable"
        fi
        base="(Dockerfile default)"
    fi

    # pip behind a TLS-intercepting proxy: the host's CA bundle (pip's `cert` setting), mounted for the build
    local cert="${PIP_CERT:-$(pip config get global.cert 2>/dev/null || true)}"
    if [ -n "$cert" ] && [ -f "$cert" ] && [ "$t" = buildah ]; then
        args+=(-v "$cert:/mnt/pip-cert.pem:ro" --build-arg "PIP_CERT=/mnt/pip-cert.pem")
    fi

    log "building $tag from $dockerfile with $t, base $base"
    cd "$ROOT"
    if [ "$t" = docker ]; then
        DOCKER_BUILDKIT=1 docker build -f "$dockerfile" -t "$tag" "${args[@]}" .
        log "size: $(docker image inspect -f '{{.Size}}' "$tag") bytes"
    else
        bah bud --isolation chroot --network host --pull=false --layers=false \
            --ignorefile "$dockerfile.dockerignore" -f "$dockerfile" -t "localhost/$tag" "${args[@]}" .
        bah rmi --prune >/dev/null 2>&1 || true   # the image this one replaced (vfs: a full copy each)
        bah images --filter "reference=localhost/$tag" >&2
        log "size: $(image_size "localhost/$tag") (uncompressed, as buildah lists it)"
    fi
    log "built $tag in $((SECONDS - started)) s"
    where_is "$t" "$tag"
}

# Where the image is, and how to reach it: with buildah it is in this checkout's own store, which a bare
# `buildah images` (the default store) does not list. docs/deploy.md's "After make image" has the rest.
where_is() {
    local t="$1" tag="$2"
    if [ "$t" = docker ]; then
        log "$tag is in Docker's image store: docker images tokenfan; docker run --rm -p 8000:8000 $tag"
        return
    fi
    log "localhost/$tag is in this checkout's buildah store, $STORE (a bare \`buildah images\` does not list it):"
    log "  list:   buildah \$(deploy/image.sh buildah-args) images"
    log "  export: buildah \$(deploy/image.sh buildah-args) push localhost/$tag oci-archive:tokenfan-${tag#tokenfan:}.tar"
    log "  run it (chroot isolation, no container runtime needed), push it: docs/deploy.md, \"After make image\""
}

built_hash() {
    local fmt='{{index .Config.Labels "tokenfan.source-hash"}}'
    if [ "$1" = docker ]; then docker image inspect -f "$fmt" "$2" 2>/dev/null || true
    else bah inspect --type image -f '{{index .OCIv1.Config.Labels "tokenfan.source-hash"}}' "localhost/$2" 2>/dev/null || true
    fi
}

# Uncompressed size: the sum of the image's layer sizes, as buildah's storage records them.
image_size() {
    bah images --format '{{.Size}}' --filter "reference=$1" | head -1
}

gpu_dry() {
    if [ "$(tool)" != buildah ]; then log "GPU dry build skipped: it uses buildah"; return 0; fi
    build cpu
    if [ -z "${TOKENFAN_IMAGE_REBUILD:-}" ] && [ "$(built_hash buildah tokenfan:gpu-dry)" = "$(source_hash gpu)-$(built_hash buildah tokenfan:cpu)" ]; then
        log "tokenfan:gpu-dry is up to date"
        return 0
    fi
    local standin="localhost/tokenfan-gpu-standin:vllm-cpu" ctr started=$SECONDS args=()
    ctr=$(bah from --pull=false localhost/tokenfan:cpu)
    # the VOLUMEs first: buildah run would mount them over the directories being removed
    bah config --user root --workingdir / --entrypoint '[]' --cmd '[]' --env HOME=/root \
        --volume /run/tokenfan- --volume /var/cache/tokenfan- --volume /tmp- "$ctr"
    bah run --isolation chroot --network host "$ctr" -- sh -c \
        'pip uninstall -y -q tokenfan && userdel -r tokenfan && rm -rf /opt/tokenfan /run/tokenfan /var/cache/tokenfan'
    bah commit --rm "$ctr" "$standin" >/dev/null
    local cert="${PIP_CERT:-$(pip config get global.cert 2>/dev/null || true)}"
    if [ -n "$cert" ] && [ -f "$cert" ]; then
        args+=(-v "$cert:/mnt/pip-cert.pem:ro" --build-arg "PIP_CERT=/mnt/pip-cert.pem")
    fi
    cd "$ROOT"
    bah bud --isolation chroot --network host --pull=false --layers=false \
        --ignorefile deploy/docker/Dockerfile.gpu.dockerignore -f deploy/docker/Dockerfile.gpu \
        --build-arg "VLLM_IMAGE=$standin" --label "tokenfan.source-hash=$(source_hash gpu)-$(built_hash buildah tokenfan:cpu)" \
        -t localhost/tokenfan:gpu-dry "${args[@]}" .
    bah rmi --prune >/dev/null 2>&1 || true
    log "size: $(image_size localhost/tokenfan:gpu-dry) (uncompressed; the stand-in base is the CPU image)"
    log "GPU dry build (FROM $standin) in $((SECONDS - started)) s"
}

clean() {
    if [ -d "$STORE" ]; then
        if command -v buildah >/dev/null 2>&1 && [ -f "$STORE/driver" ]; then
            bah rm --all >/dev/null 2>&1 || true
            # overlay: buildah's own unmount of its layers before the files go
            umount -R "$STORE/storage-overlay/overlay" 2>/dev/null || true
            grep -o " $STORE/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount 2>/dev/null || true
        fi
        # vfs layers hold read-only directories (and root-owned files): make them removable first
        chmod -R u+w "$STORE" 2>/dev/null || true
        rm -rf "$STORE"
    fi
}

case "${1:-build}" in
    build) shift || true; build "${1:-cpu}" ;;
    cpu|gpu) build "$1" ;;
    base) make_base ;;
    gpu-dry) gpu_dry ;;
    tool) tool ;;
    hash) source_hash "${2:-cpu}" ;;
    sources) (cd "$ROOT" && copied_sources "deploy/docker/Dockerfile.${2:-cpu}") ;;
    store) echo "$STORE" ;;
    buildah-args) mark_used; buildah_args ;;
    prune) prune_stores ;;
    clean) clean ;;
    *) die "usage: $0 [build [cpu|gpu]|base|gpu-dry|tool|hash|sources|store|buildah-args|clean|prune]" ;;
esac
