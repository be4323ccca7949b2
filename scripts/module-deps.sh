#!/usr/bin/env bash
# Prints which top-level module of src/ uses which (`crate::x` paths), and fails when two
# modules use each other or when src/error.rs uses any other module.
set -euo pipefail
cd "$(dirname "$0")/../src"
edges=$(
    for f in $(find . -name '*.rs'); do
        from=${f#./}; from=${from%%/*}; from=${from%.rs}
        { grep -ho 'crate::[a-z_]*' "$f" || true; } | sed "s/crate:://; s/^/$from /"
    done | awk '$1 != $2 && $2 != ""' | sort -u
)
echo "$edges" | awk '{ deps[$1] = deps[$1] " " $2 } END { for (m in deps) print m " ->" deps[m] }' | sort
status=0
while read -r a b; do
    if [[ "$a" < "$b" ]] && grep -qx "$b $a" <<<"$edges"; then
        echo "cycle: $a <-> $b" >&2
        status=1
    fi
done <<<"$edges"
if grep -q '^error ' <<<"$edges"; then
    echo "error.rs uses another module: $(grep '^error ' <<<"$edges" | cut -d' ' -f2 | xargs)" >&2
    status=1
fi
if [[ $status == 0 ]]; then
    echo "no module pair uses each other; error.rs uses none"
fi
exit $status
