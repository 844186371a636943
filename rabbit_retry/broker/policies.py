"""Carrying out the policy changes of a diff through the management API: each queue's tunables
as one policy that matches that queue alone, changed live (the broker re-applies a policy to
its queues at once; nothing is redeclared)."""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import quote

from rabbit_retry.broker.diff import Change
from rabbit_retry.broker.management import Management
from rabbit_retry.errors import BrokerError
from rabbit_retry.topology import naming
from rabbit_retry.topology.plan import Plan, Policy


def policy_work(changes: Sequence[Change]) -> list[Change]:
    return [c for c in changes if c.object == "policy" and c.kind in ("create", "update")]


def policy_refusal(api: Management, changes: Sequence[Change]) -> str | None:
    """Why this user may not make the policy changes of ``changes`` (only the policymaker and
    administrator tags may set a policy), or None; asked before anything is changed."""
    work = policy_work(changes)
    if not work or api.may("policymaker"):
        return None
    tags = ", ".join(sorted(api.tags())) or "none"
    return (
        f"{len(work)} {'policy' if len(work) == 1 else 'policies'} to set, and setting a policy "
        f"needs the policymaker tag: user {api.user!r} has tags {tags}; nothing was changed"
    )


def around_routes(plan: Plan, changes: Sequence[Change]) -> tuple[list[Change], list[Change]]:
    """The policy changes to make before the bindings change, and those to make after.

    A queue whose dead letters the file routes to a tier has no limit that sends messages there
    (topology/limits.py): its policy goes first, so that a limit being removed is gone before
    its route to ``Q.parking`` is. Every other queue's goes after, so that a new limit applies
    only once its route exists. Either way no overflowed or expired message meets a tier."""
    to_tier = {b.routing_key for b in plan.bindings
               if b.source == naming.retry_exchange(b.routing_key)
               and naming.tier_label_of(b.destination, b.routing_key) is not None}
    work = policy_work(changes)
    first = [c for c in work if isinstance(c.item, Policy) and c.item.queue in to_tier]
    return first, [c for c in work if c not in first]


def apply_policies(api: Management, vhost: str, changes: Sequence[Change]) -> list[str]:
    """PUT or DELETE each changed policy; one line per policy for the user."""
    done = []
    for change in policy_work(changes):
        policy = change.item
        assert isinstance(policy, Policy)
        path = f"/policies/{quote(vhost, safe='')}/{quote(policy.name, safe='')}"
        if not policy.definition:
            response = api.request("DELETE", path)
            verb = "deleted"
        else:
            body = {
                "pattern": policy.pattern,
                "definition": dict(policy.definition),
                "priority": policy.priority,
                "apply-to": policy.apply_to,
            }
            response = api.request("PUT", path, json=body)
            verb = "set"
        if response.status_code >= 400 and not (verb == "deleted" and response.status_code == 404):
            try:
                reason = response.json().get("reason", response.text)
            except ValueError:
                reason = response.text
            raise BrokerError(f"policy {policy.name}: the broker refused it: {reason}")
        done.append(f"{verb} policy {policy.name} for queue {policy.queue}: {change.detail}")
    return done
