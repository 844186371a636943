// One message: what failed, every header and property, the body, its history across parks and
// replays (every parked copy of its message id, and what each became), and what can be done
// with it: replay, edit and replay, discard, restore.

import { call } from "../api.js";
import { discard, edit, replay, report, restore } from "../dialogs.js";
import { h, pairs, when } from "../dom.js";

const STACKTRACE = "exception-stacktrace";

// The body as stored: text (pretty-printed when it is JSON), or base64 when it is not UTF-8.
function body(m) {
  if (typeof m.body === "string") {
    let shown = m.body;
    let kind = "text";
    try {
      const parsed = JSON.parse(m.body);
      if (parsed !== null && typeof parsed === "object") {
        shown = JSON.stringify(parsed, null, 2);
        kind = "JSON";
      }
    } catch {
      // not JSON: shown as it is
    }
    return [h("h3", {}, `Body (${kind})`), h("pre", { class: "body", id: "message-body" }, shown)];
  }
  if (typeof m.body_base64 === "string") {
    return [h("h3", {}, "Body (binary, base64)"),
      h("pre", { class: "body", id: "message-body" }, m.body_base64)];
  }
  return [h("h3", {}, "Body"), h("p", { class: "muted" }, "empty")];
}

function messageLink(row, current) {
  const label = `#${row}`;
  return row === current ? h("b", {}, label, " (this one)")
    : h("a", { href: `#/message/${encodeURIComponent(row)}`, class: "history-row" }, label);
}

// The history's events, oldest first: parked, discarded, restored, replayed or edited (by whom,
// to where, and what became of it), parked again.
function historyTable(history, current) {
  const rows = history.events.map((e) => {
    let what;
    if (e.event === "parked") {
      what = [h("b", {}, e.exception_type || "(no exception)"), " ", e.exception_message || "",
        e.replay_of ? [" · came back from replay ", h("code", {}, e.replay_of)] : null,
        e.edited ? [" · ", h("span", { class: "chip edited" }, "edited copy")] : null];
    } else if (e.event === "replayed" || e.event === "edited and replayed") {
      what = [`by ${e.actor} to `, h("code", {}, e.to), " · ", h("span", { class: `then then-${String(e.then).replace(/\s+/g, "-")}` }, e.then),
        e.next_row ? [" as ", messageLink(e.next_row, current)] : null,
        e.detail && e.detail.body ? h("details", {}, h("summary", {}, "the edit"), h("pre", { class: "diff" }, e.detail.body)) : null];
    } else {
      what = [`by ${e.actor}`, e.reason ? [": ", e.reason] : null];
    }
    return h("tr", { dataset: { event: e.event } },
      h("td", { class: "time" }, when(e.at)), h("td", {}, messageLink(e.row, current)),
      h("td", { class: "event" }, e.event), h("td", { class: "what" }, what));
  });
  return h("table", { class: "grid", id: "history" },
    h("thead", {}, h("tr", {}, h("th", {}, "When"), h("th", {}, "Copy"), h("th", {}, "What"),
      h("th", {}, "Details"))),
    h("tbody", {}, rows));
}

export async function renderMessage(ctx) {
  const id = ctx.arg;
  const [m, history] = await Promise.all([
    call(`/api/messages/${encodeURIComponent(id)}`),
    call(`/api/messages/${encodeURIComponent(id)}/history`),
  ]);
  const headers = m.headers || {};
  const properties = m.properties || {};
  const mayAct = ctx.me().may_act;

  async function act(kind) {
    const messages = [m];
    const result = kind === "replay" ? await replay({ messages }, await ctx.queues())
      : kind === "edit" ? await edit(m, await ctx.queues())
        : kind === "restore" ? await restore({ messages }) : await discard({ messages });
    if (!result) return;
    report(ctx, result);
    ctx.rerender();
  }
  const button = (kind, label, danger) => h("button", { type: "button", id: `${kind}-message`,
    class: danger ? "danger" : null, onclick: () => act(kind).catch(ctx.fail) }, label);

  const summary = [
    ["Message id", [m.message_id || h("span", { class: "muted" }, "none (the publisher set none)"),
      m.message_id_generated ? [" ", h("span", { class: "chip generated", id: "message-id-generated",
        title: "rabbit-retry made this id up: the publisher set none" }, "generated")] : null]],
    ["Correlation id", m.correlation_id || "—"],
    ["Queue", m.queue],
    ["Status", h("span", { class: `status status-${m.status}` }, m.status)],
    ["Reason", m.reason || "—"],
    ["Attempts", m.attempts ?? "—"],
    ["Parked at", when(m.parked_at)],
    ...(m.edited ? [["Edited", h("span", { class: "chip edited" }, "an operator edited this copy before replaying it")]] : []),
    ...(m.replay_of ? [["Came back from", ["replay ", h("code", {}, m.replay_of)]]] : []),
    ...(m.replay_id ? [["Replay", h("code", {}, m.replay_id)]] : []),
    ...(m.replayed_to ? [["Replayed to", m.replayed_to]] : []),
    ...(m.discard_reason ? [["Discarded because", m.discard_reason]] : []),
    ...(m.changed_at ? [["Status since", when(m.changed_at)]] : []),
    ["Group", m.group
      ? h("a", { href: `#/group/${encodeURIComponent(m.group)}` }, "the group of its cause")
      : "—"],
  ];

  return [
    h("p", {}, h("a", { href: ctx.backToList(), class: "back" }, "← messages")),
    h("h2", {}, "Message ", h("code", { id: "message-id" }, m.message_id || `#${m.id}`)),
    h("dl", { class: "summary" }, summary.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
    mayAct && (m.status === "parked" || m.status === "discarded")
      ? h("div", { class: "toolbar" },
        m.status === "parked" ? button("replay", "Replay…") : null,
        m.status === "parked" ? button("edit", "Edit and replay…") : null,
        m.status === "parked" ? button("discard", "Discard…", true) : null,
        m.status === "discarded" ? button("restore", "Restore…") : null)
      : null,
    h("h3", {}, "Exception"),
    h("p", { class: "exception", id: "message-exception" },
      h("b", {}, m.exception_type || "(none)"), " ", m.exception_message || ""),
    typeof headers[STACKTRACE] === "string"
      ? h("details", {}, h("summary", {}, "Stack trace"), h("pre", { class: "trace" }, headers[STACKTRACE]))
      : null,
    h("h3", {}, `History (${history.rows.length === 1 ? "one parked copy" : `${history.rows.length} parked copies`} of this message)`),
    historyTable(history, m.id),
    body(m),
    h("h3", {}, "Headers"),
    h("div", { id: "message-headers" },
      pairs(Object.entries(headers).sort(([a], [b]) => a.localeCompare(b)), "no headers")),
    h("h3", {}, "Properties"),
    h("div", { id: "message-properties" },
      pairs(Object.entries(properties).sort(([a], [b]) => a.localeCompare(b)), "no properties")),
  ];
}
