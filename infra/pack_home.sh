# Sourced by infra/gpu_env.sh (needs `out` and INFERSMITH_HOME): pack_home leaves the tracking
# store in $out/home.tgz and, with ARCHIVE set, everything in `out` in one more file (tar.gz),
# rewritten each time: a device that returns only a few files per call (the lent H200: 8) gets
# one that holds them all.
pack_home() {
    tar czf "$out/home.tgz" -C "$(dirname "$INFERSMITH_HOME")" "$(basename "$INFERSMITH_HOME")" || return 1
    # The archive may lie inside `out` (OUT=/tmp/r ARCHIVE=/tmp/r/r.tgz): it is left out of itself,
    # and written elsewhere first, so that tar sees the folder unchanged while it reads it.
    if [ -n "${ARCHIVE:-}" ]; then
        local part
        part=$(mktemp "${TMPDIR:-/tmp}/pack_home.XXXXXX") || return 1
        tar czf "$part" --exclude="./$(basename "$ARCHIVE")" -C "$out" . && mv "$part" "$ARCHIVE" \
            || { rm -f "$part"; return 1; }
    fi
}
