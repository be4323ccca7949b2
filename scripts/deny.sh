#!/usr/bin/env bash
# `cargo deny check` (advisories, licenses, bans, sources; rules in deny.toml), with a
# pinned cargo-deny built once per machine into the target cache.
#
# The advisory database: a snapshot of RustSec's advisory-db when one is at hand
# (VISIONGATE_ADVISORY_DB, or ../shared/advisory-db beside the clone; it is kept in the
# target cache so later checkouts find it too), checked offline; otherwise cargo-deny
# fetches the live database as usual.
set -euo pipefail
snapshot=${VISIONGATE_ADVISORY_DB:+$(realpath "$VISIONGATE_ADVISORY_DB")}
cd "$(dirname "$0")/.."
source scripts/env.sh

deny=$(install_tool cargo-deny 0.20.2)

# cargo-deny reads a database from a git checkout under db-path (deny.toml), in a folder
# named after the database's URL, and checks how old its last commit is.
dbs=$CARGO_TARGET_DIR/advisory-dbs
db=$dbs/advisory-db-3157b0e258782691
[[ -n $snapshot ]] || { [[ -d ../shared/advisory-db/crates ]] && snapshot=../shared/advisory-db; }
if [[ -n $snapshot ]]; then
  # A snapshot is copied once; a new one replaces it. cargo-deny takes a database's age
  # from its last fetch: here, the snapshot's own date.
  stamp=$(sha256sum < "$snapshot/SNAPSHOT.md" | cut -c1-16)
  if [[ $(cat "$dbs/.snapshot" 2>/dev/null) != "$stamp" ]]; then
    taken=$(grep -oE '[0-9]{4}-[0-9]{2}-[0-9]{2}' "$snapshot/SNAPSHOT.md" | head -1 || true)
    [[ -n $taken ]] || { echo "deny: $snapshot/SNAPSHOT.md gives no date" >&2; exit 2; }
    rm -rf "$dbs" && mkdir -p "$db"
    cp -r "$snapshot/." "$db/"
    git -C "$db" init -q
    git -C "$db" add -A
    GIT_COMMITTER_DATE="${taken}T00:00:00Z" GIT_AUTHOR_DATE="${taken}T00:00:00Z" \
      git -C "$db" -c user.name=visiongate -c user.email=ci@visiongate.invalid \
      commit -qm "RustSec advisory-db snapshot of $taken"
    touch "$db/.git/FETCH_HEAD"
    touch -d "${taken}T00:00:00Z" "$db/.git/FETCH_HEAD" "$db/.git/HEAD"
    echo "$stamp" > "$dbs/.snapshot"
  fi
fi
export VISIONGATE_ADVISORY_DBS=$dbs
offline=()
if [[ -f $dbs/.snapshot ]]; then
  # Every crate of the lock file (all platforms') is on disk first, so the check itself
  # needs no network: not for the crates, not for the database.
  cargo fetch --locked --quiet
  offline=(--offline)
fi
exec "$deny" ${offline[@]+"${offline[@]}"} --log-level warn check \
  advisories licenses bans sources
