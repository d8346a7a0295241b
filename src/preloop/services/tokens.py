"""ACTIONS_RUNTIME_TOKEN: a JWT (HS256) that GitHub's clients read and our services verify.

The clients decode it without verifying and read the `scp` claim
(`Actions.Results:<runBackendId>:<jobBackendId>`); the services verify the
signature with the secret of the service instance that minted it, then take
the run, job, repository and ref from its claims, never from the request. A
token of one run therefore reaches only that run's artifacts, and the caches
of its own repository.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Claims", "TokenError", "mint", "verify"]


class TokenError(Exception):
    """A token that is malformed, expired or not signed by this service."""


@dataclass(frozen=True, slots=True)
class Claims:
    run: str  # the run's backend id (preloop run id)
    job: str  # the job's backend id (the job id)
    repo: str  # cache scope: the repository
    ref: str  # cache scope: the ref the run is on
    default_ref: str  # caches of the default branch are readable from every ref
    # a pull request's base branch: its caches are read after the run's own ref's
    base_ref: str = ""
    # the runs this one re-runs, newest first: their artifacts are read after
    # its own (a re-run is one workflow run on GitHub, its attempts share them)
    earlier: tuple[str, ...] = ()

    def artifact_runs(self) -> list[str]:
        """The runs whose artifacts this token reads, its own first."""
        return [self.run, *self.earlier]

    def cache_refs(self) -> list[str]:
        """The refs whose caches this token reads, in GitHub's order: the
        run's own ref, a pull request's base branch, the default branch."""
        return [r for r in dict.fromkeys((self.ref, self.base_ref, self.default_ref)) if r]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def mint(secret: bytes, claims: Claims, ttl: float = 24 * 3600.0) -> str:
    now = int(time.time())
    payload: dict[str, Any] = {
        "scp": f"Actions.GenericRead:{claims.run} Actions.Results:{claims.run}:{claims.job}",
        "iat": now,
        "exp": now + int(ttl),
        "preloop": {
            "run": claims.run,
            "job": claims.job,
            "repo": claims.repo,
            "ref": claims.ref,
            "default_ref": claims.default_ref,
            "base_ref": claims.base_ref,
            "earlier": list(claims.earlier),
        },
    }
    head = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    body = _b64(json.dumps(payload, separators=(",", ":")).encode())
    sig = hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64(sig)}"


def verify(secret: bytes, token: str) -> Claims:
    parts = token.split(".")
    if len(parts) != 3:
        raise TokenError("not a JWT")
    want = hmac.new(secret, f"{parts[0]}.{parts[1]}".encode(), hashlib.sha256).digest()
    try:
        got = _unb64(parts[2])
        payload = json.loads(_unb64(parts[1]))
    except ValueError:
        raise TokenError("malformed token") from None
    if not hmac.compare_digest(want, got):
        raise TokenError("bad signature")
    if not isinstance(payload, dict) or int(payload.get("exp", 0)) < time.time():
        raise TokenError("expired token")
    p = payload.get("preloop")
    if not isinstance(p, dict):
        raise TokenError("token without preloop claims")
    earlier = p.get("earlier")
    return Claims(
        str(p.get("run", "")),
        str(p.get("job", "")),
        str(p.get("repo", "")),
        str(p.get("ref", "")),
        str(p.get("default_ref", "")),
        str(p.get("base_ref", "")),
        tuple(str(r) for r in earlier) if isinstance(earlier, list) else (),
    )
