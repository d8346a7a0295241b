"""Actions: `uses:` resolved (local, `owner/repo@ref`, `docker://`) and run.

- `reference`: what a `uses:` names; `--action` / PRELOOP_ACTION_OVERRIDES overrides;
- `cache`: resolution with git and the action cache under `<state>/actions/`;
- `metadata`: action.yml; `node`: which node runs JavaScript actions;
- `steps`: pre/main/post of actions inside a job (used by `preloop.runner.job`);
- `workflows`: remote reusable workflows resolved through the cache at plan time.
"""

from preloop.actions.cache import ActionCache, ActionFetchError, actions_dir
from preloop.actions.metadata import ActionMetadata, ActionMetadataError, load_action
from preloop.actions.reference import Override, Overrides, RemoteRef, parse_overrides, parse_uses

__all__ = [
    "ActionCache",
    "ActionFetchError",
    "ActionMetadata",
    "ActionMetadataError",
    "Override",
    "Overrides",
    "RemoteRef",
    "actions_dir",
    "load_action",
    "parse_overrides",
    "parse_uses",
]
