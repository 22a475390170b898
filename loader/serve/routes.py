"""The Hub's read routes, as pure functions from a parsed request to a response.

URL shapes (as huggingface_hub sends them; `rev` is one percent-encoded segment):
  HEAD|GET [/{models|datasets|spaces|kernels}]/{org}/{name}/resolve/{rev}/{path}
  GET /api/{type}s/{org}/{name}[/revision/{rev}]      repo info
  GET /api/{type}s/{org}/{name}/refs[?include_prs=1]
  GET /api/{type}s/{org}/{name}/tree/{rev}[/{path}]?recursive=&expand=
  GET /api/{type}s/{org}/{name}/commits/{rev}
  GET /api/organizations/{org}/overview
  GET /_lfs/{org}/{name}/{sha256}?commit=&path=         LFS bytes (the "CDN" that resolve redirects to)
Errors are 404s with the Hub's X-Error-Code / X-Error-Message headers, and a JSON body.
"""

from __future__ import annotations

from urllib.parse import unquote

from .api import api
from .files import lfs_object, resolve
from .protocol import REPO_TYPES, HubError, Request, Response, ServerContext, route_not_found


def dispatch(server: ServerContext, req: Request) -> Response:
    """Answer one GET or HEAD request."""
    try:
        return _route(server, req)
    except HubError as err:
        return err.response()


def _route(server: ServerContext, req: Request) -> Response:
    if not req.path.startswith("/"):  # "*", or a target in another form than origin-form
        raise route_not_found(req.path)
    segs = req.path.split("/")[1:]
    if segs[0] == "api":
        return api(server, req, segs[1:])
    if segs[0] == "_lfs" and len(segs) == 4:
        return lfs_object(server, req, segs[1], segs[2], segs[3])
    if len(segs) >= 6 and segs[0] in REPO_TYPES and segs[3] == "resolve":
        return resolve(server, req, segs[1], segs[2], unquote(segs[4]), "/".join(segs[5:]))
    if len(segs) >= 5 and segs[2] == "resolve":
        return resolve(server, req, segs[0], segs[1], unquote(segs[3]), "/".join(segs[4:]))
    raise route_not_found(req.path)
