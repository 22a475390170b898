"""Issue 15 item 8: a tree listing's `Link: rel=next` is followed only on the endpoint's origin,
never twice to the same page, and at most MAX_LISTING_PAGES times."""

from __future__ import annotations

import pytest
from kernels import hub as hub_client
from kernels.errors import UnsafeResponse

from tests.security.hostile import HostileHub, KernelRepo, hostile, json_reply, simple_kernel

__all__ = ["hostile"]

TREE = r"/api/kernels/evil/relu/tree/[^/]+/build"


def _paged(repo: KernelRepo, next_url, stop_after: int = 50):
    """A tree route whose every page carries the repo's files and `Link: <next_url(n)>; next`.
    After `stop_after` pages it stops linking, so that a client without a bound ends (with a
    wrong answer) instead of hanging the test."""
    count = {"n": 0}

    def answer(_seen, _match):
        count["n"] += 1
        headers = {}
        if count["n"] < stop_after:
            headers["Link"] = f'<{next_url(count["n"])}>; rel="next"'
        return json_reply(repo.listing(), headers=headers)

    return answer


def test_a_next_link_to_the_same_page_is_not_followed_again(hostile):
    repo = KernelRepo("evil/relu", simple_kernel())
    repo.install(hostile)
    url = (
        f"{hostile.url}/api/kernels/evil/relu/tree/{repo.commit}/build?recursive=true&expand=false"
    )
    hostile.route(TREE, _paged(repo, lambda _n: url))
    with pytest.raises(UnsafeResponse, match="loops back"):
        hub_client.list_build_files("evil/relu", repo.commit)
    assert len(hostile.paths("/tree/")) == 1


def test_endless_distinct_pages_stop_at_the_bound(hostile, monkeypatch):
    monkeypatch.setattr(hub_client, "MAX_LISTING_PAGES", 10, raising=False)
    repo = KernelRepo("evil/relu", simple_kernel())
    repo.install(hostile)
    base = f"/api/kernels/evil/relu/tree/{repo.commit}/build"
    hostile.route(TREE, _paged(repo, lambda n: f"{hostile.url}{base}?cursor={n}", stop_after=40))
    with pytest.raises(UnsafeResponse, match="past 10 pages"):
        hub_client.list_build_files("evil/relu", repo.commit)
    assert len(hostile.paths("/tree/")) == 10


def test_a_next_link_to_another_origin_gets_no_request_and_no_token(hostile, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_of_the_user")
    repo = KernelRepo("evil/relu", simple_kernel())
    repo.install(hostile)
    with HostileHub() as elsewhere:
        KernelRepo("evil/relu", simple_kernel()).install(elsewhere)
        target = f"{elsewhere.url}/api/kernels/evil/relu/tree/{repo.commit}/build"
        hostile.route(TREE, _paged(repo, lambda _n: target, stop_after=2))
        with pytest.raises(UnsafeResponse, match="another origin"):
            hub_client.list_build_files("evil/relu", repo.commit)
        assert elsewhere.seen == []
    # The endpoint itself did get the token: the test would show nothing if none were sent.
    first = hostile.seen[0]
    assert first.headers.get("authorization") == "Bearer hf_secret_token_of_the_user"


def test_honest_paging_on_the_same_origin_still_works(hostile):
    files = {**simple_kernel("torch-universal"), **simple_kernel("torch-cpu")}
    repo = KernelRepo("evil/relu", files)
    repo.install(hostile)
    entries = repo.listing()
    half = len(entries) // 2

    def answer(seen, _match):
        if "cursor=2" in seen.path:
            return json_reply(entries[half:])
        # A relative link, as the Hub sends them, with the query the next page needs.
        link = f"/api/kernels/evil/relu/tree/{repo.commit}/build?recursive=true&cursor=2"
        return json_reply(entries[:half], headers={"Link": f'<{link}>; rel="next"'})

    hostile.route(TREE, answer)
    listed = hub_client.list_build_files("evil/relu", repo.commit)
    assert sorted(f.path for f in listed) == sorted(files)


def test_a_next_link_back_to_the_first_page_is_not_followed(hostile):
    repo = KernelRepo("evil/relu", simple_kernel())
    repo.install(hostile)
    first = f"{hostile.url}/api/kernels/evil/relu/tree/{repo.commit}/build"

    def answer(seen, _match):
        # Page 2 links back to page 1 as the client asked for it (with its query).
        link = (
            f"{first}?recursive=true&expand=false"
            if "cursor=2" in seen.path
            else f"{first}?cursor=2"
        )
        return json_reply(repo.listing(), headers={"Link": f'<{link}>; rel="next"'})

    hostile.route(TREE, _stop_after(answer, 50))
    with pytest.raises(UnsafeResponse, match="loops back"):
        hub_client.list_build_files("evil/relu", repo.commit)
    assert len(hostile.paths("/tree/")) == 2


def _stop_after(answer, pages: int):
    """`answer`, without its Link header from page `pages` on (so an unbounded client ends)."""
    count = {"n": 0}

    def wrapped(seen, match):
        count["n"] += 1
        reply = answer(seen, match)
        if count["n"] >= pages:
            reply.headers.pop("Link", None)
        return reply

    return wrapped
