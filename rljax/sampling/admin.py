"""The server's admin surface: bearer-token authentication, and `/update_weights`' path and version rules.

- Authentication: `Authorization: Bearer <token>`, compared in constant time
  with the server's `admin_token` (or `$RLJAX_ADMIN_TOKEN`). A server started
  without a token refuses every admin request (403): weight updates are off
  unless an operator turned them on.
- Paths: only directories under `weights_root`. The client's path (absolute,
  or relative to the root) must not contain `..`; it is resolved with
  symlinks followed and must stay under the resolved root, and no symlink
  inside the checkpoint may point out of it. Errors name the path as the
  client sent it, never a listing, and never say whether a path outside the
  root exists.
- Versions: integers in [0, MAX_VERSION] that only increase. Re-sending the
  current version from the same checkpoint (a retried push) is accepted;
  `reset: true` lets a restarted trainer install an older version on purpose
  (logged).
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import os
import pathlib

log = logging.getLogger("rljax.serve")

ENV_TOKEN = "RLJAX_ADMIN_TOKEN"
# Exact in every JSON parser (doubles), and far beyond any run's step count.
MAX_VERSION = 2**53 - 1


class AdminError(Exception):
    """An admin request refused with an HTTP status and a message safe to show the client."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def resolve_token(configured: str) -> str:
    """The admin token: the config's, else $RLJAX_ADMIN_TOKEN, else "" (admin endpoints off)."""
    return configured or os.environ.get(ENV_TOKEN, "")


def check_bearer(header: str | None, token: str) -> None:
    """Raises AdminError unless `header` is `Bearer <token>` (token compared in constant time)."""
    if not token:
        raise AdminError(403, f"admin endpoints are disabled on this server: start it with admin_token "
                              f"(or ${ENV_TOKEN}) and weights_root", "PermissionDeniedError")
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise AdminError(401, "admin endpoint: send the admin token as 'Authorization: Bearer <token>'",
                         "AuthenticationError")
    if not hmac.compare_digest(given.strip().encode("utf-8"), token.encode("utf-8")):
        raise AdminError(401, "admin endpoint: wrong admin token", "AuthenticationError")


class WeightsRoot:
    """The one directory tree `/update_weights` may read."""

    def __init__(self, root: str | os.PathLike):
        self.root = pathlib.Path(root).resolve(strict=True)
        if not self.root.is_dir():
            raise ValueError(f"weights_root {os.fspath(root)!r} is not a directory")

    def resolve(self, path: str) -> pathlib.Path:
        """The resolved directory for the client's `path`; AdminError (400/403/404) otherwise."""
        if not path or "\x00" in path:
            raise AdminError(400, "path: must be a non-empty directory name without NUL characters")
        given = pathlib.PurePath(path)
        if ".." in given.parts:
            raise AdminError(400, f"path {path!r}: '..' is not allowed")
        candidate = pathlib.Path(path) if given.is_absolute() else self.root / given
        resolved = candidate.resolve(strict=False)  # follows every symlink that exists
        if not resolved.is_relative_to(self.root):
            # The same answer whether or not the path exists outside the root.
            raise AdminError(403, f"path {path!r} is outside this server's weights root", "PermissionDeniedError")
        if not resolved.is_dir():
            raise AdminError(404, f"path {path!r}: no checkpoint directory under the weights root",
                             "NotFoundError")
        return resolved

    def check_links(self, directory: pathlib.Path) -> None:
        """AdminError 403 if a symlink anywhere under `directory` leads out of the root."""
        for parent, dirs, files in os.walk(directory, followlinks=False):
            for name in dirs + files:
                entry = pathlib.Path(parent) / name
                if entry.is_symlink() and not entry.resolve(strict=False).is_relative_to(self.root):
                    raise AdminError(403, "the checkpoint contains a symlink that leads outside the weights root",
                                     "PermissionDeniedError")

    def scrub(self, message: str) -> str:
        """`message` with the root's absolute path replaced by "<weights_root>"."""
        return message.replace(str(self.root), "<weights_root>")


@dataclasses.dataclass
class VersionState:
    """The served weights' version and where they came from (None: the initial weights)."""

    version: int = 0
    source: tuple[str, int] | None = None

    def next(self, requested: int | None, source: tuple[str, int], reset: bool) -> int:
        """The version a push of `source` becomes; AdminError 409 when it would go backwards."""
        if requested is None:
            if self.version >= MAX_VERSION:
                raise AdminError(409, f"version: the served version is already MAX_VERSION={MAX_VERSION}",
                                 "ConflictError")
            return self.version + 1
        if reset:
            if requested < self.version:
                log.warning("weights version reset from %d to %d (reset: true)", self.version, requested)
            return requested
        if requested > self.version or (requested == self.version and source == self.source):
            return requested
        raise AdminError(409, f"version {requested} is not above the served version {self.version}; versions only "
                              "increase (a restarted trainer re-pushing older weights sends \"reset\": true)",
                         "ConflictError")
