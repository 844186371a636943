"""What the management API client decides from what a user may see: the vhost looked up in the
list every user may read, tags from ``/api/whoami``, policies refused up front without the
policymaker tag (no broker: a fake API answers)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rabbit_retry.broker.diff import Change
from rabbit_retry.broker.management import Management, Refused
from rabbit_retry.broker.policies import policy_refusal
from rabbit_retry.errors import BrokerError
from rabbit_retry.topology.plan import Policy


def _api(answers: dict[str, Any], seen: list[str] | None = None) -> Management:
    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path.removeprefix("/api")
        if seen is not None:
            seen.append(f"{request.method} {path}")
        answer = answers.get(path)
        if answer is None:
            return httpx.Response(404, json={"error": "Object Not Found", "reason": "Not Found"})
        if isinstance(answer, httpx.Response):
            return answer
        return httpx.Response(200, json=answer)

    api = Management("http://ci:Zq9%40pw@h:15672")
    base, user, _ = api._nodes[0]
    api._nodes[0] = (base, user, httpx.Client(base_url=base + "/api",
                                              transport=httpx.MockTransport(handle)))
    return api


@pytest.fixture
def seen() -> Iterator[list[str]]:
    yield []


def test_the_vhost_is_looked_up_in_the_list_never_the_admin_only_endpoint(
    seen: list[str],
) -> None:
    api = _api({"/vhosts": [{"name": "orders"}], "/whoami": {"tags": ["management"]}}, seen)
    api.require_vhost("orders")
    assert seen == ["GET /vhosts"]
    with pytest.raises(BrokerError) as info:
        api.require_vhost("billing")
    assert str(info.value) == (
        "vhost 'billing' does not exist on the broker, or user 'ci' has no permissions on it"
    )


@pytest.mark.parametrize("tags", [["administrator"], "monitoring,policymaker"])
def test_a_user_who_sees_every_vhost_is_told_it_does_not_exist(tags: object) -> None:
    api = _api({"/vhosts": [{"name": "orders"}], "/whoami": {"tags": tags}})
    with pytest.raises(BrokerError) as info:
        api.require_vhost("billing")
    assert str(info.value) == "vhost 'billing' does not exist on the broker"


def _policy_change() -> Change:
    policy = Policy(name="rabbit-retry:q", queue="q", pattern="^q$",
                    definition={"max-length": 5}, priority=0, apply_to="queues")
    return Change("create", "policy", policy.name, "max-length: 5", policy)


@pytest.mark.parametrize(
    ("tags", "refused"),
    [
        (["management"], True),
        ("management,monitoring", True),
        (["policymaker"], False),
        (["administrator"], False),
    ],
)
def test_policies_need_the_policymaker_tag(tags: str | list[str], refused: bool) -> None:
    api = _api({"/whoami": {"tags": tags}})
    line = policy_refusal(api, [_policy_change()])
    if not refused:
        assert line is None
        return
    names = tags.split(",") if isinstance(tags, str) else tags
    shown = ", ".join(sorted(names))
    assert line == (
        "1 policy to set, and setting a policy needs the policymaker tag: user 'ci' has tags "
        f"{shown}; nothing was changed"
    )


def test_no_policy_change_asks_nothing(seen: list[str]) -> None:
    assert policy_refusal(_api({}, seen), []) is None
    assert seen == []


def test_a_refusal_says_what_the_user_lacks() -> None:
    answer = httpx.Response(401, json={"error": "not_authorised",
                                       "reason": "Not management user"})
    with pytest.raises(Refused) as info:
        _api({"/overview": answer}).overview()
    assert str(info.value) == (
        "management API at http://h:15672 refused user 'ci': Not management user (401); it "
        "needs the management or monitoring tag"
    )


def test_encoded_credentials_are_decoded_for_basic_auth() -> None:
    api = Management("http://ci%2Fteam:Zq9%20p%40ss%2F%23%3F@h:15672")
    auth = api._nodes[0][2].auth
    assert auth is not None
    request = next(auth.sync_auth_flow(httpx.Request("GET", "http://h")))
    expected = next(httpx.BasicAuth("ci/team", "Zq9 p@ss/#?").sync_auth_flow(
        httpx.Request("GET", "http://h")))
    assert request.headers["Authorization"] == expected.headers["Authorization"]
    assert api.user == "ci/team"


@pytest.mark.parametrize(("errors", "ok"), [(1, True), (2, True), (3, False)])
def test_a_get_the_broker_answers_with_a_server_error_is_asked_again_twice(
    errors: int, ok: bool, seen: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """RabbitMQ 4.0 answered ``GET /vhosts`` with a bare 500 while another vhost was being
    deleted: the same GET a moment later is answered."""
    monkeypatch.setattr("rabbit_retry.broker.management.time.sleep", lambda _: None)
    answers = iter([httpx.Response(500, text="")] * errors)

    class Flaky(dict[str, Any]):
        def get(self, path: str, default: Any = None) -> Any:
            if path == "/vhosts":
                return next(answers, [{"name": "orders"}])
            return super().get(path, default)

    api = _api(Flaky(), seen)
    if ok:
        assert api.vhost_exists("orders")
    else:
        with pytest.raises(BrokerError, match=r"^management API GET /vhosts failed: 500"):
            api.vhost_exists("orders")
    assert seen == ["GET /vhosts"] * min(errors + 1, 3)


def test_a_client_error_is_not_asked_again(seen: list[str]) -> None:
    api = _api({"/vhosts": httpx.Response(401, json={"reason": "Not management user"})}, seen)
    with pytest.raises(BrokerError):
        api.vhost_exists("orders")
    assert seen == ["GET /vhosts"]
