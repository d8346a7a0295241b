#!/bin/sh
# The minimal git plumbing that gives the same result as a workspace capture:
# a reused index, `git add -A`, `write-tree`, `commit-tree` into a bare
# repository whose alternates point at the workspace's objects.
#
#   snapshot_plumbing.sh WORKSPACE ALT_REPO INDEX_FILE [seed]
#
# With `seed`, the index starts as a copy of the workspace's own .git/index
# (cold, with the user's stat data); otherwise it is reset to HEAD, keeping the
# stat data of a persisted INDEX_FILE (warm) or hashing every file (cold).
set -eu
ws=$1 alt=$2 idx=$3
if [ ! -d "$alt" ]; then
    git init -q --bare "$alt"
    echo "$ws/.git/objects" > "$alt/objects/info/alternates"
fi
export GIT_DIR="$ws/.git" GIT_WORK_TREE="$ws" GIT_INDEX_FILE="$idx"
export GIT_OBJECT_DIRECTORY="$alt/objects" GIT_ALTERNATE_OBJECT_DIRECTORIES="$ws/.git/objects"
if [ "${4:-}" = seed ]; then
    cp "$ws/.git/index" "$idx"
else
    git read-tree --reset HEAD
fi
git add --all
tree=$(git write-tree)
commit=$(GIT_AUTHOR_NAME=p GIT_AUTHOR_EMAIL=p@p GIT_COMMITTER_NAME=p GIT_COMMITTER_EMAIL=p@p \
    GIT_AUTHOR_DATE='@0 +0000' GIT_COMMITTER_DATE='@0 +0000' \
    git commit-tree "$tree" -p HEAD -m snapshot)
git --git-dir="$alt" update-ref refs/heads/snapshot "$commit"
