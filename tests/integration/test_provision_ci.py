"""Provisioning from CI against the real broker: the vhost's lock (a second apply waits or
refuses, naming the holder; a killed holder frees it), ``--target`` (one conflict does not
block a repair elsewhere), the objects of queues a file no longer declares (reported with
their counts, pruned only on request and only once empty), ``plan --detailed-exitcode`` and
output cut short by a closed pipe."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from support.amqp import blocking, depth
from support.poll import wait_for
from support.process import CLI, cli
from test_provision import publish, write

from rabbit_retry.broker.lock import LOCK_QUEUE
from rabbit_retry.broker.management import Management
from rabbit_retry.errors import EXIT_CONFLICT, EXIT_INPUT, EXIT_PENDING, EXIT_RUNTIME
from rabbit_retry.settings import Settings

FILE = """\
version: 1
exchanges:
  orders: {type: topic}
  audit: {type: fanout}
queues:
  orders.email:
    queue_type: classic
    bindings: [{exchange: orders, routing_key: "order.*"}]
    retry: {delays: [1s], max_attempts: 3}
  audit.log:
    queue_type: QTYPE
    bindings: [{exchange: audit}]
    retry: {delays: [1s, 5s], max_attempts: 3}
    policy: {max_length: 1000}
    on_full: ONFULL
"""

# The holder of a lock for the lock tests: the product's lock, held until stdin closes.
HOLDER = """\
import sys
from rabbit_retry.broker.lock import VhostLock
from rabbit_retry.settings import Settings
settings = Settings.from_env(sys.argv[1], sys.argv[2])
with VhostLock(settings, "apply", "holder.yml", 0, print):
    print("held", flush=True)
    sys.stdin.read()
"""


def topology(tmp_path: Path, queue_type: str = "quorum", name: str = "t.yml",
             text: str = FILE) -> str:
    # A full quorum queue refuses publishes; a classic one parks its oldest message.
    on_full = "reject" if queue_type == "quorum" else "park"
    return write(tmp_path, text.replace("QTYPE", queue_type).replace("ONFULL", on_full), name)


def queue_names(api: Management, settings: Settings) -> set[str]:
    return {q["name"] for q in api.queues(settings.vhost)}


def hold(settings: Settings) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, settings.url_list, settings.management_url_list],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    assert process.stdout.readline() == "held\n"
    return process


# --- the lock -------------------------------------------------------------------------------


def test_a_second_apply_refuses_or_waits_while_the_lock_is_held_and_a_killed_holder_frees_it(
    tmp_path: Path, fresh_vhost: Settings, management: Management
) -> None:
    file = topology(tmp_path)
    holder = hold(fresh_vhost)
    try:
        # Positive control: the lock is there, held by that process.
        lock = management.queue(fresh_vhost.vhost, LOCK_QUEUE)
        assert lock is not None and lock["exclusive"] is True
        assert lock["arguments"]["rabbit-retry-pid"] == holder.pid

        refused = cli(fresh_vhost, "apply", file, "--lock-timeout", "0")
        assert refused.code == EXIT_RUNTIME
        assert refused.err.startswith(
            f"error: vhost {fresh_vhost.vhost!r} is locked by apply of holder.yml on host ")
        assert f", pid {holder.pid}, since 20" in refused.err
        assert "nothing was changed" in refused.err
        assert queue_names(management, fresh_vhost) == {LOCK_QUEUE}  # nothing declared

        # A second apply that waits: it says for whom, and goes on once the holder is done.
        waiting = subprocess.Popen(
            [CLI, "--url", fresh_vhost.url_list, "--management-url",
             fresh_vhost.management_url_list, "apply", file, "--lock-timeout", "600"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert waiting.stderr is not None
        said = waiting.stderr.readline()
        assert said.startswith(f"waiting up to 600s for the lock of vhost "
                               f"{fresh_vhost.vhost!r}, held by apply of holder.yml")
        assert queue_names(management, fresh_vhost) == {LOCK_QUEUE}  # still waiting
        assert holder.stdin is not None
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
        out, err = waiting.communicate(timeout=120)
        assert (waiting.returncode, err) == (0, ""), err
        assert out.startswith("created ")
    finally:
        holder.kill()
        holder.wait()

    # kill -9 of a holder: the broker drops its connection and the lock with it.
    holder = hold(fresh_vhost)
    try:
        assert cli(fresh_vhost, "apply", file, "--lock-timeout", "0").code == EXIT_RUNTIME
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        again = cli(fresh_vhost, "apply", file, "--lock-timeout", "600")
        assert (again.code, again.err) == (0, ""), again.err
        assert again.out.startswith("nothing to do")
    finally:
        holder.kill()
        holder.wait()
    # An apply gives the lock back when it ends.
    assert management.queue(fresh_vhost.vhost, LOCK_QUEUE) is None
    assert cli(fresh_vhost, "migrate", file, "--lock-timeout", "0", "--yes").code == 0


# --- --target -------------------------------------------------------------------------------


def test_a_run_whose_lock_connection_closes_stops_before_its_next_change(
    fresh_vhost: Settings, management: Management
) -> None:
    """The lock's connection can end while the run goes on (a broker restart, the network, an
    operator closing it): from then on another run may take the lock, so the run's next check
    before a change fails, in one line."""
    from rabbit_retry.broker.lock import VhostLock
    from rabbit_retry.errors import BrokerError

    def lost(lock: VhostLock) -> str | None:
        try:
            lock.check()
        except BrokerError as exc:
            return str(exc)
        return None

    with VhostLock(fresh_vhost, "apply", "t.yml", 0, print) as lock:
        assert lost(lock) is None  # held: the check passes
        [mine] = wait_for(lambda: [c["name"] for c in management.connections(fresh_vhost.vhost)
                                   if "(lock)" in c.get("user_provided_name", "")],
                          "the lock's connection")
        management.close_connection(mine, "test: the lock's connection goes")
        said = wait_for(lambda: lost(lock), "the run to notice it lost the lock")
    assert said == (f"lost the lock of vhost {fresh_vhost.vhost!r}: its connection to the broker "
                    "closed; stopped before the next change (run it again to finish)")
    # free for the next run: the broker deletes the exclusive queue with its connection, a
    # moment after the connection is gone (on 4.3.6 the listing still showed it once)
    wait_for(lambda: LOCK_QUEUE not in queue_names(management, fresh_vhost),
             "the lock's queue gone with its connection")


def test_a_target_repairs_its_queue_while_another_object_conflicts(
    tmp_path: Path, fresh_vhost: Settings, management: Management
) -> None:
    file = topology(tmp_path)
    assert cli(fresh_vhost, "apply", file).code == 0
    vhost = fresh_vhost.vhost
    # By hand: the audit exchange redeclared as direct, a tier of orders.email deleted.
    assert management.request("DELETE", f"/exchanges/{vhost}/audit").status_code == 204
    made = management.request("PUT", f"/exchanges/{vhost}/audit",
                              json={"type": "direct", "durable": True})
    assert made.status_code in (201, 204)
    deleted = management.request("DELETE", f"/queues/{vhost}/orders.email.retry.1s")
    assert deleted.status_code == 204

    blocked = cli(fresh_vhost, "apply", file)
    assert blocked.code == EXIT_CONFLICT and "exchange audit" in blocked.err
    assert "orders.email.retry.1s" not in queue_names(management, fresh_vhost)
    assert cli(fresh_vhost, "plan", file, "--detailed-exitcode").code == EXIT_CONFLICT

    part = cli(fresh_vhost, "plan", file, "--target", "orders.email", "--detailed-exitcode")
    assert part.code == EXIT_PENDING, part.err
    assert part.out.splitlines()[0] == (
        "create    queue    orders.email.retry.1s  (classic, tier, ttl 1s)")
    repaired = cli(fresh_vhost, "apply", file, "--target", "orders.email")
    assert (repaired.code, repaired.err) == (0, ""), repaired.err
    assert "orders.email.retry.1s" in queue_names(management, fresh_vhost)
    assert next(e for e in management.exchanges(vhost) if e["name"] == "audit")["type"] == (
        "direct")  # the conflict outside the target is left as it was
    done = cli(fresh_vhost, "plan", file, "--target", "orders.email", "--detailed-exitcode")
    assert done.code == 0, done.out

    unknown = cli(fresh_vhost, "apply", file, "--target", "nope")
    assert unknown.code == EXIT_INPUT
    assert unknown.err.startswith("error: --target nope: no queue 'nope' in the file")


# --- orphans --------------------------------------------------------------------------------


def test_a_renamed_queue_is_reported_and_pruned_only_once_empty(
    tmp_path: Path, fresh_vhost: Settings, management: Management
) -> None:
    old = topology(tmp_path, "quorum", "old.yml")
    assert cli(fresh_vhost, "apply", old).code == 0
    publish(fresh_vhost, "audit", "", 3)
    new = topology(tmp_path, "quorum", "new.yml", FILE.replace("audit.log:", "audit.trail:"))
    assert cli(fresh_vhost, "plan", new, "--detailed-exitcode").code == EXIT_PENDING
    assert cli(fresh_vhost, "apply", new).code == 0
    # The old queue still gets a copy of every message: what plan and status now say.
    publish(fresh_vhost, "audit", "", 2)
    assert blocking(depth(fresh_vhost, "audit.log")) == 5
    assert blocking(depth(fresh_vhost, "audit.trail")) == 2

    planned = cli(fresh_vhost, "plan", new, "--detailed-exitcode")
    assert planned.code == 0, planned.out  # nothing apply would change without --prune
    line = next(x for x in planned.out.splitlines() if x.split()[2:3] == ["audit.log"])
    assert line.startswith("keep      queue    audit.log  (not in the file (queue audit.log); ")
    assert "still bound from audit []: it gets a copy of every message routed there" in line
    assert "renamed to audit.trail?" in line
    as_json = json.loads(cli(fresh_vhost, "plan", new, "--json").out)
    orphans = {c["name"]: c for c in as_json["changes"] if c["orphan"]}
    assert set(orphans) == {"audit.log", "audit.log.retry.1s", "audit.log.retry.5s",
                            "audit.log.parking", "audit.log.retry", "rabbit-retry:audit.log"}
    assert {c["owner"] for c in orphans.values()} == {"audit.log"}
    assert (as_json["format"], as_json["pending"]) == (1, False)

    status = cli(fresh_vhost, "status", new, "--json")
    assert status.code == 0
    listed = {o["name"]: o["messages"] for o in json.loads(status.out)["orphans"]}
    assert listed["audit.log"] == 5 and listed["audit.log.parking"] == 0

    # --prune leaves a group holding messages whole.
    kept = cli(fresh_vhost, "apply", new, "--prune", "--target", "audit.log")
    assert kept.code == 0, kept.err
    assert "left audit.log (" in kept.out
    assert {"audit.log", "audit.log.retry.1s", "audit.log.parking"} <= queue_names(
        management, fresh_vhost)
    assert blocking(depth(fresh_vhost, "audit.log")) == 5

    # Once empty (and unbound: nothing new arrives), --prune deletes the group and its policy.
    vhost = fresh_vhost.vhost
    assert management.request("DELETE", f"/queues/{vhost}/audit.log/contents").status_code == 204
    assert management.request(
        "DELETE", f"/bindings/{vhost}/e/audit/q/audit.log/~").status_code == 204
    # Without --target naming it, an orphan is left (it may be another file's queue).
    untouched = cli(fresh_vhost, "apply", new, "--prune")
    assert untouched.code == 0, untouched.err
    assert "left audit.log (not in the file (queue audit.log)); apply --prune --target " \
        "audit.log deletes it once empty" in untouched.out, untouched.out
    assert "audit.log" in queue_names(management, fresh_vhost)
    assert cli(fresh_vhost, "plan", new, "--prune", "--detailed-exitcode").code == 0
    assert cli(fresh_vhost, "plan", new, "--prune", "--target", "audit.log",
               "--detailed-exitcode").code == EXIT_PENDING
    pruned = cli(fresh_vhost, "apply", new, "--prune", "--target", "audit.log")
    assert pruned.code == 0, pruned.err
    assert "pruned audit.log (obsolete, empty)" in pruned.out
    assert "deleted policy rabbit-retry:audit.log" in pruned.out
    assert not {n for n in queue_names(management, fresh_vhost) if n.startswith("audit.log")}
    assert "audit.log.retry" not in {e["name"] for e in management.exchanges(vhost)}
    assert blocking(depth(fresh_vhost, "audit.trail")) == 2  # positive control: untouched
    assert cli(fresh_vhost, "plan", new, "--prune", "--detailed-exitcode").code == 0
    assert cli(fresh_vhost, "plan", new, "--target", "audit.log").code == EXIT_INPUT


def test_discard_messages_deletes_an_orphan_with_what_it_holds(
    tmp_path: Path, fresh_vhost: Settings, management: Management
) -> None:
    old = topology(tmp_path, "classic", "old.yml")
    assert cli(fresh_vhost, "apply", old).code == 0
    publish(fresh_vhost, "audit", "", 4)
    new = topology(tmp_path, "classic", "new.yml",
                   FILE.replace("  audit.log:", "  gone:").replace("[{exchange: audit}]", "[]"))
    assert cli(fresh_vhost, "apply", new, "--discard-messages").code == EXIT_INPUT
    dropped = cli(fresh_vhost, "apply", new, "--prune", "--discard-messages", "--target",
                  "audit.log")
    assert dropped.code == 0, dropped.err
    assert "pruned audit.log and the 4 messages in it (--discard-messages)" in dropped.out
    assert not {n for n in queue_names(management, fresh_vhost) if n.startswith("audit.log")}


# --- output cut short -----------------------------------------------------------------------


def test_plan_and_status_into_a_closed_pipe_end_with_their_own_code(
    tmp_path: Path, fresh_vhost: Settings
) -> None:
    file = topology(tmp_path)
    assert cli(fresh_vhost, "apply", file).code == 0
    for verb in ("plan", "status"):
        read, write_end = os.pipe()
        os.close(read)
        done = subprocess.run(
            [CLI, "--url", fresh_vhost.url_list, "--management-url",
             fresh_vhost.management_url_list, verb, file],
            stdin=subprocess.DEVNULL, stdout=write_end, stderr=subprocess.PIPE, text=True,
            check=False)
        os.close(write_end)
        assert (done.returncode, done.stderr) == (0, ""), verb
