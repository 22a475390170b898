"""The JSON API: repo info, refs, tree listings, commits, organization overview."""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from typing import Any
from urllib.parse import unquote

from .git import CommitInfo, Entry, GitRepo, Tree
from .protocol import (
    MAX_NAME_CHARS,
    REPO_TYPES,
    HubError,
    Request,
    Response,
    ServerContext,
    commit_or_404,
    json_response,
    repo_or_404,
    route_not_found,
)


def _iso(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def api(server: ServerContext, req: Request, segs: list[str]) -> Response:
    """Answer /api/<segs...> (raw path segments after "api")."""
    if len(segs) == 3 and segs[0] == "organizations" and segs[2] == "overview":
        return _org_overview(server, unquote(segs[1]))
    if len(segs) < 3 or segs[0] not in REPO_TYPES:
        raise route_not_found(req.path)
    repo_type, org, name, rest = REPO_TYPES[segs[0]], segs[1], segs[2], segs[3:]
    repo = repo_or_404(server, org, name)
    repo_id = f"{org}/{name}"
    if not rest:
        return _info(repo, repo_id, repo_type, None, req.flag("blobs"))
    head, args = rest[0], [unquote(s) for s in rest[1:]]
    if head == "revision" and args:
        return _info(repo, repo_id, repo_type, "/".join(args), req.flag("blobs"))
    if head == "refs" and not args:
        return _refs(repo, req.flag("include_prs"))
    if head == "tree" and args:
        path = "/".join(args[1:]).strip("/")
        return _tree(
            server, repo, repo_id, args[0], path, req.flag("recursive"), req.flag("expand")
        )
    if head == "commits" and len(args) == 1:
        return _commits(repo, args[0])
    raise route_not_found(req.path)


def _info(repo: GitRepo, repo_id: str, repo_type: str, rev: str | None, blobs: bool) -> Response:
    if rev is None:  # the default branch; a repo without commits still exists
        refs = repo.refs()
        sha = refs.commits.get(refs.head) if refs.head else None
    else:
        sha = commit_or_404(repo, rev)
    org = repo_id.split("/")[0]
    info: dict[str, Any] = {
        "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
        "id": repo_id,
        "author": org,
        "sha": sha,
        "private": False,
        "gated": False,
        "disabled": False,
        "tags": [],
        "downloads": 0,
        "likes": 0,
    }
    if repo_type == "model":
        info["modelId"] = repo_id
    if sha is not None:
        history = repo.log(sha)
        info["lastModified"] = _iso(history[0].time)
        info["createdAt"] = _iso(history[-1].time)
    if repo_type != "kernel":  # the Hub's kernel info has no siblings
        tree = repo.tree(sha) if sha else None
        info["siblings"] = (
            [_sibling(tree, e, blobs) for e in tree.walk("") if e.kind == "file"] if tree else []
        )
    return json_response(info)


def _sibling(tree: Tree, entry: Entry, blobs: bool) -> dict[str, Any]:
    sibling: dict[str, Any] = {"rfilename": entry.path}
    if blobs:
        pointer = tree.pointers.get(entry.path)
        sibling["blobId"] = entry.oid
        sibling["size"] = pointer.size if pointer else entry.size
        if pointer:
            sibling["lfs"] = {
                "sha256": pointer.oid,
                "size": pointer.size,
                "pointerSize": pointer.pointer_size,
            }
    return sibling


def _refs(repo: GitRepo, include_prs: bool) -> Response:
    groups: dict[str, list[dict[str, str]]] = {
        "branches": [],
        "tags": [],
        "converts": [],
        "pullRequests": [],
    }
    prefixes = {
        "refs/heads/": "branches",
        "refs/tags/": "tags",
        "refs/convert/": "converts",
        "refs/pr/": "pullRequests",
    }
    for ref, sha in sorted(repo.refs().commits.items()):
        for prefix, group in prefixes.items():
            if ref.startswith(prefix):
                groups[group].append({"name": ref[len(prefix) :], "ref": ref, "targetCommit": sha})
    if not include_prs:
        del groups["pullRequests"]
    return json_response(groups)


def _tree(
    server: ServerContext,
    repo: GitRepo,
    repo_id: str,
    rev: str,
    path: str,
    recursive: bool,
    expand: bool,
) -> Response:
    sha = commit_or_404(repo, rev)
    tree = repo.tree(sha)
    if path:
        entry = tree.entries.get(path)
        if entry is None or entry.kind != "directory":
            raise HubError(404, f"Entry not found: {path} is not a directory", "EntryNotFound", sha)
    listed = tree.walk(path) if recursive else tree.children.get(path, [])
    entries = [
        _tree_entry(tree, e, repo.last_commit(sha, e.path) if expand else None) for e in listed
    ]
    hook = server.tree_hook
    if hook is not None:
        entries = hook(repo_id, sha, entries)
    return json_response(entries)


def _tree_entry(tree: Tree, entry: Entry, last: CommitInfo | None) -> dict[str, Any]:
    item: dict[str, Any] = {
        "type": entry.kind,
        "oid": entry.oid,
        "size": entry.size,
        "path": entry.path,
    }
    pointer = tree.pointers.get(entry.path)
    if pointer:
        item["size"] = pointer.size
        item["lfs"] = {
            "oid": pointer.oid,
            "size": pointer.size,
            "pointerSize": pointer.pointer_size,
        }
    if last is not None:
        item["lastCommit"] = {"id": last.sha, "title": last.title, "date": _iso(last.time)}
    return item


def _commits(repo: GitRepo, rev: str) -> Response:
    sha = commit_or_404(repo, rev)
    return json_response(
        [
            {
                "id": c.sha,
                "title": c.title,
                "message": c.message,
                "date": _iso(c.time),
                "authors": [{"user": c.author}],
            }
            for c in repo.log(sha)
        ]
    )


def _org_overview(server: ServerContext, org: str) -> Response:
    if len(org) > MAX_NAME_CHARS or not server.mirror.has_org(org):
        raise HubError(404, f"Organization not found: {org:.100}")
    return json_response(
        {
            "name": org,
            "fullname": org,
            "type": "org",
            "avatarUrl": "",
            "isVerified": False,
            "trustedKernelPublisher": org in server.mirror.trusted_publishers(),
        }
    )
