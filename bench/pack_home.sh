# Sourced by bench/gpu_env.sh (needs `out` and INFERSMITH_HOME): pack_home leaves the tracking
# store in $out/home.tgz and, with ARCHIVE set, everything in `out` in one more file (tar.gz),
# rewritten each time: a remote runner that returns only a few files per run gets one
# that holds them all.
pack_home() {
    # beside it under a hidden name, then renamed: a kill mid-way leaves the last whole one
    tar czf "$out/.home.tgz.part" -C "$(dirname "$INFERSMITH_HOME")" "$(basename "$INFERSMITH_HOME")" \
        && mv "$out/.home.tgz.part" "$out/home.tgz" || { rm -f "$out/.home.tgz.part"; return 1; }
    if [ -n "${ARCHIVE:-}" ]; then
        # Written beside the archive under a hidden name and renamed, so that a kill mid-way
        # leaves the last whole archive; the archive may lie inside `out` (OUT=/tmp/r
        # ARCHIVE=/tmp/r/r.tgz), so it and its hidden copies are left out of what is packed.
        local name part
        name=$(basename "$ARCHIVE")
        part=$(mktemp "$(dirname "$ARCHIVE")/.$name.XXXXXX") || return 1
        chmod 644 "$part"
        tar czf "$part" --exclude="./$name" --exclude="./.$name.*" --exclude="./.home.tgz.part" -C "$out" . \
            && mv "$part" "$ARCHIVE" \
            || { rm -f "$part"; return 1; }
    fi
}
