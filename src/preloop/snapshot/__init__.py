"""Workspace, remote and merge snapshots of git repositories (DESIGN.md section 3).

Paths: `preloop.snapshot.layout`; cache lock and pins: `preloop.snapshot.locks`;
time limits: `preloop.snapshot.limits`; post-capture hooks: `preloop.snapshot.hooks`.
"""
