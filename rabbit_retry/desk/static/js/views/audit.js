// Audit: who replayed or discarded what, when, how many, and why.

import { call } from "../api.js";
import { asText, count, h, shorten, when } from "../dom.js";

// {"group": "ab12…", "to": "q2"} -> "group ab12… · to q2"; ids are listed, the first few.
function selectionText(selection) {
  if (selection === null || selection === undefined) return "—";
  if (typeof selection !== "object" || Array.isArray(selection)) return asText(selection);
  const parts = [];
  for (const [key, value] of Object.entries(selection)) {
    if (key === "ids" && Array.isArray(value)) {
      const shown = value.slice(0, 5).map(String).join(", ");
      parts.push(`${value.length === 1 ? "message" : `${value.length} messages`} ${shown}${value.length > 5 ? ", …" : ""}`);
    } else {
      parts.push(`${key} ${asText(value)}`);
    }
  }
  return parts.join(" · ") || "—";
}

export async function renderAudit() {
  const entries = await call("/api/audit");
  const rows = entries.map((e) => h("tr", {},
    h("td", {}, when(e.at)),
    h("td", { class: "actor" }, e.actor || "—"),
    h("td", {}, h("span", { class: `action action-${String(e.action).replace(/[^a-z0-9-]/gi, "")}` }, e.action)),
    h("td", { class: "num" }, count(e.count)),
    h("td", { class: "selection", title: asText(e.selection) }, shorten(selectionText(e.selection), 200)),
    h("td", { class: "reason" }, e.reason || ""),
    h("td", {}, e.replay_id ? h("code", {}, e.replay_id) : "")));
  return [
    h("h2", {}, "Audit"),
    entries.length
      ? h("table", { class: "grid", id: "audit" },
        h("thead", {}, h("tr", {}, h("th", {}, "When"), h("th", {}, "Who"), h("th", {}, "Action"),
          h("th", { class: "num" }, "Messages"), h("th", {}, "Selection"), h("th", {}, "Reason"),
          h("th", {}, "Replay id"))),
        h("tbody", {}, rows))
      : h("p", { class: "muted empty" }, "Nothing was replayed or discarded yet."),
  ];
}
