// Audit: who replayed or discarded what, when, how many, why, and how each replay ended; newest
// first, a page at a time.

import { call, withQuery } from "../api.js";
import { asText, count, h, shorten, when } from "../dom.js";

const PAGE = 100;

// {"group": "ab12…"} -> "group ab12…"; {"ids": [1, 2]} -> "2 messages: 1, 2" (the first few).
function selectionText(selection) {
  if (selection === null || selection === undefined) return "—";
  if (typeof selection !== "object" || Array.isArray(selection)) return asText(selection);
  const parts = [];
  for (const [key, value] of Object.entries(selection)) {
    if (key === "ids" && Array.isArray(value)) {
      const shown = value.slice(0, 5).map(String).join(", ");
      const what = value.length === 1 ? "message" : `${count(value.length)} messages:`;
      parts.push(`${what} ${shown}${value.length > 5 ? ", …" : ""}`);
    } else {
      parts.push(`${key} ${asText(value)}`);
    }
  }
  return parts.join(" · ") || "—";
}

// A group's selection links to that group's messages, whatever became of them.
function selection(ctx, value) {
  const group = value && typeof value === "object" ? value.group : null;
  if (typeof group === "string" && Object.keys(value).length === 1) {
    return ["group ", h("a", { href: ctx.link("messages", { group, status: "any" }), class: "group" },
      h("code", {}, group))];
  }
  return shorten(selectionText(value), 200);
}

// How a replay ended: "done: 5 replayed", "running", "failed: <why> (3 replayed)".
function state(e) {
  if (e.action !== "replay" || !e.state) return "";
  if (e.state === "pending") return "running";
  const done = typeof e.done_count === "number" ? ` (${count(e.done_count)} replayed)` : "";
  return e.state === "failed" ? `failed: ${e.outcome || "?"}${done}` : `${e.state}${done}`;
}

export async function renderAudit(ctx) {
  let offset = Number.parseInt(ctx.params.get("offset") || "", 10);
  if (!Number.isFinite(offset) || offset < 0) offset = 0;
  const entries = await call(withQuery("/api/audit", { limit: PAGE, offset }));
  const rows = entries.map((e) => h("tr", {},
    h("td", {}, when(e.at)),
    h("td", { class: "actor" }, e.actor || "—"),
    h("td", {}, h("span", { class: `action action-${String(e.action).replace(/[^a-z0-9-]/gi, "")}` }, e.action)),
    h("td", { class: "num" }, count(e.count)),
    h("td", { class: "selection", title: asText(e.selection) },
      selection(ctx, e.selection), e.to_queue ? [" → ", h("code", {}, e.to_queue)] : null),
    h("td", { class: "reason" }, e.reason || ""),
    h("td", {}, e.replay_id ? h("code", {}, e.replay_id) : ""),
    h("td", { class: "state" }, state(e))));
  const pager = h("nav", { class: "pager", "aria-label": "pages" },
    offset > 0 ? h("a", { href: ctx.link("audit", { offset: Math.max(0, offset - PAGE) || "" }), id: "audit-newer" }, "‹ newer") : null,
    entries.length === PAGE ? h("a", { href: ctx.link("audit", { offset: offset + PAGE }), id: "audit-older" }, "older ›") : null);
  return [
    h("h2", {}, "Audit"),
    entries.length
      ? h("table", { class: "grid", id: "audit" },
        h("thead", {}, h("tr", {}, h("th", {}, "When"), h("th", {}, "Who"), h("th", {}, "Action"),
          h("th", { class: "num" }, "Messages"), h("th", {}, "Selection"), h("th", {}, "Reason"),
          h("th", {}, "Replay id"), h("th", {}, "Outcome"))),
        h("tbody", {}, rows))
      : h("p", { class: "muted empty" }, offset ? "No older entries." : "Nothing was replayed or discarded yet."),
    pager,
  ];
}
