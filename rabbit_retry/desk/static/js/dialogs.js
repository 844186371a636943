// The one action dialog: asks before a replay, discard, restore or edit, shows what will happen,
// stays open with the server's reason when the action is refused, and follows a replay that
// runs longer than a moment: done of total, rate, time left, a way to cancel it, and how it
// ended (done, failed, cancelled), the same as the audit says.

import { ApiError, call, start } from "./api.js";
import { $, count, duration, fill, h, plural, shorten } from "./dom.js";

const POLL_MS = 1000;

let pending = null; // {validate, run, resolve} of the dialog on screen
let running = false; // an action was sent and has not answered: the dialog stays until it does
let following = null; // the replay the dialog follows: {id, stop}

function dialog() {
  return $("#action-dialog");
}

function showError(text) {
  const line = $("#action-error");
  line.textContent = text;
  line.hidden = !text;
}

function close(result) {
  const current = pending;
  pending = null;
  if (following) following.stop();
  following = null;
  if (dialog().open) dialog().close();
  if (current) current.resolve(result);
}

export function setUpDialogs() {
  $("#action-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    if (!pending || running) return;
    const current = pending;
    let payload;
    try {
      payload = current.validate();
    } catch (error) {
      showError(error.message);
      return;
    }
    const button = $("#action-confirm");
    const label = button.textContent;
    button.disabled = $("#action-cancel").disabled = running = true;
    button.textContent = "Working…";
    showError("");
    try {
      const result = await current.run(payload);
      if (pending === current && result !== undefined) close(result);
    } catch (error) {
      showError(error instanceof ApiError ? error.message : String(error));
    } finally {
      button.disabled = $("#action-cancel").disabled = running = false;
      button.textContent = label;
    }
  });
  $("#action-cancel").addEventListener("click", () => close(following ? following.last : null));
  dialog().addEventListener("cancel", (event) => {
    if (running) event.preventDefault();
    else close(following ? following.last : null);
  });
}

// Shows the dialog; resolves with run()'s result once it succeeded, or null when cancelled.
function ask({ title, body, confirm, danger, validate, run }) {
  if (pending) close(null);
  fill($("#action-title"), title);
  fill($("#action-body"), body);
  const button = $("#action-confirm");
  button.textContent = confirm;
  button.className = danger ? "danger" : "primary";
  button.hidden = button.disabled = running = false;
  $("#action-cancel").textContent = "Cancel";
  $("#action-cancel").disabled = false;
  showError("");
  return new Promise((resolve) => {
    pending = { validate, run, resolve };
    dialog().showModal();
    const first = $("#action-body").querySelector("textarea, select, input");
    (first || button).focus();
  });
}

// What a selection is, for the dialog's first line.
function describe(selection, what = "parked message") {
  if (selection.group) {
    const g = selection.group;
    return [
      h("p", {}, plural(g.count, what, `${what}s`), " of queue ",
        h("code", {}, g.queue), ", failed with:"),
      h("p", { class: "exception" }, h("b", {}, g.exception_type || "(no exception)"), " ",
        shorten(g.exception_message, 300)),
    ];
  }
  const queues = [...new Set(selection.messages.map((m) => m.queue))];
  return [
    h("p", {}, plural(selection.messages.length, "selected message", "selected messages"),
      queues.length === 1 ? [" of queue ", h("code", {}, queues[0])] : ` of ${queues.length} queues`,
      "."),
  ];
}

function target(selection) {
  return selection.group ? { group: selection.group.id } : { ids: selection.messages.map((m) => m.id) };
}

function size(selection) {
  return selection.group ? selection.group.count : selection.messages.length;
}

// "1,234 of 10,000 replayed · 312 a second · about 28 s left"
function progressText(entry) {
  const p = entry.progress || {};
  const parts = [`${count(p.done)} of ${count(p.total)} replayed`];
  if (p.refused) parts.push(`${count(p.refused)} refused`);
  if (entry.state === "running") {
    parts.push(`${count(p.rate)} a second`);
    if (typeof p.eta_s === "number") parts.push(`about ${duration(p.eta_s)} left`);
  }
  return parts.join(" · ");
}

const ENDED = { done: "Done", failed: "Stopped", cancelled: "Cancelled", running: "Running" };

// The dialog follows replay `id` until it ends (progress, rate, time left, Cancel replay), then
// shows how it ended until the operator closes it; closing resolves the dialog with the last
// state seen ({replayed, replay_id, state, error}).
function follow(id, first) {
  fill($("#action-title"), "Replaying…");
  const bar = h("progress", { id: "replay-bar", max: "1", value: "0" });
  const state = h("span", { id: "replay-state", class: "state state-running" }, "Running");
  const line = h("p", { id: "replay-progress" });
  const cancel = h("button", { type: "button", id: "replay-cancel", class: "danger" }, "Cancel replay");
  fill($("#action-body"), h("p", {}, "Replay ", h("code", {}, id), " ", state), bar, line,
    h("p", { class: "muted" }, "You may close this: the replay goes on, and the audit shows it."),
    h("div", { class: "buttons" }, cancel));
  $("#action-confirm").hidden = true;
  $("#action-cancel").textContent = "Close";
  $("#action-cancel").disabled = false;
  let timer = null;
  function show(entry) {
    const p = entry.progress || {};
    bar.max = String(Math.max(p.total || 0, 1));
    bar.value = String(p.done || 0);
    line.textContent = progressText(entry);
    state.className = `state state-${entry.state}`;
    state.textContent = ENDED[entry.state] || entry.state;
    if (following) {
      following.last = { replayed: p.done, replay_id: id, state: entry.state, error: entry.outcome };
    }
    if (entry.state !== "running") {
      cancel.hidden = true;
      fill($("#action-title"), entry.state === "done" ? "Replayed" : "Replay ended");
      if (entry.state !== "done" && entry.outcome) showError(entry.outcome);
      stop();
    }
  }
  async function poll() {
    try {
      show(await call(`/api/replays/${encodeURIComponent(id)}`));
    } catch (error) {
      showError(error.message);
    }
    if (following && following.id === id && !following.stopped) timer = window.setTimeout(poll, POLL_MS);
  }
  function stop() {
    if (following) following.stopped = true;
    window.clearTimeout(timer);
  }
  cancel.addEventListener("click", async () => {
    cancel.disabled = true;
    try {
      await call(`/api/replays/${encodeURIComponent(id)}/cancel`, {});
      state.textContent = "Cancelling…";
    } catch (error) {
      showError(error.message);
      cancel.disabled = false;
    }
  });
  following = { id, stop, stopped: false, last: null };
  show({ state: "running", progress: first.progress || {} });
  timer = window.setTimeout(poll, POLL_MS);
}

// Starts a replay (or an edit) and answers at once when it ended within a second; else the
// dialog follows it (and answers when the operator closes it).
async function replayed(path, payload) {
  const { data, status } = await start(path, { ...payload, wait: 1 });
  if (status !== 202) return data;
  follow(data.replay_id, data);
  return undefined;
}

// Replay a group or messages: back to their own queue, or to another queue of the topology,
// optionally at a rate. Resolves with {replayed, replay_id, state}, or null.
export function replay(selection, queues) {
  const own = selection.group
    ? selection.group.queue
    : [...new Set(selection.messages.map((m) => m.queue))].join(", ");
  const to = h("select", { id: "replay-to", name: "to" },
    h("option", { value: "" }, `its own queue (${own})`),
    queues.map((q) => h("option", { value: q.queue }, q.queue)));
  const rate = h("input", { id: "replay-rate", name: "rate", type: "number", min: "1", step: "1",
    max: "100000", inputmode: "numeric", placeholder: "no limit" });
  const n = size(selection);
  return ask({
    title: selection.group ? "Replay this group?" : "Replay these messages?",
    body: [
      describe(selection),
      h("p", {}, "They are published again, with their retry count reset, and leave the parking queue."),
      h("label", {}, "Replay to ", to),
      h("label", {}, "At most ", rate, " messages a second (empty: as fast as the broker takes them)"),
    ],
    confirm: `Replay ${plural(n, "message", "messages")}`,
    validate() {
      const payload = target(selection);
      if (to.value) payload.to = to.value;
      if (rate.value !== "") {
        const value = Number(rate.value);
        if (!Number.isFinite(value) || value <= 0 || value > 100000) {
          throw new Error("the rate: a number of messages a second, above 0 and at most 100,000");
        }
        payload.rate = value;
      }
      return payload;
    },
    run: (payload) => replayed("/api/replay", payload),
  });
}

// Discard a group or messages, with a reason the audit keeps. Resolves with {discarded}, or null.
export function discard(selection) {
  const reason = h("textarea", { id: "discard-reason", name: "reason", required: true, rows: "3",
    maxlength: "1000", placeholder: "why these messages will never be replayed" });
  const n = size(selection);
  return ask({
    title: selection.group ? "Discard this group?" : "Discard these messages?",
    danger: true,
    body: [
      describe(selection),
      h("p", {}, "Discarded messages are not replayed; they can be restored until the desk's "
        + "retention (--keep) ends. The audit keeps who discarded them and why."),
      h("label", {}, "Reason (required) ", reason),
    ],
    confirm: `Discard ${plural(n, "message", "messages")}`,
    validate() {
      const text = reason.value.trim();
      if (!text) throw new Error("say why: the reason is recorded in the audit");
      return { ...target(selection), reason: text };
    },
    run: (payload) => call("/api/discard", payload),
  });
}

// Restore discarded messages: parked again, to be replayed or discarded anew.
export function restore(selection) {
  const reason = h("textarea", { id: "restore-reason", name: "reason", rows: "2",
    maxlength: "1000", placeholder: "why (optional)" });
  return ask({
    title: selection.group ? "Restore this group's discarded messages?" : "Restore these messages?",
    body: [
      describe(selection, "discarded message"),
      h("p", {}, "They are parked again, as they were before the discard."),
      h("label", {}, "Reason ", reason),
    ],
    confirm: `Restore ${plural(size(selection), "message", "messages")}`,
    validate() {
      const text = reason.value.trim();
      return text ? { ...target(selection), reason: text } : target(selection);
    },
    run: (payload) => call("/api/restore", payload),
  });
}

// Edit a parked message's body and headers, then replay the edited copy. The stored message
// stays as it was; the audit keeps the change.
export function edit(message, queues) {
  const textBody = typeof message.body === "string";
  const body = h("textarea", { id: "edit-body", name: "body", rows: "10", spellcheck: "false",
    class: "code" });
  body.value = textBody ? message.body : message.body_base64 || "";
  const editable = {};
  for (const [name, value] of Object.entries(message.editable_headers || {})) editable[name] = value;
  const headers = h("textarea", { id: "edit-headers", name: "headers", rows: "6",
    spellcheck: "false", class: "code" });
  headers.value = JSON.stringify(editable, null, 2);
  const to = h("select", { id: "edit-to", name: "to" },
    h("option", { value: "" }, `its own queue (${message.queue})`),
    queues.map((q) => h("option", { value: q.queue }, q.queue)));
  const reason = h("input", { id: "edit-reason", name: "reason", maxlength: "1000",
    placeholder: "why (optional)" });
  return ask({
    title: "Edit and replay this message?",
    body: [
      h("p", {}, "The edited copy is replayed (marked replay-edited); the parked message is kept "
        + "as it was, and the audit records what changed."),
      h("label", {}, textBody ? "Body" : "Body (base64)", body),
      h("label", {}, "Headers (JSON; parking and retry headers are not editable)", headers),
      h("label", {}, "Replay to ", to),
      h("label", {}, "Reason ", reason),
    ],
    confirm: "Replay the edited copy",
    validate() {
      let parsed;
      try {
        parsed = JSON.parse(headers.value || "{}");
      } catch {
        throw new Error("the headers are not JSON");
      }
      if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) {
        throw new Error("the headers: a JSON object of name: value");
      }
      const payload = { headers: parsed };
      if (textBody) payload.body = body.value;
      else payload.body_base64 = body.value.trim();
      if (to.value) payload.to = to.value;
      if (reason.value.trim()) payload.reason = reason.value.trim();
      return payload;
    },
    run: (payload) => replayed(`/api/messages/${encodeURIComponent(message.id)}/edit`, payload),
  });
}

// Outbox events (dead or failed) as the dialogs describe them.
function describeEvents(events) {
  const where = [...new Set(events.map((e) => e.destination))];
  return h("p", {}, plural(events.length, "outbox event", "outbox events"),
    where.length === 1 ? [" to ", h("code", {}, where[0])] : ` to ${where.length} destinations`, ".");
}

// Retry outbox events: pending again, with a fresh count of attempts; the relay publishes them.
// Resolves with {retried, skipped, outbox: true}, or null.
export function outboxRetry(events) {
  const reason = h("textarea", { id: "outbox-retry-reason", name: "reason", rows: "2",
    maxlength: "1000", placeholder: "why (optional)" });
  return ask({
    title: events.length === 1 ? "Retry this outbox event?" : "Retry these outbox events?",
    body: [
      describeEvents(events),
      h("p", {}, "They become pending again, with their attempts counted afresh: the relay "
        + "publishes them (the desk does not). The audit keeps who retried them."),
      h("label", {}, "Reason ", reason),
    ],
    confirm: `Retry ${plural(events.length, "event")}`,
    validate() {
      const payload = { ids: events.map((e) => e.id) };
      if (reason.value.trim()) payload.reason = reason.value.trim();
      return payload;
    },
    run: async (payload) => ({ ...(await call("/api/outbox/retry", payload)), outbox: true }),
  });
}

// Discard outbox events: never to be published, with a reason. Resolves with
// {discarded, skipped, outbox: true}, or null.
export function outboxDiscard(events) {
  const reason = h("textarea", { id: "outbox-discard-reason", name: "reason", required: true,
    rows: "3", maxlength: "1000", placeholder: "why these events will never be published" });
  return ask({
    title: events.length === 1 ? "Discard this outbox event?" : "Discard these outbox events?",
    danger: true,
    body: [
      describeEvents(events),
      h("p", {}, "Discarded events are never published. The audit and each event's history keep "
        + "who discarded them and why."),
      h("label", {}, "Reason (required) ", reason),
    ],
    confirm: `Discard ${plural(events.length, "event")}`,
    validate() {
      const text = reason.value.trim();
      if (!text) throw new Error("say why: the reason is recorded in the audit");
      return { ids: events.map((e) => e.id), reason: text };
    },
    run: async (payload) => ({ ...(await call("/api/outbox/discard", payload)), outbox: true }),
  });
}

// Tells the operator what an action did: the notice line, and the error line when a replay
// stopped part way (the desk says how many it refused and why).
export function report(ctx, result) {
  if (result.outbox) {
    const skipped = result.skipped ? `; ${count(result.skipped)} skipped (not dead or failed)` : "";
    ctx.notify("retried" in result
      ? `Retried ${plural(result.retried, "outbox event")}: pending again, for the relay${skipped}.`
      : `Discarded ${plural(result.discarded, "outbox event")}${skipped}.`);
  } else if ("discarded" in result) {
    ctx.notify(`Discarded ${plural(result.discarded, "message")}.`);
  } else if ("restored" in result) {
    ctx.notify(`Restored ${plural(result.restored, "message")}: parked again.`);
  } else if (result.state === "running") {
    ctx.notify(`Replay ${result.replay_id} is still running; the audit shows when it is done.`);
  } else if (result.state === "cancelled") {
    ctx.notify(`Replay ${result.replay_id} cancelled after ${plural(result.replayed, "message")}.`);
  } else {
    const skipped = result.skipped ? `; ${count(result.skipped)} skipped (not parked)` : "";
    ctx.notify(`Replayed ${plural(result.replayed, "message")} (replay ${result.replay_id})${skipped}.`);
    if (result.error) {
      ctx.fail(new Error(`Replay ${result.replay_id} stopped: ${result.error}`
        + (result.refused ? ` (${plural(result.refused, "message")} refused)` : "")));
    }
  }
}
