// One message: what failed, every header and property, the body, and what can be done with it.

import { call } from "../api.js";
import { discard, replay, report } from "../dialogs.js";
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

export async function renderMessage(ctx) {
  const m = await call(`/api/messages/${encodeURIComponent(ctx.arg)}`);
  const headers = m.headers || {};
  const properties = m.properties || {};
  const parked = m.status === "parked";

  async function act(kind) {
    const messages = [m];
    const result = kind === "replay"
      ? await replay({ messages }, await ctx.queues())
      : await discard({ messages });
    if (!result) return;
    report(ctx, result);
    ctx.rerender();
  }

  const summary = [
    ["Message id", m.message_id || "—"],
    ["Correlation id", m.correlation_id || "—"],
    ["Queue", m.queue],
    ["Status", h("span", { class: `status status-${m.status}` }, m.status)],
    ["Reason", m.reason || "—"],
    ["Attempts", m.attempts ?? "—"],
    ["Parked at", when(m.parked_at)],
    ...(m.replay_id ? [["Replay", h("code", {}, m.replay_id)]] : []),
    ...(m.replayed_to ? [["Replayed to", m.replayed_to]] : []),
    ...(m.discard_reason ? [["Discarded because", m.discard_reason]] : []),
    ...(m.changed_at ? [["Status since", when(m.changed_at)]] : []),
    ["Group", m.group
      ? h("a", { href: ctx.link("messages", { group: m.group, queue: m.queue, status: "any" }) },
        "messages of the same cause")
      : "—"],
  ];

  return [
    h("p", {}, h("a", { href: "#/messages", class: "back" }, "← messages")),
    h("h2", {}, "Message ", h("code", { id: "message-id" }, m.message_id || `#${m.id}`)),
    h("dl", { class: "summary" }, summary.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
    parked
      ? h("div", { class: "toolbar" },
        h("button", { type: "button", id: "replay-message", onclick: () => act("replay").catch(ctx.fail) }, "Replay…"),
        h("button", { type: "button", id: "discard-message", class: "danger", onclick: () => act("discard").catch(ctx.fail) }, "Discard…"))
      : null,
    h("h3", {}, "Exception"),
    h("p", { class: "exception", id: "message-exception" },
      h("b", {}, m.exception_type || "(none)"), " ", m.exception_message || ""),
    typeof headers[STACKTRACE] === "string"
      ? h("details", {}, h("summary", {}, "Stack trace"), h("pre", { class: "trace" }, headers[STACKTRACE]))
      : null,
    body(m),
    h("h3", {}, "Headers"),
    h("div", { id: "message-headers" },
      pairs(Object.entries(headers).sort(([a], [b]) => a.localeCompare(b)), "no headers")),
    h("h3", {}, "Properties"),
    h("div", { id: "message-properties" },
      pairs(Object.entries(properties).sort(([a], [b]) => a.localeCompare(b)), "no properties")),
  ];
}
