#!/usr/bin/env bash
# Differential check of the scheduler: the policies crate at an older commit and at this
# checkout, fed the same seeded request stream and the same pool state, must make the same
# decisions (endpoints, prefiller, tiers, totals bit for bit). For refactors that promise no
# change of behaviour.
#
#   bench/decisions-ab/run.sh a45dda3      # the commit before the plan refactor
#
# The older policies crate only needs `Scheduler::new`, `schedule` and `commit` as they were at
# a45dda3 (the API this checker calls for the old side).
set -euo pipefail
rev="${1:?usage: run.sh <older commit>}"
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
work="${CARGO_TARGET_DIR:-$repo/target}/decisions-ab"
mkdir -p "$work"
rm -rf "$work/old"
git -C "$repo" worktree prune
git -C "$repo" worktree add --detach "$work/old" "$rev" >/dev/null
trap 'git -C "$repo" worktree remove --force "$work/old"' EXIT
# Two versions of one package cannot share a lockfile: rename the old one.
sed -i 's/^name = "attache-policies"$/name = "attache-policies-old"/' "$work/old/policies/Cargo.toml"
mkdir -p "$work/crate"
cp -r "$here/src" "$work/crate/"
cat > "$work/crate/Cargo.toml" <<TOML
[package]
name = "decisions-ab"
version = "0.1.0"
edition = "2021"
publish = false

[workspace]

[dependencies]
old = { package = "attache-policies-old", path = "$work/old/policies" }
new = { package = "attache-policies", path = "$repo/policies" }
hashbrown = "0.15"
serde_json = "1"
TOML
cd "$work/crate"
cargo run --release -q
