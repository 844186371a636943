// Audit: who replayed, edited, discarded or restored what, when, how many, why; how each
// replay ended and what became of its copies (succeeded, parked again, still pending); newest
// first, a page at a time.

import { call, withQuery } from "../api.js";
import { asText, count, h, shorten, when } from "../dom.js";

const PAGE = 100;
const REPLAYS = new Set(["replay", "edit"]);

// {"group": "ab12…"} -> "group ab12…"; {"ids": [1, 2]} -> "2 messages: 1, 2" (the first few).
function selectionText(selection) {
  if (selection === null || selection === undefined) return "—";
  if (typeof selection !== "object" || Array.isArray(selection)) return asText(selection);
  const parts = [];
  for (const [key, value] of Object.entries(selection)) {
    if (key === "outbox_ids" && Array.isArray(value)) {
      const shown = value.slice(0, 5).map(String).join(", ");
      const what = value.length === 1 ? "outbox event" : `${count(value.length)} outbox events:`;
      parts.push(`${what} ${shown}${value.length > 5 ? ", …" : ""}`);
    } else if (key === "ids" && Array.isArray(value)) {
      const shown = value.slice(0, 5).map(String).join(", ");
      const what = value.length === 1 ? "message" : `${count(value.length)} messages:`;
      parts.push(`${what} ${shown}${value.length > 5 ? ", …" : ""}`);
    } else {
      parts.push(`${key} ${asText(value)}`);
    }
  }
  return parts.join(" · ") || "—";
}

// A group's selection links to the group; one message's to the message; one outbox event's
// to the event.
function selection(value) {
  const group = value && typeof value === "object" ? value.group : null;
  if (typeof group === "string" && Object.keys(value).length === 1) {
    return ["group ", h("a", { href: `#/group/${encodeURIComponent(group)}`, class: "group" },
      h("code", {}, group))];
  }
  const events = value && typeof value === "object" ? value.outbox_ids : null;
  if (Array.isArray(events) && events.length === 1) {
    return ["outbox event ", h("a", { href: `#/outbox/${encodeURIComponent(events[0])}` }, `#${events[0]}`)];
  }
  const ids = value && typeof value === "object" ? value.ids : null;
  if (Array.isArray(ids) && ids.length === 1) {
    return ["message ", h("a", { href: `#/message/${encodeURIComponent(ids[0])}` }, `#${ids[0]}`)];
  }
  return shorten(selectionText(value), 200);
}

// How a replay went: "done: 5 replayed · 2 parked again · 3 succeeded · 0 pending".
function outcome(e) {
  if (!REPLAYS.has(e.action)) {
    if (e.action === "rule" && e.detail) {
      const rule = e.detail.added || e.detail.removed;
      return rule ? [e.detail.added ? "added " : "removed ", h("code", {}, rule.pattern), ` → <${rule.name}>`] : "";
    }
    return "";
  }
  const p = e.progress || {};
  const parts = [];
  if (e.state === "running") {
    parts.push(h("span", { class: "state state-running" }, "running"),
      ` ${count(p.done)} of ${count(p.total)}`);
  } else {
    parts.push(h("span", { class: `state state-${e.state}` }, e.state), ` ${count(p.done)} replayed`);
  }
  if (p.refused) parts.push(` · ${count(p.refused)} refused`);
  if (e.resent) parts.push(h("span", { class: "resent", title: "copies a desk re-sent when it took over this replay from a desk that stopped: they may have arrived twice" }, ` · ${count(e.resent)} re-sent (may have arrived twice)`));
  const r = e.results;
  if (r && e.state !== "running") {
    parts.push(h("div", { class: "results" },
      h("span", { class: "succeeded", title: "handled and not parked since (at least)" }, `${count(r.succeeded)} succeeded`), " · ",
      h("span", { class: "parked-again" }, h("a", { href: `#/messages?q=replay-id%3D${encodeURIComponent(e.replay_id)}&status=any` }, `${count(r.parked_again)} parked again`)), " · ",
      h("span", { class: "pending", title: "may still be in the queue or its retry tiers" }, `${count(r.pending)} pending`)));
  }
  if (e.cancelled_by) parts.push(h("div", {}, `cancelled by ${e.cancelled_by}`));
  if (e.outcome && e.state !== "done" && !e.cancelled_by) parts.push(h("div", { class: "why" }, e.outcome));
  if (e.detail && e.detail.body) {
    parts.push(h("details", { class: "edit" }, h("summary", {}, "the edit"),
      h("pre", { class: "diff" }, e.detail.body)));
  }
  if (e.detail && Array.isArray(e.detail.headers) && e.detail.headers.length) {
    parts.push(h("details", { class: "edit" }, h("summary", {}, `${e.detail.headers.length} header(s) changed`),
      h("ul", {}, e.detail.headers.map((c) => h("li", {}, h("code", {}, c.name), ": ",
        asText(c.before ?? "(none)"), " → ", asText(c.after ?? "(removed)"))))));
  }
  return parts;
}

export async function renderAudit(ctx) {
  let offset = Number.parseInt(ctx.params.get("offset") || "", 10);
  if (!Number.isFinite(offset) || offset < 0) offset = 0;
  const entries = await call(withQuery("/api/audit", { limit: PAGE, offset }));
  const rows = entries.map((e) => h("tr", { dataset: { action: e.action, replay: e.replay_id || "" } },
    h("td", { class: "time" }, when(e.at)),
    h("td", { class: "actor" }, e.actor || "—"),
    h("td", {}, h("span", { class: `action action-${String(e.action).replace(/[^a-z0-9-]/gi, "")}` }, e.action)),
    h("td", { class: "num" }, count(e.count)),
    h("td", { class: "selection", title: asText(e.selection) },
      selection(e.selection), e.to_queue ? [" → ", h("code", {}, e.to_queue)] : null),
    h("td", { class: "reason" }, e.reason || ""),
    h("td", { class: "replay-id" }, e.replay_id ? h("code", {}, e.replay_id) : ""),
    h("td", { class: "outcome" }, outcome(e))));
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
      : h("p", { class: "muted empty" }, offset ? "No older entries." : "Nothing was done yet."),
    pager,
  ];
}
