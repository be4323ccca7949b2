#!/usr/bin/env bash
# Prints which top-level module of src/ uses which (`crate::x` paths, `crate::{x, y}`
# groups), and fails when the uses form a cycle (two modules using each other, or a longer
# loop) or when src/error.rs uses any other module of the crate.
set -euo pipefail
cd "$(dirname "$0")/../src"
edges=$(
    for f in $(find . -name '*.rs'); do
        from=${f#./}; from=${from%%/*}; from=${from%.rs}
        {
            grep -ho 'crate::[a-z_]*' "$f" || true
            grep -ho 'crate::{[^}]*' "$f" | sed 's/crate::{//' | tr ',' '\n' || true
        } | sed 's/^ *//; s/^crate:://; s/[^a-z_].*//' | sed "s/^/$from /"
    done | awk '$1 != $2 && $2 != ""' | sort -u
)
echo "$edges" | awk '{ deps[$1] = deps[$1] " " $2 } END { for (m in deps) print m " ->" deps[m] }' | sort
status=0
if ! loops=$(tsort <<<"$edges" 2>&1 >/dev/null) || [[ -n "$loops" ]]; then
    echo "modules use each other in a loop:" >&2
    echo "$loops" >&2
    status=1
fi
if grep -q '^error ' <<<"$edges"; then
    echo "error.rs uses another module: $(grep '^error ' <<<"$edges" | cut -d' ' -f2 | xargs)" >&2
    status=1
fi
if [[ $status == 0 ]]; then
    echo "no loop among the modules; error.rs uses none"
fi
exit $status
