// The one action dialog: asks before a replay or a discard, shows what will happen, and stays
// open with the server's reason when the action is refused.

import { ApiError, call } from "./api.js";
import { $, fill, h, plural, shorten } from "./dom.js";

let pending = null; // {validate, run, resolve} of the dialog on screen
let running = false; // an action was sent and has not answered: the dialog stays until it does

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
  if (dialog().open) dialog().close();
  if (current) current.resolve(result);
}

export function setUpDialogs() {
  $("#action-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    if (!pending) return;
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
      if (pending === current) close(result);
    } catch (error) {
      showError(error instanceof ApiError ? error.message : String(error));
    } finally {
      button.disabled = $("#action-cancel").disabled = running = false;
      button.textContent = label;
    }
  });
  $("#action-cancel").addEventListener("click", () => close(null));
  dialog().addEventListener("cancel", (event) => {
    if (running) event.preventDefault();
    else close(null);
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
  showError("");
  return new Promise((resolve) => {
    pending = { validate, run, resolve };
    dialog().showModal();
    const first = $("#action-body").querySelector("textarea, select, input");
    (first || button).focus();
  });
}

// What a selection is, for the dialog's first line.
function describe(selection) {
  if (selection.group) {
    const g = selection.group;
    return [
      h("p", {}, plural(g.count, "parked message", "parked messages"), " of queue ",
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

// Replay a group or messages: back to their own queue, or to another queue of the topology,
// optionally at a rate. Resolves with {replayed, replay_id}, or null.
export function replay(selection, queues) {
  const own = selection.group
    ? selection.group.queue
    : [...new Set(selection.messages.map((m) => m.queue))].join(", ");
  const to = h("select", { id: "replay-to", name: "to" },
    h("option", { value: "" }, `its own queue (${own})`),
    queues.map((q) => h("option", { value: q.queue }, q.queue)));
  const rate = h("input", { id: "replay-rate", name: "rate", type: "number", min: "1", step: "1",
    inputmode: "numeric", placeholder: "no limit" });
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
        if (!Number.isFinite(value) || value <= 0) throw new Error("the rate must be a positive number");
        payload.rate = value;
      }
      return payload;
    },
    run: (payload) => call("/api/replay", payload),
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
      h("p", {}, "Discarded messages are never replayed. The audit keeps who discarded them and why."),
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

// Tells the operator what an action did: the notice line, and the error line when a replay
// stopped part way (the desk says how many it refused and why).
export function report(ctx, result) {
  if ("discarded" in result) {
    ctx.notify(`Discarded ${plural(result.discarded, "message")}.`);
  } else if (result.pending) {
    ctx.notify(`Replay ${result.replay_id} is still running; the audit shows when it is done.`);
  } else {
    ctx.notify(`Replayed ${plural(result.replayed, "message")} (replay ${result.replay_id}).`);
    if (result.error) {
      ctx.fail(new Error(`Replay ${result.replay_id} stopped: ${result.error}`
        + (result.refused ? ` (${plural(result.refused, "message")} refused)` : "")));
    }
  }
}
